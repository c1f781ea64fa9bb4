"""``select --search-parallelism``'s answer as text or JSON: the fastest configurations, where
the arguments' own ranks, and the best's changes to the command line."""

from __future__ import annotations

from ..units import aligned_columns, human_bytes
from .parallel_configs import PARALLEL_FLAGS, SearchRow
from .parallel_schedules import ROUNDS
from .parallel_search import ParallelSearch
from .pretrain_select import RECOMPUTE_FLAGS, recompute_label

#: rows the text shows (the arguments' own is shown wherever it ranks)
SHOWN = 10
#: steps within this share of each other are a tie
TIE = 5e-4


def row_flags(row: SearchRow) -> list[str]:
    """The flags that set the row's configuration, schedule, chunks and recompute."""
    plan = row.plan
    flags = ["--pipeline-schedule", plan.name]
    flags += ["--num-virtual-stages-per-pipeline-rank", str(plan.v)] if plan.v > 1 else []
    return row.parallelism.flags() + flags + list(plan.recompute_flags or [])


def flags_to_drop(row: SearchRow, argv: list[str]) -> list[str]:
    """The arguments' parallel, schedule, layout and recompute flags (by name) the row runs
    without (a size given as 1, Megatron's default, changes nothing and stays)."""
    kept = {token for token in row_flags(row) if token.startswith("--")}
    given = {}
    for i, token in enumerate(argv):
        name, _, value = token.partition("=")
        if name.startswith("--"):
            given.setdefault(name, value or (argv[i + 1] if i + 1 < len(argv) else ""))
    return [flag for flag, value in given.items()
            if (flag in PARALLEL_FLAGS or flag in RECOMPUTE_FLAGS) and flag not in kept
            and not (flag in _SIZES and value == "1")]


#: the sizes whose 1 is Megatron's default
_SIZES = ("--context-parallel-size", "--expert-model-parallel-size",
          "--expert-tensor-parallel-size", "--tensor-model-parallel-size",
          "--pipeline-model-parallel-size")


def search_report(search: ParallelSearch, argv: list[str]) -> str:
    lines = [f"{search.world_size} GPUs on {search.machine}: {search.screened} configurations screened under 1F1B, {search.fitting} "
             f"fit; every schedule and recompute on the fastest and on yours", ""]
    header = ("#", "tp", "pp", "cp", "ep", "mbs", "schedule", "v", "recompute", "step",
              "tokens/s/GPU", "vs best", "most bytes on a rank")
    best = search.best.step_seconds if search.best else None
    shown = [(i, row) for i, row in enumerate(search.ranked)
             if i < SHOWN or row is search.given_row]
    rows = [_cells(i, row, best, row is search.given_row) for i, row in shown]
    lines += aligned_columns([header, *rows])
    if any(row.extended for _, row in shown):
        lines.append(f"~: planned at {ROUNDS[-1]} x pp microbatches and extended to the job's "
                     "(the steady state's step per microbatch); `plan` on the row's flags gives "
                     "the exact figure")
    if search.moe:
        lines.append("MoE: the planner over-predicts splits whose experts' tokens stay inside a "
                     "node (NVIDIA's published runs: +40% to +300%, docs/planning.md); measure "
                     "a change of ep with `verify` before you trust it")
    lines += ["", _given_line(search)]
    if search.best and search.best is not search.given_row:
        drop = flags_to_drop(search.best, argv)
        lines.append("best, on your command line: " + " ".join(row_flags(search.best))
                     + (f"; drop {' '.join(drop)}" if drop else ""))
    if search.excluded:
        lines += ["", "excluded:"] + [f"  {why}" for why in search.excluded]
    return "\n".join(lines)


def _cells(i: int, row: SearchRow, best: float | None, given: bool) -> tuple[str, ...]:
    par, plan = row.parallelism, row.plan
    return (str(i + 1) + (" yours" if given else ""), str(par.tp), str(par.pp), str(par.cp),
            str(par.ep), str(par.micro_batch), plan.name, str(plan.v),
            recompute_label(plan.recompute_flags or []),
            f"{'~' if row.extended else ''}{row.step_seconds * 1e3:.5g} ms",
            f"{row.tokens_per_s_per_gpu:,.0f}",
            f"{row.step_seconds / best:.3f}" if best else "-", human_bytes(row.most_bytes))


def _given_line(search: ParallelSearch) -> str:
    given, rank = search.given_row, search.rank_of_given()
    if given is None:
        return "yours: not planned (see excluded)"
    label = (f"yours ({given.parallelism.label()}, {given.plan.name} v{given.plan.v}, "
             f"recompute {recompute_label(given.plan.recompute_flags or [])})")
    if rank is None:
        return f"{label} does not fit: some rank is over the GPU's memory"
    if rank == 1:
        return f"{label} is the fastest the search found"
    if given.step_seconds <= search.best.step_seconds * (1 + TIE):
        return (f"{label} is as fast as the fastest the search found (those above it hold "
                "fewer bytes)")
    return (f"{label} ranks {rank} of {len(search.ranked)}; the best predicts "
            f"{100 * (given.step_seconds / search.best.step_seconds - 1):.1f}% more tokens/s")


def search_dict(search: ParallelSearch, argv: list[str]) -> dict:
    def row(entry: SearchRow) -> dict:
        plan = entry.plan
        return {"tp": entry.parallelism.tp, "pp": entry.parallelism.pp,
                "cp": entry.parallelism.cp, "ep": entry.parallelism.ep,
                "micro_batch": entry.parallelism.micro_batch, "schedule": plan.name,
                "v": plan.v, "recompute": recompute_label(plan.recompute_flags or []),
                "predicted_step_s": entry.step_seconds,
                "tokens_per_s_per_gpu": entry.tokens_per_s_per_gpu,
                "step_extended": entry.extended,
                "total_bytes": [rank.total for rank in plan.memory],
                "flags_to_set": row_flags(entry),
                "flags_to_drop": flags_to_drop(entry, argv),
                "yours": entry is search.given_row}

    return {"screened": search.screened, "fitting": search.fitting, "moe": search.moe,
            "ranked": [row(entry) for entry in search.ranked],
            "yours_rank": search.rank_of_given(), "excluded": search.excluded}


__all__ = ["flags_to_drop", "row_flags", "search_dict", "search_report"]
