"""``select --search-parallelism`` on the model, GPU count and global batch of each of NVIDIA's
published runs (``published_recipes.SPEED_RUNS``, the newest row of each): where NVIDIA's own
configuration ranks, what the planner predicts faster and by how much, and which schedule the
planner puts first on NVIDIA's own split of the GPUs.

    .venv/bin/python tests/support/published_search.py     # the table in docs/planning.md

(a few minutes: the 1024-GPU rows screen hundreds of splits). ``tests/test_parallel_search.py``
holds the 70B row.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path


def groups():
    """The newest row of each (model, GPU, GPUs, global batch, micro batch), with the ids of
    the rows of that configuration."""
    from published_recipes import SPEED_RUNS

    found: dict[tuple, list] = {}
    for run in SPEED_RUNS:
        key = (run.name.split(" ", 1)[1], run.gpu, run.world_size, _batch(run), run.argv)
        found.setdefault(key, []).append(run)
    return [(runs[0], [r.name.split()[0] for r in runs]) for runs in found.values()]


def _batch(run) -> int:
    return int(run.args[run.args.index("--global-batch-size") + 1])


def searched(run):
    from megatron_pp_ext.planner.parallel_search import search_parallelism

    return search_parallelism(run.args, run.gpu, run.world_size)


def own_split_best(search):
    """The fastest row on NVIDIA's own split of the GPUs (its micro batch too)."""
    return next((row for row in search.ranked if row.parallelism == search.given), None)


def describe(row) -> str:
    from megatron_pp_ext.planner.pretrain_select import recompute_label

    recompute = recompute_label(row.plan.recompute_flags or [])
    return (f"{row.parallelism.label()} {row.plan.name} v{row.plan.v}"
            + ("" if recompute == "none" else f" ({recompute})"))


def table() -> str:
    rows = ["| rows | GPUs, GBS | NVIDIA's (published tokens/s/GPU) | its rank, plan's tokens/s "
            "| the planner's best, tokens/s | best / NVIDIA's | best schedule on NVIDIA's split "
            "| search, s |", "|---|---|---|---|---|---|---|---|"]
    for run, ids in groups():
        started = time.process_time()
        search = searched(run)
        seconds = time.process_time() - started
        given, best, own = search.given_row, search.best, own_split_best(search)
        rows.append(
            f"| {', '.join(ids)} {run.name.split(' ', 1)[1]} | {run.world_size} {run.gpu}, "
            f"{_batch(run)} | {describe(given)} ({run.tokens_per_s_per_gpu:g}) | "
            f"{search.rank_of_given()} of {len(search.ranked)}, "
            f"{given.tokens_per_s_per_gpu:.0f} | {describe(best)}, "
            f"{best.tokens_per_s_per_gpu:.0f} | "
            f"{given.step_seconds / best.step_seconds:.3f} | "
            f"{describe(own)}, {own.tokens_per_s_per_gpu:.0f} | {seconds:.0f} |")
    return "\n".join(rows)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    print(table())
