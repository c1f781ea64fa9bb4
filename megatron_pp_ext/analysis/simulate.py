"""Cost-model simulator: a schedule and its costs in, a predicted ``Timeline`` out.

Costs are a rank's share of one microbatch (``CostModel``), the same numbers for every
schedule: a schedule with v chunks per rank runs actions of 1/v of it each.

Each rank runs its actions in list order; an action starts when the rank is free and its
input is ready. An input made on another rank arrives ``t_comm`` after its producer ends; a
handoff between stages on the same rank is free. The gap a rank spends waiting for a remote
input is a COMM_WAIT event. One pass over the actions in dependency order (the validator's
``execute_in_order``), so p=64, m=512 takes well under a second.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Sequence, Union

from ..ir import BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, Schedule
from ..timeline import COMM_WAIT, COMPUTE, Event, Timeline
from ..schedules import build_async_schedule, build_schedule
from ..schedules.pipedream import plan_versions
from ..schedules.validate import execute_in_order, explain_blocked, peak_activations, validate_schedule
from .lowering import nccl_program
from .nccl_timing import time_program

Cost = Union[float, Sequence[float]]

#: What a cost (t_f, t_i, t_w, t_b) is the time of: ``RANK`` (the default) a rank's share, one
#: microbatch through all the layers the rank holds, split evenly over the rank's chunks;
#: ``STAGE`` one action of one stage, taken as given.
RANK, STAGE = "rank", "stage"

_SPLIT_MISSING = (
    "{name} splits the backward into I (input gradient) and W (weight gradient), but these "
    "costs give only t_b, a whole backward (what a run of 1f1b, gpipe or interleaved "
    "measures): give t_i and t_w (measure a split schedule, e.g. train --schedule zb-h1 or "
    "zb-v), or state how B splits (--assume-split X on the command line, "
    "analysis.costs.assume_split in Python: t_i = X t_b, t_w = (1 - X) t_b)"
)


@dataclass
class CostModel:
    """Time of one microbatch's action of each kind, in any unit (``t``, or seconds).

    **A rank's share** (``per="rank"``, the default): ``t_f``, ``t_i``, ``t_w`` and ``t_b``
    are the time one rank spends on one microbatch through *all* the layers it holds, so the
    same numbers describe every schedule: a schedule with v model chunks per rank (interleaved,
    zb-v, dualpipev) runs actions of 1/v of the share each, scaled here. Each is one number
    (every rank's share), a list with one number per rank, or a list with one number per stage
    (that stage's own action time, not scaled: what ``runtime.trace.calibrated_costs``
    measures). With v = 1 a stage is a rank and the two readings agree.

    **Per stage** (``per="stage"``, or ``CostModel.for_stages(...)``): every cost is the time
    of one action of one stage, a number for every stage or a list per stage or per rank, taken
    as given for any v (``t_f=1`` on zb-v is then a forward of 1 per chunk, 2 per rank).

    ``t_i`` and ``t_w`` (the two halves of a split backward) default to 1 each and ``t_b`` (a
    whole backward) to ``t_i + t_w``. Given ``t_b`` with one of ``t_i``, ``t_w``, the other is
    the rest of ``t_b``; given ``t_b`` alone, the split is unknown: schedules without a split
    backward run, those with one (zb-h1, zb-h2, zb-v, dualpipev) raise ``ValueError`` saying so
    (nothing is made up).

    ``t_comm`` is the time a message from a stage takes to arrive, ``t_overhead`` what the
    runtime adds to every F, B and I on the rank's own time (posting its sends and receives;
    W moves nothing): both per message or per action, never scaled by v, so schedules with
    more, shorter actions (v = 2) pay them per action, as they do on a real machine.
    """

    t_f: Cost = 1.0
    t_i: Cost | None = None
    t_w: Cost | None = None
    t_b: Cost | None = None
    t_comm: Cost = 0.0
    t_overhead: Cost = 0.0
    per: str = RANK

    def __post_init__(self):
        if self.per not in (RANK, STAGE):
            raise ValueError(f"per={self.per!r}: choose {RANK!r} (a rank's share, scaled by "
                             f"1/v per chunk) or {STAGE!r} (one action of one stage)")

    @classmethod
    def for_stages(cls, **costs) -> "CostModel":
        """Costs of one action of one stage, taken as given whatever the chunks per rank."""
        return cls(**costs, per=STAGE)

    @property
    def split_known(self) -> bool:
        """False when only a whole backward is given (``t_b`` without ``t_i`` and ``t_w``):
        schedules that split the backward cannot be predicted from these costs."""
        return not (self.t_b is not None and self.t_i is None and self.t_w is None)

    def per_stage(self, schedule: Schedule) -> dict[str, list[float]]:
        """Every cost as one float per stage of ``schedule`` (the time of one action there)."""
        share = self.per == RANK
        costs = {"t_f": _per_stage("t_f", self.t_f, schedule, share),
                 # per message and per action: the same for any v
                 "t_comm": _per_stage("t_comm", self.t_comm, schedule),
                 "t_overhead": _per_stage("t_overhead", self.t_overhead, schedule)}
        t_i, t_w, t_b = self.t_i, self.t_w, self.t_b
        if t_b is None:
            costs["t_i"] = _per_stage("t_i", 1.0 if t_i is None else t_i, schedule, share)
            costs["t_w"] = _per_stage("t_w", 1.0 if t_w is None else t_w, schedule, share)
            costs["t_b"] = [i + w for i, w in zip(costs["t_i"], costs["t_w"])]
            return costs
        costs["t_b"] = _per_stage("t_b", t_b, schedule, share)
        if t_i is None and t_w is None:
            if schedule.uses_split_backward():
                raise ValueError(_SPLIT_MISSING.format(name=schedule.name))
            half = [b / 2 for b in costs["t_b"]]  # never used: this schedule runs whole B's
            costs["t_i"], costs["t_w"] = half, list(half)
            return costs
        for name in ("t_i", "t_w"):
            if getattr(self, name) is not None:
                costs[name] = _per_stage(name, getattr(self, name), schedule, share)
        for given, other in (("t_i", "t_w"), ("t_w", "t_i")):
            if getattr(self, other) is None:  # the rest of t_b
                costs[other] = [b - x for b, x in zip(costs["t_b"], costs[given])]
                if any(x < -1e-12 for x in costs[other]):
                    raise ValueError(f"{given}={getattr(self, given)!r} exceeds t_b={t_b!r}: "
                                     f"{other} = t_b - {given} would be negative")
                costs[other] = [max(0.0, x) for x in costs[other]]
        return costs


def _per_stage(name: str, value: Cost, schedule: Schedule, share: bool = False) -> list[float]:
    """``value`` as one float per stage. ``share``: a number or a per-rank list is a rank's
    share, divided evenly among the rank's stages (a per-stage list is taken as given)."""
    stages, ranks = schedule.num_stages, schedule.num_ranks
    held = Counter(schedule.stage_to_rank)  # stages per rank
    if isinstance(value, (int, float)):
        given, per_stage = [float(value)] * ranks, False
    else:
        given = [float(x) for x in value]
        if len(given) == stages:
            per_stage = True
        elif len(given) == ranks:
            per_stage = False
        else:
            raise ValueError(
                f"{name} has {len(given)} values: give one number, one per stage ({stages}) "
                f"or one per rank ({ranks})"
            )
    if any(x < 0 for x in given):
        raise ValueError(f"{name}={value!r}: costs must be >= 0")
    if per_stage:
        return given
    owner = schedule.stage_to_rank
    if schedule.second_direction_from is not None:
        # dualpipe: a per-rank figure is its loop-layout rank's, i.e. of the part that rank
        # holds there (part k): stage s holds part model_stage(s), whole, on either rank
        return [given[schedule.model_stage(s)] for s in range(stages)]
    if share:
        return [given[owner[s]] / held[owner[s]] for s in range(stages)]
    return [given[owner[s]] for s in range(stages)]


BUFFERED, NCCL = "buffered", "nccl"  # the two communication models


def action_durations(cost: dict[str, list[float]]) -> dict[str, list[float]]:
    """Per action kind, its time on each stage (``cost`` from ``CostModel.per_stage``)."""
    over = cost["t_overhead"]
    return {
        FORWARD: [c + o for c, o in zip(cost["t_f"], over)],
        BACKWARD: [c + o for c, o in zip(cost["t_b"], over)],
        BACKWARD_INPUT: [c + o for c, o in zip(cost["t_i"], over)],
        BACKWARD_WEIGHT: cost["t_w"],
    }


def simulate(schedule: Schedule, costs: CostModel | None = None, validate: bool = True,
             channels: str = "sender", communication: str = BUFFERED,
             variable_shapes: bool = False) -> Timeline:
    """Predict when every action of ``schedule`` runs under ``costs``.

    Validates first (``channels`` as in ``validate_schedule``); with ``validate=False`` a
    schedule that cannot finish still raises ``ScheduleError`` instead of looping.
    ``communication``: ``buffered`` (a message leaves the moment its producer ends) or
    ``nccl`` (the program the executor posts on NCCL, lowered and timed under NCCL's rules:
    rendezvous sends, one stream of batches per rank; see ``nccl_timing``; slower to compute).
    ``variable_shapes``: with ``nccl``, every call first exchanges its shape headers.
    """
    if communication not in (BUFFERED, NCCL):
        raise ValueError(f"communication={communication!r}: choose {BUFFERED!r} or {NCCL!r}")
    if validate:
        validate_schedule(schedule, channels=channels)
    cost = (costs or CostModel()).per_stage(schedule)
    duration = action_durations(cost)
    if communication == NCCL:
        return time_program(nccl_program(schedule, variable_shapes), schedule, duration,
                            cost["t_comm"], peak_activations(schedule), check=False)
    t_comm, owner = cost["t_comm"], schedule.stage_to_rank
    free_at = [0.0] * schedule.num_ranks
    events: list[Event] = []

    def run(rank, action, dep, dep_end):
        start = free_at[rank]
        if dep is not None:
            producer = owner[dep[1]]
            if producer != rank:  # a message: it arrives t_comm after its producer ends
                arrival = dep_end + t_comm[dep[1]]
                if arrival > start:
                    label = f"wait {action}<-rank {producer}"
                    events.append(Event(rank, label, start, arrival, COMM_WAIT))
                    start = arrival
            else:  # local handoff; already done, since the rank runs in order
                start = max(start, dep_end)
        end = start + duration[action.kind][action.stage]
        events.append(Event(rank, str(action), start, end, COMPUTE))
        free_at[rank] = end
        return end

    position = execute_in_order(schedule, run)
    explain_blocked(schedule, position)  # raises if some rank could not finish
    return Timeline.of_schedule(schedule, events, peak_activations(schedule), "predicted", "t")


# --------------------------------------------------------------------------------------------
# Asynchronous schedules (pipedream, pipedream-2bw): the steady state without a flush
# --------------------------------------------------------------------------------------------


@dataclass
class AsyncSteadyState:
    """What an asynchronous schedule buys over flushed 1F1B, predicted under the same costs.

    ``per_microbatch``: the steady-state time per microbatch, the marginal cost of one more
    batch ((makespan of ``long`` batches - makespan of ``short``) / the microbatches between),
    so the fill and the drain at the ends of the run do not count; ``flushed_1f1b``: 1F1B's
    step makespan / m (it fills and drains every step); ``floor``: the busiest rank's
    F + B per microbatch, what a pipeline with no idle time needs. ``timeline``: the whole run
    of ``long`` batches, drawn like any other."""

    name: str
    per_microbatch: float
    flushed_1f1b: float
    floor: float
    makespan: float
    timeline: Timeline
    versions_held: list[int]


def async_steady_state(name: str, num_ranks: int, num_microbatches: int,
                       costs: CostModel | None = None, short: int = 2, long: int = 4,
                       **options) -> AsyncSteadyState:
    """Simulate ``name`` (``pipedream`` or ``pipedream-2bw``) over ``short`` and ``long``
    batches and flushed 1F1B over one step, under the same ``costs`` (full backwards: t_b)."""

    if not 1 <= short < long:
        raise ValueError(f"short={short}, long={long}: need 1 <= short < long")
    costs = costs or CostModel()
    runs = {}
    for steps in (short, long):
        schedule = build_async_schedule(name, num_ranks, num_microbatches, steps=steps,
                                        **options)
        runs[steps] = (schedule, simulate(schedule, costs))
    schedule, timeline = runs[long]
    between = (long - short) * num_microbatches
    per_microbatch = (timeline.makespan - runs[short][1].makespan) / between
    one = build_schedule("1f1b", num_ranks, num_microbatches)
    flushed = simulate(one, costs).makespan / num_microbatches
    cost = costs.per_stage(one)
    duration = action_durations(cost)
    floor = max(duration[FORWARD][s] + duration[BACKWARD][s] for s in range(one.num_stages))
    return AsyncSteadyState(name, per_microbatch, flushed, floor, timeline.makespan, timeline,
                            plan_versions(schedule).max_held)
