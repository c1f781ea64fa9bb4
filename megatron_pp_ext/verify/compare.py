"""Same training? Two runs' records compared step by step: the loss, the grad norm, every
parameter's gradient norm (per tensor-parallel and expert-parallel rank; each copy of a
dualpipe part), the skipped flag and the microbatch count.

Verdicts: IDENTICAL (every number bit for bit), WITHIN TOLERANCE (every relative difference
within the tolerance below), DIFFERENT (the first step, rank, stage and parameter past it, and
by how much). The tolerance follows from the dtypes and the order of the reductions:

* step 1 starts from the same weights, so only the order of the gradient sums differs (a
  schedule that runs microbatches, stages or copies in another order): a few roundings of the
  gradient's accumulation dtype, fp32 (bf16 and fp32 runs; Megatron accumulates bf16
  gradients in fp32) or fp16 (``--fp16`` without ``--accumulate-allreduce-grads-in-fp32``);
* later steps run on weights an optimizer step rounded to the parameter dtype: one weight on
  the other side of a rounding boundary (one bf16 or fp16 ulp) moves the next losses and
  gradients by a little more (measured on the tests' GPT: bf16 losses 1.5e-5, grad norms
  6.5e-4 at step 5).

A parameter's gradient norm is also held to an absolute floor, the tolerance times the step's
grad norm, so a parameter whose gradient is nearly zero is not judged on its last bits.
"""

from __future__ import annotations

from dataclasses import dataclass, field

IDENTICAL, WITHIN, DIFFERENT = "IDENTICAL", "WITHIN TOLERANCE", "DIFFERENT"

#: unit roundoff of each dtype
EPS = {"fp32": 2.0 ** -24, "bf16": 2.0 ** -8, "fp16": 2.0 ** -11}


@dataclass(frozen=True)
class Tolerance:
    first_step: float  # relative, step 1: the reductions' order
    loss: float  # relative, later steps
    grad_norm: float  # relative, later steps (the step's grad norm and each parameter's)
    reason: str

    def at(self, step: int, what: str) -> float:
        if step == 1:
            return self.first_step
        return self.loss if what == "loss" else self.grad_norm


def tolerance_for(argv) -> Tolerance:
    """The tolerance of a run with these ``pretrain_gpt.py`` arguments (see the module)."""
    params = "bf16" if "--bf16" in argv else "fp16" if "--fp16" in argv else "fp32"
    fp16_grads = params == "fp16" and "--accumulate-allreduce-grads-in-fp32" not in argv
    grads = "fp16" if fp16_grads else "fp32"
    first = 64 * EPS["fp32"] if grads == "fp32" else 4 * EPS["fp16"]
    later_loss = {"bf16": 1e-4, "fp16": 2e-5, "fp32": 1e-6}[params]
    later_grad = max(first, {"bf16": 2e-3, "fp16": 1e-3, "fp32": 1e-5}[params])
    reason = (f"gradients accumulated in {grads}, parameters in {params}: step 1 within "
              f"{first:.1e} (the sums' order), later steps the weights' {params} rounding "
              f"(losses {later_loss:.0e}, grad norms {later_grad:.0e})")
    if any(str(arg).startswith("--fp8") for arg in argv):
        reason += ("; FP8 is not accounted for (its scaling factors follow the GEMMs' order, "
                   "which a schedule changes): a difference may be FP8's own")
    return Tolerance(first, later_loss, later_grad, reason)


@dataclass
class Difference:
    step: int
    what: str  # "loss", "grad norm", "gradient of <param>", "skipped", "microbatches"
    reference: float | None
    candidate: float | None
    relative: float
    where: str = ""  # "pipeline rank 1 (stage 2), tp 0"

    def text(self) -> str:
        return (f"step {self.step}: {self.what}{f' on {self.where}' if self.where else ''}: "
                f"{_fmt(self.reference)} (reference) vs {_fmt(self.candidate)} (candidate), "
                f"relative difference {self.relative:.2e}")


@dataclass
class Verdict:
    verdict: str
    tolerance: Tolerance
    per_step: list[str] = field(default_factory=list)
    worst: list[float] = field(default_factory=list)  # per step: the largest relative difference
    first_difference: Difference | None = None
    compared: int = 0  # numbers compared

    @property
    def exit_code(self) -> int:
        return 0 if self.verdict in (IDENTICAL, WITHIN) else 1


def _fmt(value) -> str:
    return "none" if value is None else f"{value:.9g}"


def _relative(a, b) -> float:
    if a is None or b is None:
        return 0.0 if a is b else float("inf")
    if a == b:
        return 0.0
    return abs(a - b) / max(abs(a), abs(b), 1e-30)


def _within(what: str, want, got, allowed: float, floor: float) -> bool:
    """Whether two different numbers are within ``allowed`` (relative, with the absolute
    ``floor`` x ``allowed``); counts and flags never are."""
    if what in ("microbatches", "skipped") or want is None or got is None:
        return False
    return abs(want - got) <= allowed * max(abs(want), abs(got), floor)


def _step_numbers(ref: dict, cand: dict, k: int) -> list[tuple]:
    """(what, reference, candidate, where, absolute floor) of step k, in the order a first
    difference is looked for: the counts, the loss, each parameter's gradient, the grad
    norm."""
    r, c = ref["steps"][k], cand["steps"][k]
    numbers = [("microbatches", r["microbatches"], c["microbatches"], "", 0.0),
               ("skipped", r["skipped"], c["skipped"], "", 0.0),
               ("loss", r["loss"], c["loss"], "", 0.0)]
    scale = r["grad_norm"] or 0.0
    ref_norms, cand_norms = ref["param_norms"][k], cand["param_norms"][k]
    for key in sorted(set(ref_norms) | set(cand_norms)):
        entry = ref_norms.get(key) or cand_norms[key]
        name, tp, ep = entry["name"], entry["tp"], entry["ep"]
        want = ref_norms[key]["copies"][0][2] if key in ref_norms else None
        copies = cand_norms[key]["copies"] if key in cand_norms else [[None, None, None]]
        for pp, stage, got in copies:
            where = (f"pipeline rank {pp} (stage {stage}), tp {tp}" + (f", ep {ep}" if ep else "")
                     if pp is not None else f"tp {tp}: missing from the candidate")
            numbers.append((f"gradient of {name}", want, got, where, scale))
    # last: a parameter that differs names where; the grad norm then only says that it does
    return numbers + [("grad norm", r["grad_norm"], c["grad_norm"], "", 0.0)]


def compare_runs(ref: dict, cand: dict, tolerance: Tolerance) -> Verdict:
    """The verdict of ``cand`` against ``ref`` (records of ``recorder.merge_run``)."""
    verdict = Verdict(IDENTICAL, tolerance)
    steps = min(len(ref["steps"]), len(cand["steps"]))
    if len(ref["steps"]) != len(cand["steps"]):
        verdict.verdict = DIFFERENT
        verdict.first_difference = Difference(steps + 1, "steps run", len(ref["steps"]),
                                              len(cand["steps"]), float("inf"))
    for k in range(steps):
        step_verdict, worst = IDENTICAL, 0.0
        for what, want, got, where, floor in _step_numbers(ref, cand, k):
            verdict.compared += 1
            relative = _relative(want, got)
            if relative == 0.0:
                continue
            worst = max(worst, relative)
            if _within(what, want, got, tolerance.at(k + 1, what), floor):
                step_verdict = WITHIN if step_verdict == IDENTICAL else step_verdict
                continue
            step_verdict = DIFFERENT
            if verdict.first_difference is None:
                verdict.first_difference = Difference(k + 1, what, want, got, relative, where)
        verdict.per_step.append(step_verdict)
        verdict.worst.append(worst)
    for level in (DIFFERENT, WITHIN):
        if level in verdict.per_step or (level == DIFFERENT and verdict.first_difference):
            verdict.verdict = level
            break
    return verdict
