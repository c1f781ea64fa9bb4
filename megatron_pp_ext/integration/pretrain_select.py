"""The fastest schedule that fits, for a Megatron-LM command line: every candidate planned
(``pretrain_plan.plan_pretrain``) on the arguments' own model, layout and GPU, ranked by
predicted step among those whose every rank fits in the GPU's memory.

A candidate runs the model chunked as it needs: one chunk per rank (1f1b, gpipe, zb-h1,
zb-h2), the arguments' virtual stages (at least 2) for interleaved, two V chunks for zb-v and
dualpipev: ``--num-virtual-stages-per-pipeline-rank`` is set accordingly (a
``--pipeline-model-parallel-layout`` string fixes the chunks: a candidate that needs others is
excluded, as is one Megatron's layout flags rule out, with the plan's reason).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from ..schedules import candidates_by_layout
from ..units import human_bytes
from .pretrain_plan import PretrainPlan, plan_pretrain
from .gpus import DEFAULT_EFFICIENCY, DEFAULT_RESERVE_BYTES

#: flags that set the virtual stages, each with its value (replaced per candidate)
_VIRTUAL_FLAGS = ("--num-virtual-stages-per-pipeline-rank",
                  "--num-layers-per-virtual-pipeline-stage")


@dataclass
class PretrainSelection:
    ranked: list[PretrainPlan]  # fastest first, every rank fits
    too_big: list[PretrainPlan]  # planned, some rank does not fit
    excluded: list[tuple[str, str]] = field(default_factory=list)  # (name, why)

    @property
    def best(self) -> PretrainPlan | None:
        return self.ranked[0] if self.ranked else None


def select_pretrain(argv: Sequence[str], gpu: str | None, world_size: int | None = None,
                    gpu_memory: int | None = None, efficiency: float = DEFAULT_EFFICIENCY,
                    candidates: Sequence[str] | None = None,
                    reserve: int = DEFAULT_RESERVE_BYTES) -> PretrainSelection:
    """Plan every candidate (default: every registered schedule) for ``argv`` on ``gpu``
    (its FLOPs price the stages; its memory, or ``gpu_memory`` bytes, is the budget) and rank
    them. ValueError when the budget or the costs are unknown."""
    if gpu is None:
        raise ValueError("select with Megatron-LM's arguments prices each stage from its FLOPs: "
                         "give --gpu NAME (H100, H200, B200), and --gpu-memory SIZE for "
                         "another capacity")
    argv = [str(a) for a in argv]
    layouts = candidates_by_layout()
    names = ([str(n).strip().lower() for n in candidates] if candidates else
             list(dict.fromkeys(n for names in layouts.values() for n in names)))
    ranked, too_big, excluded = [], [], []
    for name, chunks in ((n, c) for n in names for c in _chunks_for(n, layouts)):
        try:
            plan = plan_pretrain(_with_chunks(argv, chunks), schedule=name,
                                 world_size=world_size, gpu=gpu, gpu_memory=gpu_memory,
                                 efficiency=efficiency, reserve=reserve)
        except ValueError as exc:
            excluded.append((name, str(exc)))
            continue
        (ranked if all(rank.fits for rank in plan.memory) else too_big).append(plan)
    ranked.sort(key=lambda plan: plan.timeline.makespan)
    too_big.sort(key=lambda plan: max(rank.total for rank in plan.memory))
    return PretrainSelection(ranked, too_big, excluded)


def _chunks_for(name: str, layouts: dict) -> tuple[int | None, ...]:
    """The chunks per rank the candidate is planned with (None: the arguments' own, for
    interleaved; zb-auto both ways: the loop layout and the V layout)."""
    ways = tuple(chunks for key, chunks in (("one-chunk", 1), ("v", 2))
                 if name in layouts[key])
    return ways or (None,)


def _with_chunks(argv: list[str], chunks: int | None) -> list[str]:
    """``argv`` with its virtual-stage flags set for ``chunks`` per rank (None: unchanged,
    at least 2). A layout string is left alone: it fixes the chunks."""
    if chunks is None and not any(flag in argv for flag in _VIRTUAL_FLAGS):
        chunks = 2
    if chunks is None or any(a.startswith("--pipeline-model-parallel-layout") for a in argv):
        return argv
    out, skip = [], False
    for token in argv:
        if skip:
            skip = False
            continue
        if token in _VIRTUAL_FLAGS:
            skip = True
            continue
        if token.split("=", 1)[0] in _VIRTUAL_FLAGS:
            continue
        out.append(token)
    return out + (["--num-virtual-stages-per-pipeline-rank", str(chunks)] if chunks > 1 else [])


def selection_report(selection: PretrainSelection) -> str:
    """The candidates as a table: ranked (fastest first) then those that do not fit, then the
    excluded ones with their reasons."""
    plans = selection.ranked + selection.too_big
    lines = []
    if plans:
        first = plans[0]
        lines += [f"p={first.p} m={first.m} (tp {first.tp}, dp {first.dp}); each stage priced "
                  f"from its FLOPs at {first.efficiency:g} of the {first.gpu.name}'s peak; "
                  f"budget {human_bytes(first.memory[0].budget)} per rank less a "
                  f"{human_bytes(first.memory[0].reserve)} reserve (--reserve), for weights, "
                  "gradients, optimizer state and activations", ""]
    header = ("#", "schedule", "v", "step", "vs best", "bubble", "most bytes on a rank",
              "fits")
    best = selection.best.timeline.makespan if selection.best else None
    fitting = len(selection.ranked)
    rows = [(str(i + 1) if i < fitting else "-", plan.name, str(plan.v),
             f"{plan.timeline.makespan * 1e3:.5g} ms",
             f"{plan.timeline.makespan / best:.3f}" if best else "-",
             f"{100 * plan.timeline.bubble_fraction:.1f}%",
             human_bytes(max(rank.total for rank in plan.memory)),
             "yes" if i < fitting else "no") for i, plan in enumerate(plans)]
    widths = [max([len(h)] + [len(row[c]) for row in rows]) for c, h in enumerate(header)]
    lines.append("  ".join(h.ljust(w) for h, w in zip(header, widths)).rstrip())
    lines += ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    if not selection.ranked:
        lines.append("no schedule fits: see `plan` for each rank's bytes")
    if selection.excluded:
        lines += ["", "excluded:"] + [f"  {name}: {why}" for name, why in selection.excluded]
    return "\n".join(lines)


def selection_dict(selection: PretrainSelection) -> dict:
    def row(plan: PretrainPlan) -> dict:
        return {"schedule": plan.name, "v": plan.v, "predicted_step_s": plan.timeline.makespan,
                "bubble_fraction": plan.timeline.bubble_fraction,
                "total_bytes": [rank.total for rank in plan.memory],
                "fits": [rank.fits for rank in plan.memory],
                "stages": [stage.describe() for stage in plan.stages]}

    return {"ranked": [row(plan) for plan in selection.ranked],
            "too_big": [row(plan) for plan in selection.too_big],
            "excluded": [{"schedule": n, "reason": why} for n, why in selection.excluded]}


__all__ = ["PretrainSelection", "select_pretrain", "selection_dict", "selection_report"]
