"""``select --search-parallelism``: for a model on N GPUs of a kind at a global batch, which
tp / pp / cp / ep, micro batch, schedule and recompute.

Two passes, every configuration planned by ``plan_pretrain`` on the machine's model:

1. **Screen**: every parallel configuration Megatron accepts on the world size
   (``parallel_configs``) planned once under 1F1B, without recompute or, where that does not
   fit, with every layer recomputed; one of many microbatches at ``SCREEN_ROUNDS`` x pp of
   them, its step extended by the busiest stage's F + I + W per further microbatch (1F1B's
   steady state). Configurations no recompute fits are dropped.
2. **Schedules**: the ``TOP`` fastest screened splits of the GPUs and the arguments' own go
   through every schedule at the cheapest recompute that fits (``parallel_schedules``); the
   rows of all of them are ranked together, each split's schedule once (its fastest chunks).

The arguments' own configuration is planned too (the schedule they name, Megatron's default
otherwise), so the report says where it ranks and what the best predicts against it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

from .gpus import DEFAULT_RESERVE_BYTES
from .machines import machine_named
from .parallel_configs import (Parallelism, SearchRow, exact_row, given_parallelism,
                               parallelisms, with_batch, with_parallelism)
from .parallel_schedules import Job, schedule_rows
from .pretrain_args import parse_pretrain_args, split_launcher
from .pretrain_plan import PretrainPlan, plan_pretrain
from .pretrain_select import RECOMPUTE_FLAGS, PretrainSelection, recompute_settings, split_flags

#: the screened configurations that go on to every schedule
TOP = 3
#: the screen plans at most this many times pp microbatches (``_screen``)
SCREEN_ROUNDS = 3


@dataclass
class ParallelSearch:
    ranked: list[SearchRow]  # every schedule row of the configurations gone through, fastest first
    screened: int  # configurations planned in the screen
    fitting: int  # of those, how many fit (with or without recompute)
    given: Parallelism | None  # the arguments' own configuration
    world_size: int = 0
    machine: str = ""
    moe: bool = False  # the model has experts (the report says what the planner misses there)
    given_row: SearchRow | None = None  # its fastest row
    excluded: list[str] = field(default_factory=list)

    @property
    def best(self) -> SearchRow | None:
        return self.ranked[0] if self.ranked else None

    def rank_of_given(self) -> int | None:
        """The 1-based position of the arguments' own configuration's fastest row."""
        for i, row in enumerate(self.ranked):
            if row is self.given_row:
                return i + 1
        return None


_FULL_RECOMPUTE = recompute_settings(1)[-1]  # every layer: the fewest activation bytes


def search_parallelism(argv: Sequence[str], gpu: str | None, world_size: int | None,
                       machine: str | None = None, gpu_memory: int | None = None,
                       reserve: int = DEFAULT_RESERVE_BYTES,
                       candidates: Sequence[str] | None = None,
                       progress: Callable[[str], None] = lambda text: None) -> ParallelSearch:
    """The two passes of the module docstring for ``argv`` on ``world_size`` GPUs of ``gpu``
    (or ``machine``); ValueError before any planning when the world size or the GPU is
    missing or nothing can split the global batch."""
    pretrain_argv, launched, _ = split_launcher([str(a) for a in argv])
    world = world_size or launched
    if world is None or (gpu is None and machine is None):
        raise ValueError("select --search-parallelism plans the model on N GPUs of a kind: give "
                         "--world-size N and --gpu NAME (or --machine NAME)")
    args = parse_pretrain_args(pretrain_argv)
    on = machine_named(machine, gpu)
    configs = parallelisms(args, world, on.gpus_per_node)
    if not configs:
        raise ValueError(f"no tp x pp x cp x dp of {world} GPUs splits --global-batch-size "
                         f"{args.global_batch_size} into micro batches: give a global batch "
                         "that a data-parallel size divides")

    def plan_one(candidate_argv, schedule):
        return plan_pretrain(candidate_argv, schedule=schedule, world_size=world, gpu=gpu,
                             gpu_memory=gpu_memory, reserve=reserve, machine=machine)

    screened = _screen(pretrain_argv, configs, plan_one, progress, world,
                       int(args.global_batch_size))
    given = given_parallelism(args)
    chosen = _fastest_layouts(screened)
    search = ParallelSearch([], len(configs), len(screened), given, world, on.name,
                            bool(getattr(args, "num_experts", None)))
    job = Job(world, int(args.global_batch_size), dict(gpu=gpu, gpu_memory=gpu_memory,
                                                        reserve=reserve, machine=machine))
    # the arguments' own split, where it is one of this world size's
    for par in chosen + ([given] if given in configs and given not in chosen else []):
        progress(f"every schedule on {par.label()}")
        candidate_argv = pretrain_argv if par == given else with_parallelism(pretrain_argv, par)
        try:
            search.ranked += schedule_rows(job, par, candidate_argv, candidates)
        except ValueError as exc:
            search.excluded.append(f"{par.label()}: {exc}")
    _add_given(search, pretrain_argv, plan_one, args)
    search.ranked = _fastest_per_schedule(search)
    return search


def _fastest_per_schedule(search: ParallelSearch) -> list[SearchRow]:
    """The rows fastest first, each configuration's schedule once (its fastest chunks and
    recompute), the arguments' own row kept wherever it ranks."""
    seen, kept = set(), []
    for row in sorted(search.ranked, key=lambda row: (row.step_seconds, row.most_bytes)):
        key = (row.parallelism, row.plan.name)
        if row is search.given_row or key not in seen:
            kept.append(row)
            seen.add(key)
    return kept


def _screen(argv: list[str], configs: list[Parallelism], plan_one, progress, world: int,
            batch: int):
    """(speed key, configuration) of each configuration that fits under 1F1B without
    recompute or with every layer recomputed, fastest first. A configuration of many
    microbatches is planned at ``SCREEN_ROUNDS`` x pp of them (1F1B's peak is pp in flight
    from then on) and its step extended by the busiest stage's F + I + W per microbatch more."""
    base, _ = split_flags(argv, RECOMPUTE_FLAGS)
    found = []
    for i, par in enumerate(configs):
        progress(f"screening {i + 1}/{len(configs)}: {par.label()}")
        dp = world // (par.tp * par.pp * par.cp)
        m = batch // (par.micro_batch * dp)
        planned_m = min(m, SCREEN_ROUNDS * par.pp)
        shrunk = with_batch(base, planned_m * par.micro_batch * dp)
        for recompute in ([], _FULL_RECOMPUTE):
            try:
                plan = plan_one(with_parallelism(shrunk, par) + recompute, "1f1b")
            except ValueError:  # a split Megatron refuses (layers over pp, ...)
                break
            if plan.fits:
                found.append((_extended_key(plan, m - planned_m), par))
                break
            if any(rank.static + rank.reserve > rank.budget for rank in plan.memory):
                break  # the weights and the optimizer alone are over: recompute cannot help
    return sorted(found, key=lambda item: item[0])


def _extended_key(plan: PretrainPlan, more: int) -> tuple[float, int]:
    """``_speed_key`` of the plan with ``more`` microbatches through its busiest stage."""
    step, most = _speed_key(plan)
    costs = plan.stage_costs or {}
    per_microbatch = max((f + i + w for f, i, w in zip(costs.get("t_f", []),
                                                       costs.get("t_i", []),
                                                       costs.get("t_w", []))), default=0.0)
    return step + more * per_microbatch, most


def _speed_key(plan: PretrainPlan) -> tuple[float, int]:
    """Fastest first; of equal steps, the fewest bytes on the most loaded rank."""
    return plan.step_seconds, plan.most_bytes


def _fastest_layouts(screened: list[tuple[tuple, Parallelism]]) -> list[Parallelism]:
    """The ``TOP`` fastest screened configurations, one micro batch per split of the GPUs
    (the others price the same per token: the fewest bytes wins a tie)."""
    chosen, splits = [], set()
    for _, par in screened:
        split = (par.tp, par.pp, par.cp, par.ep)
        if split not in splits and len(chosen) < TOP:
            chosen.append(par)
            splits.add(split)
    return chosen


def _add_given(search: ParallelSearch, argv: list[str], plan_one, args) -> None:
    """The arguments as given (their schedule, chunks and recompute) as a row of their own,
    in place of the schedule pass's row of the same schedule, chunks and recompute."""
    try:
        plan = plan_one(argv, getattr(args, "pipeline_schedule", None))
    except ValueError as exc:
        search.excluded.append(f"yours: {exc}")
        return
    plan.recompute_flags = split_flags(argv, RECOMPUTE_FLAGS)[1]
    key = _row_key(search.given, plan)
    search.ranked = [row for row in search.ranked if _row_key(row.parallelism, row.plan) != key]
    selection = PretrainSelection([plan], [], argv=argv)
    search.given_row = exact_row(search.given, plan, selection)
    if plan.fits:
        search.ranked.append(search.given_row)


def _row_key(par: Parallelism, plan: PretrainPlan) -> tuple:
    return (par, plan.name, plan.v, tuple(plan.recompute_flags or ()))


__all__ = ["ParallelSearch", "SCREEN_ROUNDS", "TOP", "search_parallelism"]
