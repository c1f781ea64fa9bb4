"""Bench: cross-step figures through Megatron-LM's real training loop on the CPU.

``megatron.training.pretrain`` (the wheel's) trains the tiny GPT (``tests/support/megatron_loop``)
with p = 4 pipeline ranks, m = 8 microbatches, fp16 with Megatron's dynamic loss scaler and
``--clip-grad``, over gloo. The GPT runs for real; each action is then made to last a device
kernel's time, as on the emulated device (``bench.emulated_device.DeviceClock``: the action's
CPU work, then a sleep until start + cost): ``t`` per forward, input-gradient and
weight-gradient half of a rank's layers (a full backward 2t; a chunk of a V schedule t/2), and
the optimizer's ``step_with_ready_grads`` ``t_opt`` (post-validation's snapshot ``t_copy``
more), so that the pipeline's shape, not the 2-core CPU, sets the step time.

Rows (one launch of 4 processes each, rotating order, ``rounds`` rounds):

* ``1f1b sync``: ``--pipeline-schedule 1f1b``, Megatron-LM's own ``train_step`` (its
  ``optimizer.step()`` waits for the grad norm and found-inf of every rank);
* ``zb-h2 sync``: the same with zb-h2;
* ``zb-h2 run-ahead`` / ``zb-v run-ahead``: ``--pp-post-validate --pp-run-ahead``; ``zb-v w=7
  run-ahead`` with ``--pp-warmup-forwards 7`` (2p-1: zb-h2's memory, steps that overlap)
  (``integration.run_ahead_step``), with ``--rerun-mode disabled`` (its flag all-reduce would
  hold the ranks together every step: ``run_ahead_step.synchronising_flags``).

Every row uses ``--rerun-mode disabled``, ``--log-interval`` beyond the run and timing level 0
(the loop's logging timers barrier the ranks). The steady step is ``(E_K - E_W) / (K - W)``,
``E_j`` the time the last rank returns from ``train_step`` j (one monotonic clock for all
processes), after ``W`` warm-up steps; ratios are to ``1f1b sync`` of the same round.

    .venv/bin/python -m bench.megatron_loop_cross_step            # writes bench/results/
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT, ROOT / "tests"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

ROWS = {  # label: (schedule, vp, run ahead, more flags)
    "1f1b sync": ("1f1b", None, False, ()),
    "zb-h2 sync": ("zb-h2", None, False, ()),
    "zb-h2 run-ahead": ("zb-h2", None, True, ()),
    "zb-v run-ahead": ("zb-v", 2, True, ()),
    # zb-v at zb-h2's memory: 2p-1 = 7 warm-up forwards, so that its steps overlap
    "zb-v w=7 run-ahead": ("zb-v", 2, True, ("--pp-warmup-forwards", "7")),
}


def _device_time(t: float, t_opt: float, t_copy: float, v: int) -> None:
    """Make each action of this process last its device time (see the module docstring)."""
    from megatron.core.optimizer.optimizer import MixedPrecisionOptimizer

    from bench.emulated_device import DeviceClock
    from megatron_pp_ext.integration import post_validation
    from megatron_pp_ext.integration.megatron_stage import MegatronStageWork

    def lasting(method, cost_of):
        def timed(self, *args, **kwargs):
            start = time.perf_counter()
            out = method(self, *args, **kwargs)
            DeviceClock.wait_until(start + cost_of(args[0] if args else None))
            return out
        return timed

    chunk = t / v
    MegatronStageWork.forward = lasting(MegatronStageWork.forward, lambda a: chunk)
    MegatronStageWork.backward = lasting(
        MegatronStageWork.backward, lambda a: chunk if a.kind == "I" else 2 * chunk)
    MegatronStageWork.weight = lasting(MegatronStageWork.weight, lambda a: chunk)
    MixedPrecisionOptimizer.step_with_ready_grads = lasting(
        MixedPrecisionOptimizer.step_with_ready_grads, lambda a: t_opt)
    post_validation._Snapshot.__init__ = lasting(post_validation._Snapshot.__init__,
                                                 lambda a: t_copy)


def run_rank(rank: int, world_size: int, argv, t: float, t_opt: float, t_copy: float,
             v: int) -> dict:
    """Spawn target: pretrain() with device times; when each train_step returned."""
    _device_time(t, t_opt, t_copy, v)
    from support.megatron_loop import run_pretrain

    return run_pretrain(rank, world_size, argv)


def argv_for(label: str, iters: int, m: int, clip: float) -> list[str]:
    from support.megatron_loop import pretrain_argv

    schedule, vp, run_ahead, more = ROWS[label]
    extra = ["--fp16", "--initial-loss-scale", "1024", "--clip-grad", str(clip), "--rerun-mode", "disabled",
             "--log-interval", str(iters + 1), "--timing-log-level", "0"]
    if run_ahead:
        extra += ["--pp-post-validate", "--pp-run-ahead"]
    extra += list(more)
    argv = pretrain_argv(pp=4, dp=1, schedule=schedule, vp=vp, iters=iters,
                         num_microbatches=m, extra=extra)
    argv.remove("--bf16")
    return argv


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--t", type=float, default=0.020)
    parser.add_argument("--t-opt", type=float, default=0.010)
    parser.add_argument("--t-copy", type=float, default=0.005)
    parser.add_argument("-m", type=int, default=8)
    parser.add_argument("--iters", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--clip", type=float, default=10.0,
                        help="--clip-grad (on; the default never triggers on the tiny GPT)")
    parser.add_argument("--out", default="bench/results/megatron_loop_cross_step")
    args = parser.parse_args()

    from bench import provenance
    from megatron_pp_ext.train.processes import spawn

    prov, started = provenance.current(), time.perf_counter()
    labels = list(ROWS)
    periods = {label: [] for label in labels}
    details = {label: [] for label in labels}
    for r in range(args.rounds):
        order = labels[r % len(labels):] + labels[:r % len(labels)]
        for label in order:
            v = ROWS[label][1] or 1
            results = spawn(4, run_rank, argv_for(label, args.iters, args.m, args.clip),
                            args.t, args.t_opt, args.t_copy, v, timeout_s=600)
            ends = [max(res["step_end_s"][j] for res in results) for j in range(args.iters)]
            w = args.warmup
            periods[label].append((ends[-1] - ends[w - 1]) / (args.iters - w))
            steps = results[0].get("run_ahead") or []
            details[label].append({"replayed": [s["replayed"] for s in steps],
                                   "grad_norm": results[0]["grad_norm"],
                                   "skipped": results[0]["skipped"]})
            print(f"round {r} {label}: {periods[label][-1] * 1e3:.1f} ms", flush=True)
    ratios = {label: [p / b for p, b in zip(periods[label], periods["1f1b sync"])]
              for label in labels}
    out = {"provenance": provenance.finish(prov, started), "t": args.t, "t_opt": args.t_opt, "t_copy": args.t_copy, "p": 4, "m": args.m,
           "iters": args.iters, "warmup": args.warmup, "clip": args.clip,
           "rows": [{"label": label, "periods_s": periods[label],
                     "period_s": statistics.median(periods[label]),
                     "vs_1f1b_sync_rounds": ratios[label],
                     "vs_1f1b_sync": statistics.median(ratios[label]),
                     "runs": details[label]} for label in labels]}
    Path(args.out + ".json").write_text(json.dumps(out, indent=1))
    lines = ["### Cross-step through Megatron-LM's real training loop (CPU, device times)", "",
             f"{provenance.short(out['provenance'])}: p=4, m={args.m}, t={args.t * 1e3:g} ms per F/I/W, "
             f"t_opt={args.t_opt * 1e3:g} ms, t_copy={args.t_copy * 1e3:g} ms, fp16 with "
             f"loss scaling, --clip-grad {args.clip:g}; steady step over iterations "
             f"{args.warmup + 1}-{args.iters}, median (min-max) of {args.rounds} rounds.", "",
             "| row | steady step (ms) | vs 1f1b sync |", "|---|---|---|"]
    for row in out["rows"]:
        ms = [x * 1e3 for x in row["periods_s"]]
        rs = row["vs_1f1b_sync_rounds"]
        lines.append(f"| {row['label']} | {row['period_s'] * 1e3:.1f} ({min(ms):.1f}-"
                     f"{max(ms):.1f}) | {row['vs_1f1b_sync']:.3f} ({min(rs):.3f}-"
                     f"{max(rs):.3f}) |")
    Path(args.out + ".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
