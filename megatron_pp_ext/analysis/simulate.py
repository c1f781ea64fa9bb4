"""Cost-model simulator: a schedule and per-action costs in, a predicted ``Timeline`` out.

Each rank runs its actions in list order; an action starts when the rank is free and its
input is ready. An input made on another rank arrives ``t_comm`` after its producer ends; a
handoff between stages on the same rank is free. The gap a rank spends waiting for a remote
input is a COMM_WAIT event. One pass over the actions in dependency order (the validator's
``execute_in_order``), so p=64, m=512 takes well under a second.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, Union

from ..ir import BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, Schedule
from ..timeline import COMM_WAIT, COMPUTE, Event, Timeline
from .validate import execute_in_order, explain_blocked, peak_activations, validate_schedule

Cost = Union[float, Sequence[float]]


@dataclass
class CostModel:
    """Time of one action of each kind, in units of ``t``.

    Each cost is one number for every stage, a list with one number per stage, or a list with
    one number per rank (every stage of a rank costs the same). ``t_b`` (a full backward)
    defaults to ``t_i + t_w``. ``t_comm`` is the time a message from a stage takes to arrive.
    ``t_overhead`` is what the runtime adds to every F, B and I on the rank's own time
    (posting its sends and receives, bookkeeping; W moves nothing): it makes schedules with
    more, shorter actions (v = 2) pay per action, as they do on a real machine.
    """

    t_f: Cost = 1.0
    t_i: Cost = 1.0
    t_w: Cost = 1.0
    t_b: Cost | None = None
    t_comm: Cost = 0.0
    t_overhead: Cost = 0.0

    def per_stage(self, schedule: Schedule) -> dict[str, list[float]]:
        """Every cost as one float per stage of ``schedule``."""
        costs = {
            name: _per_stage(name, getattr(self, name), schedule)
            for name in ("t_f", "t_i", "t_w", "t_comm", "t_overhead")
        }
        if self.t_b is None:
            costs["t_b"] = [i + w for i, w in zip(costs["t_i"], costs["t_w"])]
        else:
            costs["t_b"] = _per_stage("t_b", self.t_b, schedule)
        return costs


def _per_stage(name: str, value: Cost, schedule: Schedule) -> list[float]:
    stages, ranks = schedule.num_stages, schedule.num_ranks
    if isinstance(value, (int, float)):
        values = [float(value)] * stages
    else:
        given = [float(x) for x in value]
        if len(given) == stages:
            values = given
        elif len(given) == ranks:
            values = [given[schedule.rank_of(s)] for s in range(stages)]
        else:
            raise ValueError(
                f"{name} has {len(given)} values: give one number, one per stage ({stages}) "
                f"or one per rank ({ranks})"
            )
    if any(x < 0 for x in values):
        raise ValueError(f"{name}={value!r}: costs must be >= 0")
    return values


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
        from ..runtime.lowering import nccl_program  # the runtime lowers; analysis times it
        from .nccl_timing import time_program

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
