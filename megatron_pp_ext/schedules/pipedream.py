"""PipeDream's asynchronous pipeline and PipeDream-2BW, as schedules of the same IR.

Both run the 1F1B order (warmup p-1-r forwards on rank r, then one forward and one backward
in turn) *without a flush*: one action list spans ``steps`` optimizer batches of ``m``
microbatches each, ``steps * m`` microbatches in all, and the pipeline drains only at the very
end of the run. What makes them asynchronous is not the order but *when weights change*, which
the schedule states in ``options["weight_update"]`` (read by ``runtime.weight_versions``):

* ``pipedream`` (Harlap et al., "PipeDream: Generalized Pipeline Parallelism for DNN
  Training", SOSP 2019): every stage applies an update after *every* backward (``batch`` 1).
  Weight stashing: a microbatch's forward runs with the stage's newest version and its
  backward with that same version (stashed), so stage r holds up to p - r versions. With
  ``vertical_sync=True`` every stage runs a microbatch with the version *it entered the
  pipeline with* (the version stage 0 used), i.e. ``W(t+1) = W(t) - lr * grad f(W(t-p+1))``
  on every stage.
* ``pipedream-2bw`` (Narayanan et al., "Memory-Efficient Pipeline-Parallel DNN Training",
  ICML 2021): gradients accumulate over a batch of ``m`` microbatches and each stage applies
  them one batch late: batch b runs on version ``max(b - 1, 0)`` on every stage, and after its
  last backward a stage makes version b + 1 from version b, so
  ``W(t+1) = W(t) - lr * grad f(W(t-1))`` and no stage holds more than 2 versions. Needs
  m >= p (the paper's m >= d) so that no batch starts before the one two back is finished.

Nothing here changes an action: the versions are implied by the order plus the update rule,
so the CSV / JSON forms are plain 1F1B lists (the JSON keeps the rule in ``options``). These
schedules change the optimizer's semantics: they are registered apart (``ASYNC_REGISTRY``),
are never candidates of ``select``, ``auto`` or ``compare``, and cannot run under Megatron's
``forward_backward_func``, which flushes every step (``megatron_pp_ext.runtime.pipedream``
and ``train --schedule pipedream`` run them).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

from ..ir import BACKWARD, FORWARD, Action, Schedule, ScheduleError
from ._common import check_sizes, loop_placement, require
from .one_f_one_b import one_f_one_b_row

PIPEDREAM, PIPEDREAM_2BW = "pipedream", "pipedream-2bw"


def _one_f_one_b_rows(p: int, total: int) -> list[list[Action]]:
    """1F1B's order over all ``total`` microbatches of the run, never flushed."""
    return [one_f_one_b_row(rank, p, total) for rank in range(p)]


def _check(name: str, num_ranks: int, num_microbatches: int, chunks: int, steps: int) -> None:
    check_sizes(name, num_ranks, num_microbatches)
    require(chunks == 1, name, f"chunks v={chunks}: runs one model chunk per rank (v = 1)")
    require(isinstance(steps, int) and steps >= 1, name,
            f"steps={steps!r} must be an integer >= 1 (optimizer batches the list spans)")


def build_pipedream(num_ranks: int, num_microbatches: int, chunks: int = 1, steps: int = 2,
                    vertical_sync: bool = False, **_options) -> Schedule:
    """Asynchronous 1F1B over ``steps * m`` microbatches, an update after every backward."""
    _check(PIPEDREAM, num_ranks, num_microbatches, chunks, steps)
    total = steps * num_microbatches
    return Schedule(PIPEDREAM, total, loop_placement(num_ranks, 1),
                    _one_f_one_b_rows(num_ranks, total), {
                        "asynchronous": True, "steps": steps,
                        "microbatches_per_step": num_microbatches,
                        "weight_update": {"rule": PIPEDREAM, "batch": 1, "delay": 0,
                                          "vertical_sync": bool(vertical_sync)},
                    })


def build_pipedream_2bw(num_ranks: int, num_microbatches: int, chunks: int = 1, steps: int = 2,
                        **_options) -> Schedule:
    """Asynchronous 1F1B over ``steps * m`` microbatches, an update after each batch's last
    backward, applied one batch late (two weight versions)."""
    _check(PIPEDREAM_2BW, num_ranks, num_microbatches, chunks, steps)
    require(num_microbatches >= num_ranks, PIPEDREAM_2BW,
            f"m={num_microbatches} microbatches per batch must be >= p={num_ranks} (the "
            "paper's m >= d): with fewer, a batch would start on a stage before the batch two "
            f"back has finished there, and 2 weight versions would not do; use -m {num_ranks}")
    total = steps * num_microbatches
    return Schedule(PIPEDREAM_2BW, total, loop_placement(num_ranks, 1),
                    _one_f_one_b_rows(num_ranks, total), {
                        "asynchronous": True, "steps": steps,
                        "microbatches_per_step": num_microbatches,
                        "weight_update": {"rule": PIPEDREAM_2BW, "batch": num_microbatches,
                                          "delay": 1, "vertical_sync": False},
                    })


# --------------------------------------------------------------------------------------------
# The weight versions the order and the rule imply (the runtime: runtime.weight_versions)
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class UpdateRule:
    rule: str  # "pipedream" or "pipedream-2bw"
    batch: int  # microbatches whose gradients make one update (pipedream: 1; 2BW: m)
    delay: int  # batches between a version's use and its update (pipedream 0, 2BW 1)
    vertical_sync: bool = False

    def describe(self) -> str:
        if self.delay:
            return (f"{self.rule}: batch b (of {self.batch} microbatches) runs on version "
                    f"max(b-{self.delay}, 0) on every stage; an update after each batch")
        if self.vertical_sync:
            return (f"{self.rule} with vertical sync: an update after every backward; every "
                    "stage runs a microbatch on the version it entered the pipeline with")
        every = "every backward" if self.batch == 1 else f"every {self.batch} backwards"
        return (f"{self.rule} with weight stashing: an update after {every}; F and B of "
                "a microbatch on a stage use the stage's newest version at its F")


def update_rule(schedule: Schedule) -> UpdateRule | None:
    """The schedule's asynchronous update rule, or None for a flushed (synchronous) one."""
    raw = schedule.options.get("weight_update")
    if not raw:
        return None
    return UpdateRule(str(raw["rule"]), int(raw.get("batch", 1)), int(raw.get("delay", 0)),
                      bool(raw.get("vertical_sync", False)))


@dataclass
class VersionPlan:
    rule: UpdateRule
    #: (stage, microbatch) -> the version its F and its B use on that stage
    version: dict[tuple[int, int], int]
    #: (stage, microbatch) -> u: after this backward the stage makes version u
    update_after: dict[tuple[int, int], int]
    #: (stage, version) -> how many of the stage's actions (F and B) use it
    uses: dict[tuple[int, int], int]
    #: per rank: the most versions its stages hold at once, and the most that in-flight
    #: microbatches use at once (both from the plan; the runtime measures the same)
    max_held: list[int] = field(default_factory=list)
    max_in_flight: list[int] = field(default_factory=list)


def plan_versions(schedule: Schedule) -> VersionPlan:
    """Which version each F and B uses, where updates happen; raises ``ScheduleError`` if the
    order would need a version before the stage has made it."""
    rule = update_rule(schedule)
    if rule is None:
        raise ScheduleError(f"{schedule.name}: not an asynchronous schedule (its options carry "
                            "no 'weight_update' rule)")
    if schedule.uses_split_backward():
        raise ScheduleError(f"{schedule.name}: asynchronous updates follow full backwards (B); "
                            "a split backward (I/W) is not supported")
    version: dict[tuple[int, int], int] = {}
    update_after: dict[tuple[int, int], int] = {}
    uses: collections.Counter = collections.Counter()
    # stage 0's rank first: vertical sync takes every microbatch's version from stage 0
    first = schedule.rank_of(0) if schedule.num_stages else 0
    order = [first] + [r for r in range(schedule.num_ranks) if r != first]
    made = collections.Counter()  # stage -> updates made so far (in its rank's order)
    for rank in order:
        for action in schedule.actions[rank]:
            s, j = action.stage, action.microbatch
            if action.kind == FORWARD:
                if rule.delay:
                    v = max(j // rule.batch - rule.delay, 0)
                elif rule.vertical_sync and s != 0:
                    v = version[(0, j)]
                else:
                    v = made[s]
                if v > made[s]:
                    raise ScheduleError(
                        f"{schedule.name}: rank {rank}'s {action} would need version {v} of "
                        f"stage {s}, which has made only {made[s]} update(s) by then")
                version[(s, j)] = v
                uses[(s, v)] += 1
            elif action.kind == BACKWARD:
                uses[(s, version[(s, j)])] += 1
                if (j + 1) % rule.batch == 0:
                    made[s] += 1
                    update_after[(s, j)] = made[s]
    plan = VersionPlan(rule, version, update_after, dict(uses))
    for rank in range(schedule.num_ranks):
        held, in_flight = _replay(schedule, rank, plan)
        plan.max_held.append(held)
        plan.max_in_flight.append(in_flight)
    return plan


def _replay(schedule: Schedule, rank: int, plan: VersionPlan) -> tuple[int, int]:
    """The most versions held, and used by in-flight microbatches, on ``rank`` (per stage,
    summed over the rank's stages), replaying its list with the runtime's drop rule."""
    remaining = {key: n for key, n in plan.uses.items() if schedule.rank_of(key[0]) == rank}
    held = {s: {0} for s in schedule.stages_of(rank)}
    latest = {s: 0 for s in schedule.stages_of(rank)}
    flight: dict[int, collections.Counter] = {s: collections.Counter()
                                              for s in schedule.stages_of(rank)}
    max_held = max_flight = sum(len(h) for h in held.values())
    max_flight = 0
    for action in schedule.actions[rank]:
        s, j = action.stage, action.microbatch
        v = plan.version[(s, j)]
        remaining[(s, v)] -= 1
        if action.kind == FORWARD:
            flight[s][v] += 1
        else:
            flight[s][v] -= 1
            if not flight[s][v]:
                del flight[s][v]
            if (s, j) in plan.update_after:
                latest[s] = plan.update_after[(s, j)]
                held[s].add(latest[s])
        for stage, versions in held.items():
            held[stage] = {x for x in versions
                           if x == latest[stage] or remaining.get((stage, x), 0) > 0}
        max_held = max(max_held, sum(len(h) for h in held.values()))
        max_flight = max(max_flight, sum(len(f) for f in flight.values()))
    return max_held, max_flight
