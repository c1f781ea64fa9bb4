"""The fastest schedule that fits, for a Megatron-LM command line: every candidate planned
(``pretrain_plan.plan_pretrain``) on the arguments' own model, layout and GPU, ranked by
predicted step among those whose every rank fits in the GPU's memory.

A candidate runs the model chunked as it needs: one chunk per rank (1f1b, gpipe, zb-h1,
zb-h2), the arguments' virtual stages (at least 2) for interleaved, two V chunks for zb-v and
dualpipev: ``--num-virtual-stages-per-pipeline-rank`` is set accordingly (a
``--pipeline-model-parallel-layout`` string fixes the chunks: a candidate that needs others is
excluded, as is one Megatron's layout flags rule out, with the plan's reason).

``search_recompute``: each candidate also at every activation recompute a user would set,
cheapest first (none, selective, full recompute of the first n layers of each chunk with
``--recompute-method block``, n = 1, 2, ..., then every layer, ``uniform`` 1): the first that
fits is the candidate's row, its recompute priced from its FLOPs (``stage_flops``: the
recomputed layers' forward runs again before each backward); interleaved is then planned at
every v that splits a rank's layers evenly. ``scale_out`` N: the same model at N times the
data-parallel size (the global batch fixed, so N times fewer microbatches per pipeline). The
best row's changes to the command line: :func:`flags_to_set` and :func:`flags_to_drop`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from ..schedules import candidates_by_layout
from ..units import aligned_columns, human_bytes
from .gpus import DEFAULT_RESERVE_BYTES
from .pretrain_args import derive_sizes, parse_pretrain_args, split_launcher
from .pretrain_plan import PretrainPlan, plan_pretrain

#: flags that set the virtual stages, each with its value (replaced per candidate)
_VIRTUAL_FLAGS = ("--num-virtual-stages-per-pipeline-rank",
                  "--num-layers-per-virtual-pipeline-stage")


#: Megatron's recompute flags, each with its value when it takes one
RECOMPUTE_FLAGS = {"--recompute-granularity": 1, "--recompute-method": 1,
                    "--recompute-num-layers": 1, "--recompute-activations": 0}


@dataclass
class PretrainSelection:
    ranked: list[PretrainPlan]  # fastest first, every rank fits
    too_big: list[PretrainPlan]  # planned, some rank does not fit
    excluded: list[tuple[str, str]] = field(default_factory=list)  # (name, why)
    argv: list[str] = field(default_factory=list)  # the arguments as given

    @property
    def best(self) -> PretrainPlan | None:
        return self.ranked[0] if self.ranked else None


def select_pretrain(argv: Sequence[str], gpu: str | None, world_size: int | None = None,
                    gpu_memory: int | None = None, efficiency: float | None = None,
                    candidates: Sequence[str] | None = None,
                    reserve: int = DEFAULT_RESERVE_BYTES, search_recompute: bool = False,
                    scale_out: int = 1, machine: str | None = None) -> PretrainSelection:
    """Plan every candidate (default: every registered schedule) for ``argv`` on ``gpu``
    (its FLOPs price the stages; its memory, or ``gpu_memory`` bytes, is the budget) and rank
    them. ValueError when the budget or the costs are unknown."""
    if gpu is None and machine is None:
        raise ValueError("select with Megatron-LM's arguments prices each stage from its FLOPs: "
                         "give --gpu NAME (H100, H200, B200), and --gpu-memory SIZE for "
                         "another capacity")
    if scale_out < 1:
        raise ValueError(f"--scale-out {scale_out}: give how many times the data-parallel "
                         "size to plan for, N >= 1")
    argv = [str(a) for a in argv]
    interleaved_chunks: tuple[int | None, ...] = (None,)  # the arguments' own
    if scale_out > 1 or search_recompute:  # the job's sizes, read as plan_pretrain reads them
        pretrain_argv, launched, launched_from = split_launcher(argv)
        args = parse_pretrain_args(pretrain_argv)
        sizes = derive_sizes(args, world_size, launched, launched_from)
        world_size = scale_out * sizes.world_size  # the job's, times N
        layers = int(args.num_layers)
        if search_recompute:  # interleaved at every v that splits each rank's layers evenly
            per_rank = layers // sizes.pp if layers % sizes.pp == 0 else 0
            interleaved_chunks = tuple(v for v in range(2, per_rank + 1) if per_rank % v == 0)
    layouts = candidates_by_layout()
    names = ([str(n).strip().lower() for n in candidates] if candidates else
             list(dict.fromkeys(n for names in layouts.values() for n in names)))
    selection = PretrainSelection([], [], argv=argv)
    for name, chunks in ((n, c) for n in names
                         for c in _chunks_for(n, layouts, interleaved_chunks)):
        chunked = with_chunks(argv, chunks)

        def planned(candidate_argv):
            return plan_pretrain(candidate_argv, schedule=name, world_size=world_size, gpu=gpu,
                                 gpu_memory=gpu_memory, efficiency=efficiency, reserve=reserve,
                                 machine=machine)

        try:
            plan = planned(chunked)
            if search_recompute:
                plan = _cheapest_recompute_that_fits(plan, chunked, planned)
        except ValueError as exc:
            selection.excluded.append((name, str(exc)))
            continue
        (selection.ranked if plan.fits else selection.too_big).append(plan)
    selection.ranked.sort(key=lambda plan: plan.step_seconds)
    selection.too_big.sort(key=lambda plan: plan.most_bytes)
    return selection


def recompute_settings(layers_per_chunk: int) -> list[list[str]]:
    """Megatron's recompute flags a user would try, cheapest first: none, selective, full
    recompute of the first n layers of each chunk (n = 1 .. layers - 1), every layer."""
    full = ["--recompute-granularity", "full", "--recompute-method"]
    return ([[], ["--recompute-granularity", "selective"]]
            + [full + ["block", "--recompute-num-layers", str(n)]
               for n in range(1, layers_per_chunk)]
            + [full + ["uniform", "--recompute-num-layers", "1"]])


def _cheapest_recompute_that_fits(plan, argv, planned):
    """The candidate at the first recompute setting (cheapest first) whose every rank fits,
    else at the one that holds the fewest bytes (the last), with its flags. The block counts
    are bisected: recomputing more of a chunk's layers never holds more bytes."""
    base, given = _split_recompute(argv)

    def at(flags):
        tried = plan if not flags and not given else planned(base + flags)  # none: planned
        tried.recompute_flags = flags
        return tried

    settings = recompute_settings(plan.layers_per_stage)
    for flags in settings[:2]:  # none, selective
        tried = at(flags)
        if tried.fits:
            return tried
    cheapest = at(settings[-1])  # every layer: the fewest bytes
    blocks, low, high = settings[2:-1], 0, len(settings) - 3  # blocks[high:] fit, or none
    if not cheapest.fits:
        return cheapest
    while low < high:
        middle = (low + high) // 2
        tried = at(blocks[middle])
        if tried.fits:
            cheapest, high = tried, middle
        else:
            low = middle + 1
    return cheapest


def _split_recompute(argv: list[str]) -> tuple[list[str], list[str]]:
    """(``argv`` without Megatron's recompute flags, those flags with their values)."""
    return split_flags(argv, RECOMPUTE_FLAGS)


def split_flags(argv: list[str], arity: dict[str, int]) -> tuple[list[str], list[str]]:
    """(``argv`` without the flags named in ``arity`` (each with its count of values, or
    ``--flag=value``), those flags with their values)."""
    rest, taken, skip = [], [], 0
    for token in argv:
        if skip:
            skip -= 1
            taken.append(token)
            continue
        name = token.split("=", 1)[0]
        if name in arity:
            skip = arity[name] if "=" not in token else 0
            taken.append(token)
            continue
        rest.append(token)
    return rest, taken


def recompute_label(flags: list[str]) -> str:
    """``none``, ``selective``, ``full block 2``, ``full uniform 1``."""
    if not flags:
        return "none"
    values = [flags[i + 1] for i in range(0, len(flags), 2)]
    return " ".join(values)


def flags_to_set(selection: PretrainSelection, plan: PretrainPlan) -> list[str]:
    """What to add to (or change on) the command line for ``plan``'s row: the schedule, its
    virtual stages, and the recompute flags when they were searched and differ from the
    arguments'. What must go is :func:`flags_to_drop`."""
    flags = ["--pipeline-schedule", plan.name]
    if plan.v > 1 and not any(a.startswith("--pipeline-model-parallel-layout")
                              for a in selection.argv):
        flags += ["--num-virtual-stages-per-pipeline-rank", str(plan.v)]
    searched = plan.recompute_flags
    if searched and searched != _split_recompute(selection.argv)[1]:
        flags += searched
    return flags


def flags_to_drop(selection: PretrainSelection, plan: PretrainPlan) -> list[str]:
    """The flags of the arguments (by name) that ``plan``'s row runs without: the virtual-stage
    flags for one chunk per rank, the recompute flags the searched setting does not set (all of
    them where it needs none)."""
    given = [token.split("=", 1)[0] for token in selection.argv]
    drop = [flag for flag in _VIRTUAL_FLAGS if flag in given] if plan.v == 1 else []
    if plan.recompute_flags is not None:
        kept = set(plan.recompute_flags)
        drop += [flag for flag in RECOMPUTE_FLAGS if flag in given and flag not in kept]
    return drop


def command_line_changes(selection: PretrainSelection, plan: PretrainPlan) -> str:
    """``flags_to_set`` and ``flags_to_drop`` as one line of text."""
    drop = flags_to_drop(selection, plan)
    return " ".join(flags_to_set(selection, plan)) + (
        f"; drop {' '.join(drop)}" if drop else "")


def _chunks_for(name: str, layouts: dict,
                interleaved: tuple[int | None, ...] = (None,)) -> tuple[int | None, ...]:
    """The chunks per rank the candidate is planned with (``interleaved`` for the schedules
    with several loop chunks, None: the arguments' own; zb-auto both ways: the loop layout and
    the V layout; dualpipe: 2)."""
    ways = tuple(chunks for key, chunks in (("one-chunk", 1), ("v", 2), ("dual", 2))
                 if name in layouts[key])
    return ways or interleaved or (None,)


def with_chunks(argv: list[str], chunks: int | None) -> list[str]:
    """``argv`` with its virtual-stage flags set for ``chunks`` per rank (None: unchanged,
    at least 2). A layout string is left alone: it fixes the chunks."""
    if chunks is None and not any(flag in argv for flag in _VIRTUAL_FLAGS):
        chunks = 2
    if chunks is None or any(a.startswith("--pipeline-model-parallel-layout") for a in argv):
        return argv
    out, _ = split_flags(argv, dict.fromkeys(_VIRTUAL_FLAGS, 1))
    return out + (["--num-virtual-stages-per-pipeline-rank", str(chunks)] if chunks > 1 else [])


def selection_report(selection: PretrainSelection) -> str:
    """The candidates as a table: ranked (fastest first) then those that do not fit, then the
    excluded ones with their reasons."""
    plans = selection.ranked + selection.too_big
    lines = []
    if plans:
        first = plans[0]
        lines += [f"p={first.p} m={first.m} (tp {first.tp}, dp {first.dp}); "
                  f"{first.costs_text}; budget {human_bytes(first.memory[0].budget)} per rank less a "
                  f"{human_bytes(first.memory[0].reserve)} reserve (--reserve), for weights, "
                  "gradients, optimizer state and activations", ""]
    searched = any(plan.recompute_flags is not None for plan in plans)
    header = ("#", "schedule", "v") + (("recompute",) if searched else ()) + (
        "step", "vs best", "bubble", "most bytes on a rank", "fits")
    best = selection.best.step_seconds if selection.best else None
    fitting = len(selection.ranked)
    rows = [(str(i + 1) if i < fitting else "-", plan.name, str(plan.v))
            + ((recompute_label(plan.recompute_flags or []),) if searched else ())
            + (f"{plan.step_seconds * 1e3:.5g} ms",
               f"{plan.step_seconds / best:.3f}" if best else "-",
               f"{100 * plan.timeline.bubble_fraction:.1f}%",
               human_bytes(plan.most_bytes),
               "yes" if i < fitting else "no") for i, plan in enumerate(plans)]
    lines += aligned_columns([header, *rows])
    if not selection.ranked:
        lines.append("no schedule fits: see `plan` for each rank's bytes")
    else:
        lines += ["", "best, on your command line: "
                  + command_line_changes(selection, selection.best)]
    if selection.excluded:
        lines += ["", "excluded:"] + [f"  {name}: {why}" for name, why in selection.excluded]
    return "\n".join(lines)


def selection_dict(selection: PretrainSelection) -> dict:
    def row(plan: PretrainPlan) -> dict:
        return {"schedule": plan.name, "v": plan.v, "predicted_step_s": plan.step_seconds,
                "bubble_fraction": plan.timeline.bubble_fraction,
                "total_bytes": [rank.total for rank in plan.memory],
                "fits": [rank.fits for rank in plan.memory],
                "stages": [stage.describe() for stage in plan.stages],
                "recompute": (None if plan.recompute_flags is None
                              else recompute_label(plan.recompute_flags)),
                "flags_to_set": flags_to_set(selection, plan),
                "flags_to_drop": flags_to_drop(selection, plan)}

    return {"ranked": [row(plan) for plan in selection.ranked],
            "too_big": [row(plan) for plan in selection.too_big],
            "excluded": [{"schedule": n, "reason": why} for n, why in selection.excluded]}


__all__ = ["PretrainSelection", "RECOMPUTE_FLAGS", "command_line_changes", "flags_to_drop",
           "flags_to_set", "recompute_label", "recompute_settings", "select_pretrain",
           "selection_dict", "selection_report", "split_flags", "with_chunks"]
