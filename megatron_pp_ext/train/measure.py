"""What rank 0 reports about a step: the peak activations per rank, and, when tracing, the
measured timeline and the simulator's prediction for it.

With ``install(trace=True)`` the drop-in gathers every pipeline rank's trace after each step
into ``state.last_timeline`` on pipeline rank 0, beside ``state.last_predicted`` (the
simulator with the measured action costs and message latency; ``runtime/trace.py``). Without
tracing only the peaks are collected here, from each rank's ``state.last_step``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from ..analysis.simulate import CostModel, simulate
from ..ir import Schedule
from ..runtime import trace as tracing
from ..timeline import Timeline


@dataclass
class StepMeasurement:
    peak_activations: list[int]  # per pipeline rank
    timeline: Timeline | None = None  # measured (seconds); None without tracing
    predicted: Timeline | None = None  # the simulator's, under the measured costs


def gather_step(state, pp_group, trace: bool) -> StepMeasurement | None:
    """Every pipeline rank calls it after each step (a collective without tracing); returns
    the measurement on pipeline rank 0, None elsewhere."""
    if trace:
        if pp_group.rank() != 0:
            return None
        measured, predicted = state.last_timeline, state.last_predicted
        if predicted is None:
            predicted = tracing.predicted_timeline(measured, state.last_schedule)
        return StepMeasurement(list(measured.peak_activations), measured, predicted)
    peaks = [None] * pp_group.size()
    dist.all_gather_object(peaks, int(state.last_step.peak_activations), group=pp_group)
    return StepMeasurement(peaks) if pp_group.rank() == 0 else None


def unit_cost_bubble(schedule: Schedule) -> float:
    """The textbook bubble: every stage's F, I and W take 1/v (B = I + W), no comm time."""
    v = schedule.chunks
    return simulate(schedule, CostModel(t_f=1 / v, t_i=1 / v, t_w=1 / v),
                    validate=False).bubble_fraction


def costs_per_rank(schedule: Schedule, measured: Timeline) -> dict[str, list[float]]:
    """Each rank's measured cost of one microbatch over all its stages (seconds), by kind:
    what ``python -m megatron_pp_ext select --t-f ... --t-i ... --t-w ...`` takes. Kinds the
    schedule never ran are left out (a split schedule has no B, a plain one no I or W)."""
    means = tracing.mean_durations(measured)  # {(stage, kind): seconds}
    out = {}
    for kind, name in (("F", "t_f"), ("B", "t_b"), ("I", "t_i"), ("W", "t_w")):
        if any(k == kind for _, k in means):
            out[name] = [sum(means.get((s, kind), 0.0) for s in schedule.stages_of(r))
                         for r in range(schedule.num_ranks)]
    return out
