"""A step's measured timeline (every pipeline rank's trace, on rank 0), the timeline the
simulator predicts from the measured costs, and their bubbles.

The drop-in keeps this rank's last step in ``STATE.last_step`` (``StepResult``: the executed
actions, ``peak_activations``, and the traced ``events`` when ``install(trace=True)``). Where
the drop-in also publishes the whole pipeline's measured timeline and its prediction
(``STATE.last_timeline`` / ``STATE.last_predicted`` on pipeline rank 0, runtime/trace.py),
those are used as they are; otherwise :func:`gather_step` collects the ranks' events itself.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass

import torch.distributed as dist

from ..analysis.simulate import CostModel, simulate
from ..ir import Action, Schedule
from ..timeline import COMPUTE, Event, Timeline


@dataclass
class StepMeasurement:
    """What rank 0 reports about one step."""

    peak_activations: list[int]  # per pipeline rank
    timeline: Timeline | None = None  # measured (seconds); None without tracing
    predicted: Timeline | None = None  # the simulator's, under the measured costs


def gather_step(state, pp_group, trace: bool) -> StepMeasurement | None:
    """Collective over the pipeline group (every rank calls it after each step); returns the
    measurement on pipeline rank 0, None elsewhere."""
    if trace and hasattr(state, "last_timeline"):
        # The drop-in gathered the trace itself (runtime/trace.py): take its timelines.
        if pp_group.rank() != 0:
            return None
        measured = state.last_timeline
        predicted = getattr(state, "last_predicted", None)
        if predicted is None:
            predicted = predicted_timeline(state.last_schedule, measured)
        return StepMeasurement(list(measured.peak_activations), measured, predicted)
    # Otherwise gather here. Clocks: time.perf_counter is one monotonic clock per machine, not
    # across machines. Every rank reads it on leaving the same barrier; rank 0 shifts the
    # others' events by the difference (good to the barrier's exit skew, ~0.1 ms on one node).
    result, schedule = state.last_step, state.last_schedule
    dist.barrier(group=pp_group)
    mark = time.perf_counter()
    mine = (int(result.peak_activations), mark, list(result.events) if trace else [])
    everyone = [None] * pp_group.size()
    dist.all_gather_object(everyone, mine, group=pp_group)
    if pp_group.rank() != 0:
        return None
    peaks = [peak for peak, _, _ in everyone]
    if not trace:
        return StepMeasurement(peaks)
    events = []
    for rank, (_, their_mark, their_events) in enumerate(everyone):
        shift = mark - their_mark
        events += [Event(rank, e.label, e.start + shift, e.end + shift, e.category)
                   for e in their_events]
    events.sort(key=lambda e: (e.rank, e.start))
    measured = Timeline(schedule=schedule.name, num_ranks=schedule.num_ranks,
                        num_microbatches=schedule.num_microbatches, chunks=schedule.chunks,
                        events=events, peak_activations=peaks, source="measured", unit="s")
    return StepMeasurement(peaks, measured, predicted_timeline(schedule, measured))


def measured_costs(schedule: Schedule, measured: Timeline) -> CostModel:
    """Mean measured time of each kind of action, per stage (seconds). A stage that never ran
    a kind gets that kind's mean over all stages (0 if none ran)."""
    durations: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    for e in measured.events:
        if e.category != COMPUTE:
            continue
        action = Action.parse(e.label)
        durations[action.kind][action.stage].append(e.duration)

    def per_stage(kind: str) -> list[float]:
        by_stage = durations.get(kind, {})
        everything = [d for ds in by_stage.values() for d in ds]
        overall = sum(everything) / len(everything) if everything else 0.0
        return [sum(by_stage[s]) / len(by_stage[s]) if by_stage.get(s) else overall
                for s in range(schedule.num_stages)]

    t_b = per_stage("B") if "B" in durations else None
    return CostModel(t_f=per_stage("F"), t_i=per_stage("I"), t_w=per_stage("W"), t_b=t_b)


def predicted_timeline(schedule: Schedule, measured: Timeline) -> Timeline:
    """The simulator's timeline for ``schedule`` with the measured action costs and free
    communication: what the schedule would take if nothing but its order made ranks wait."""
    timeline = simulate(schedule, measured_costs(schedule, measured), validate=False)
    timeline.unit = "s"
    return timeline


def unit_cost_bubble(schedule: Schedule) -> float:
    """The textbook bubble: every stage's F, I and W take 1/v (B = I + W), no comm time."""
    v = schedule.chunks
    return simulate(schedule, CostModel(t_f=1 / v, t_i=1 / v, t_w=1 / v),
                    validate=False).bubble_fraction


def costs_per_rank(schedule: Schedule, measured: Timeline) -> dict[str, list[float]]:
    """Each rank's measured cost of one microbatch over all its stages (seconds), by kind:
    what ``python -m megatron_pp_ext select --t-f ... --t-i ... --t-w ...`` takes. Kinds the
    schedule never ran are left out (a split schedule has no B, a plain one no I or W)."""
    durations: dict[tuple[str, int], list[float]] = defaultdict(list)
    for e in measured.events:
        if e.category == COMPUTE:
            action = Action.parse(e.label)
            durations[(action.kind, action.stage)].append(e.duration)
    out = {}
    for kind, name in (("F", "t_f"), ("B", "t_b"), ("I", "t_i"), ("W", "t_w")):
        if not any(k == kind for k, _ in durations):
            continue
        out[name] = [
            sum(sum(durations[(kind, s)]) / len(durations[(kind, s)])
                for s in schedule.stages_of(r) if durations.get((kind, s)))
            for r in range(schedule.num_ranks)]
    return out
