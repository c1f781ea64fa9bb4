"""What rank 0 reports about a step: the peak activations per rank, and, when tracing, the
measured timeline and the simulator's prediction for it.

With ``install(trace=True)`` the drop-in gathers every pipeline rank's trace after each step
into ``state.last_timeline`` on pipeline rank 0, beside ``state.last_predicted`` (the
simulator with the measured action costs and message latency; ``runtime/trace.py``). Without
tracing only the peaks are collected here, from each rank's ``state.last_step``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch.distributed as dist

from ..analysis.measured import predicted_timeline
from ..analysis.simulate import CostModel, simulate
from ..ir import Schedule
from ..runtime import trace as tracing
from ..timeline import Timeline
from ..runtime.memory import predicted_peak_bytes


@dataclass
class StepMeasurement:
    peak_activations: list[int]  # per pipeline rank: a COUNT of chunk-activations
    timeline: Timeline | None = None  # measured (seconds); None without tracing
    predicted: Timeline | None = None  # the simulator's, under the measured costs
    # Activation memory in bytes (runtime/memory.py), per pipeline rank (None where not
    # measured): the peak, its parts, and on a GPU the CUDA allocator's peak of the step
    peak_bytes: list | None = None
    peak_bytes_parts: list | None = None
    device_peak_bytes: list | None = None
    saved_bytes_per_stage: dict | None = None  # {stage: bytes one F of it saved}
    weight_grads: list | None = None  # per rank: the I/W split's GEMM counts (or None)
    overlapped_pairs: list | None = None  # per rank: F&B pairs computed in one call (COUNT)


def memory_payload(result) -> dict:
    """What one rank's StepResult says about activation bytes (plain, picklable)."""
    return {"peak_bytes": getattr(result, "peak_bytes", None),
            "peak_bytes_parts": getattr(result, "peak_bytes_parts", None),
            "device_peak_bytes": getattr(result, "device_peak_bytes", None),
            "saved_bytes_per_stage": getattr(result, "saved_bytes_per_stage", None),
            "weight_grads": getattr(result, "weight_grads", None),
            "overlapped_pairs": getattr(result, "overlapped_pairs", 0)}


def _with_memory(measurement: StepMeasurement, payloads: list[dict]) -> StepMeasurement:
    measurement.peak_bytes = [p["peak_bytes"] for p in payloads]
    measurement.peak_bytes_parts = [p["peak_bytes_parts"] for p in payloads]
    measurement.device_peak_bytes = [p["device_peak_bytes"] for p in payloads]
    measurement.weight_grads = [p.get("weight_grads") for p in payloads]
    measurement.overlapped_pairs = [p.get("overlapped_pairs", 0) for p in payloads]
    stages: dict = {}
    for p in payloads:
        stages.update(p["saved_bytes_per_stage"] or {})
    measurement.saved_bytes_per_stage = dict(sorted(stages.items())) or None
    if measurement.timeline is not None and not measurement.timeline.peak_bytes:
        measurement.timeline.peak_bytes = list(measurement.peak_bytes)
    return measurement


def pipeline_cores(device_type: str, world_size: int, pp: int) -> float | None:
    """The cores this pipeline's ranks share when every rank runs on this machine's CPUs and
    they outnumber its cores (the CPU job: 4 ranks on 2 cores), the share of the cores of one
    pipeline of ``pp`` among ``world_size`` ranks; None otherwise (GPUs, ranks on several
    machines, a core each)."""
    if device_type != "cpu":
        return None
    if int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0) != world_size:
        return None  # some ranks elsewhere: how the machines' cores are shared is not known
    cores = len(os.sched_getaffinity(0))
    return cores * pp / world_size if world_size > cores else None


def gather_step(state, pp_group, trace: bool, cores: float | None = None
                ) -> StepMeasurement | None:
    """Every pipeline rank calls it after each step (a collective without tracing); returns
    the measurement on pipeline rank 0, None elsewhere. ``cores``: the pipeline's ranks
    shared that many cores (:func:`pipeline_cores`), which the prediction accounts for."""
    memory: list = [None] * pp_group.size()
    mine = dict(memory_payload(state.last_step),
                peak_activations=int(state.last_step.peak_activations))
    dist.all_gather_object(memory, mine, group=pp_group)
    if pp_group.rank() != 0:
        return None
    if trace:
        measured, predicted = state.last_timeline, state.last_predicted
        if cores is not None:
            predicted = predicted_timeline(measured, state.last_schedule, cores=cores)
        elif predicted is None:
            predicted = tracing.predicted_timeline(measured, state.last_schedule)
        return _with_memory(StepMeasurement(list(measured.peak_activations), measured,
                                            predicted), memory)
    return _with_memory(StepMeasurement([p["peak_activations"] for p in memory]), memory)


def memory_summary(schedule: Schedule | None, measurement: StepMeasurement) -> dict:
    """summary.json's activation-memory fields (bytes, integers; the last step's):

    * ``peak_activation_bytes``: per rank, the measured peak (runtime/memory.py: saved
      tensors of in-flight microbatches, the W queue, arrivals waiting);
    * ``peak_activation_bytes_parts``: per rank, that peak split into saved / w_queue /
      waiting;
    * ``activation_bytes_per_stage``: per stage, the bytes one F saved (microbatch 0's);
    * ``peak_activation_bytes_predicted``: per rank, the simulator's count walked with
      ``activation_bytes_per_stage`` (runtime.memory.predicted_peak_bytes);
    * ``device_peak_bytes``: per rank, the CUDA allocator's peak over the step (weights,
      gradients and optimizer state included); null on the CPU;
    * ``weight_grads_per_rank``: per rank, the I/W split's weight-gradient GEMMs (deferred by
      I, run by W, kept in I; runtime.wgrad.WeightGradStats), null without a split."""

    peak = measurement.peak_bytes
    per_stage = measurement.saved_bytes_per_stage
    stages = ([int(per_stage.get(s, 0)) for s in range(schedule.num_stages)]
              if per_stage and schedule is not None else None)
    predicted = (predicted_peak_bytes(schedule, dict(enumerate(stages)))
                 if stages is not None else None)
    device = measurement.device_peak_bytes
    return {
        "peak_activation_bytes": peak,
        "peak_activation_bytes_parts": measurement.peak_bytes_parts,
        "activation_bytes_per_stage": stages,
        "peak_activation_bytes_predicted": predicted,
        "device_peak_bytes": device if device and any(d is not None for d in device) else None,
        "weight_grads_per_rank": (measurement.weight_grads if measurement.weight_grads and any(
            w is not None for w in measurement.weight_grads) else None),
    }


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
