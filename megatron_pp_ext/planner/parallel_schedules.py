"""The schedule pass of ``select --search-parallelism`` (``parallel_search``): one split of the
GPUs under every schedule, each at the cheapest recompute that fits (``select_pretrain`` with
``search_recompute``), as rows of the search.

A split of many microbatches (m > ``ROUNDS[-1]`` x pp) is planned at ``ROUNDS`` x pp of them and
its step extended linearly to m: past the fill every schedule repeats the same pattern, so each
further microbatch adds what the two plans show one adds (the busiest rank's work and whatever
waits it brings), and the per-step terms (the bubble, the data-parallel exchange, the
optimizer) stay. The rows say so (``SearchRow.extended``); the bytes a rank holds do not grow
with m under any of these schedules once m >= 2 pp (gpipe, which holds all m, is left out: its
step is 1F1B's). Planning 1024 microbatches on 16 stages under the searched schedules takes a
minute; 96 and 64 take seconds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ..schedules import candidates_by_layout
from .parallel_configs import Parallelism, SearchRow, exact_row, with_batch
from .pretrain_plan import PretrainPlan, plan_pretrain
from .pretrain_select import RECOMPUTE_FLAGS, select_pretrain, split_flags, with_chunks

#: multiples of pp a split of more microbatches is planned at (the step extended from them)
ROUNDS = (4, 6)


@dataclass
class Job:
    world_size: int
    global_batch: int
    pricing: dict  # gpu, gpu_memory, reserve, machine: as plan_pretrain takes them

    def microbatches(self, par: Parallelism) -> int:
        return self.global_batch // (par.micro_batch * self.data_parallel(par))

    def data_parallel(self, par: Parallelism) -> int:
        return self.world_size // (par.tp * par.pp * par.cp)


def schedule_rows(job: Job, par: Parallelism, argv: list[str],
                  candidates: Sequence[str] | None) -> list[SearchRow]:
    """Every schedule that fits on ``par`` (``argv`` already set to it), one row each per
    chunks and recompute. ValueError when Megatron refuses the split."""
    names = _candidates(par, candidates)
    m, low, high = job.microbatches(par), ROUNDS[0] * par.pp, ROUNDS[-1] * par.pp
    if m <= high:
        selection = _select(job, argv, names)
        return [exact_row(par, plan, selection) for plan in selection.ranked]
    per_microbatch = par.micro_batch * job.data_parallel(par)
    selection = _select(job, with_batch(argv, high * per_microbatch), names)
    rows = []
    for plan in selection.ranked:
        fewer = _replanned(job, plan, with_batch(argv, low * per_microbatch))
        slope = (plan.step_seconds - fewer.step_seconds) / (high - low)
        step = plan.step_seconds + (m - high) * slope
        tokens = job.global_batch * plan.step_model.shape.seq if plan.step_model else 0
        rows.append(SearchRow(par, plan, selection, step,
                              tokens / step / job.world_size if step else 0.0, extended=True))
    return rows


def _candidates(par: Parallelism, candidates: Sequence[str] | None) -> list[str] | None:
    """One stage: every schedule runs the same step (1F1B's row stands for them); gpipe's step
    is 1F1B's with every microbatch held."""
    if par.pp == 1:
        return ["1f1b"]
    if candidates:
        return list(candidates)
    names = dict.fromkeys(n for group in candidates_by_layout().values() for n in group)
    return [name for name in names if name != "gpipe"]


def _select(job: Job, argv: list[str], names: list[str] | None):
    return select_pretrain(argv, world_size=job.world_size, candidates=names,
                           search_recompute=True, **job.pricing)


def _replanned(job: Job, plan: PretrainPlan, argv: list[str]) -> PretrainPlan:
    """``plan``'s schedule, chunks and recompute on ``argv``."""
    base, _ = split_flags(argv, RECOMPUTE_FLAGS)
    chunked = with_chunks(base, plan.v) + list(plan.recompute_flags or [])
    return plan_pretrain(chunked, schedule=plan.name, world_size=job.world_size, **job.pricing)


__all__ = ["Job", "ROUNDS", "schedule_rows"]
