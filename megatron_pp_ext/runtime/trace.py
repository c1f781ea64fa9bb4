"""Measured timelines: every rank's traced events in one ``Timeline``, the same type the
simulator predicts, so "measured versus predicted" is one comparison.

With tracing on (``install(trace=True)``), the executor records the start and end of each
action (COMPUTE) and of each wait on a peer (COMM_WAIT) with ``time.perf_counter``. Once per
traced step, :func:`gather_timeline` sends every rank's events to pipeline rank 0 (one
``gather_object`` on the pipeline group) and builds the measured ``Timeline`` there.

Clock alignment. The ranks are separate processes, perhaps on separate hosts, and
``perf_counter`` counts from an arbitrary point in each. Each rank therefore also sends the
offset ``time.time() - time.perf_counter()``, read at the gather (the pair with the shortest
read interval out of a few), and rank 0 places every event at ``perf_counter + offset``: all
ranks on one wall clock. Ranks on one host share that clock exactly; across hosts the
alignment is as good as the hosts' clock synchronization (NTP / chrony: typically well
under a millisecond inside a cluster; PTP: microseconds). Only relative times matter: the
measured timeline starts at 0 at the earliest event of any rank.

:func:`calibrated_costs` turns a measured timeline into a ``CostModel`` (the mean F, B, I, W
durations of each stage), so the simulator can predict the same schedule with the measured
costs; :func:`summary_text` prints the two side by side.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path
from typing import Sequence

from ..analysis.measured import (  # the statistics of what this module gathers
    BUBBLE_TAG,
    MAKESPAN_TAG,
    PEAK_BYTES_TAG,
    PEAK_TAG,
    PREDICTED_BUBBLE_TAG,
    calibrated_costs,
    mean_durations,
    message_latency,
    predicted_timeline,
    step_metrics,
    summary_text,
)
from .. import megatron_compat
from ..ir import Schedule
from ..timeline import COMM_WAIT, Event, Timeline
from ..analysis.render import render_chrome_trace

logger = logging.getLogger("megatron_pp_ext")



# ---------------------------------------------------------------- building a timeline
def clock_offset(samples: int = 5) -> float:
    """``time.time() - time.perf_counter()`` now: the pair read closest together."""
    best, offset = float("inf"), 0.0
    for _ in range(samples):
        before = time.perf_counter()
        wall = time.time()
        after = time.perf_counter()
        if after - before < best:
            best, offset = after - before, wall - (before + after) / 2
    return offset


def rank_payload(result, rank: int) -> dict:
    """What one rank contributes: its events as plain tuples, its peak and its clock offset."""
    return {
        "rank": rank,
        "events": [(e.label, e.start, e.end, e.category) for e in result.events],
        "peak_activations": int(result.peak_activations),
        "peak_bytes": getattr(result, "peak_bytes", None),  # runtime/memory.py
        "offset": clock_offset(),
    }


def build_timeline(schedule: Schedule, payloads: Sequence[dict]) -> Timeline:
    """One measured ``Timeline`` from every rank's :func:`rank_payload` (any order).

    Each event moves onto the common clock (``+ offset``); times start at 0 at the earliest
    event. Events are ordered by rank, then start time.
    """
    by_rank = {int(p["rank"]): p for p in payloads}
    missing = sorted(set(range(schedule.num_ranks)) - set(by_rank))
    if missing:
        raise ValueError(f"no trace from pipeline ranks {missing}: every rank must trace")
    events = [
        Event(rank, label, start + p.get("offset", 0.0), end + p.get("offset", 0.0), category)
        for rank, p in by_rank.items()
        for label, start, end, category in p["events"]
    ]
    origin = min((e.start for e in events), default=0.0)
    for e in events:
        e.start -= origin
        e.end -= origin
    peaks = [by_rank[r]["peak_activations"] for r in range(schedule.num_ranks)]
    timeline = Timeline.of_schedule(schedule, events, peaks, "measured", "s")
    peak_bytes = [by_rank[r].get("peak_bytes") for r in range(schedule.num_ranks)]
    if any(b is not None for b in peak_bytes):
        timeline.peak_bytes = peak_bytes
    return timeline


def local_timeline(schedule: Schedule, results: Sequence) -> Timeline:
    """The measured timeline of ranks that share one clock (threads over the in-memory
    transport): ``results[r]`` is rank r's traced ``StepResult``."""
    payloads = [dict(rank_payload(result, rank), offset=0.0) for rank, result in
                enumerate(results)]
    return build_timeline(schedule, payloads)


def gather_timeline(result, schedule: Schedule, rank: int, pp_group=None,
                    device=None) -> Timeline | None:
    """Collective over ``pp_group``: every rank's traced events to pipeline rank 0.

    Returns the measured ``Timeline`` on pipeline rank 0 and ``None`` on the others. Every
    rank of the group must call it (once per traced step). ``result`` is this rank's
    ``StepResult`` from an executor run with ``trace=True``. ``device`` is accepted for
    symmetry with the other collectives; ``gather_object`` picks its own.
    """
    import torch.distributed as dist

    payload = rank_payload(result, rank)
    if not (dist.is_available() and dist.is_initialized()):
        return build_timeline(schedule, [payload]) if schedule.num_ranks == 1 else None
    size = dist.get_world_size(pp_group)
    gathered = [None] * size if rank == 0 else None
    dist.gather_object(payload, gathered, group=pp_group, group_dst=0)
    if rank != 0:
        return None
    return build_timeline(schedule, gathered)


# ---------------------------------------------------------------- calibration and prediction
TRACE_FILE = "pp_trace.json"


def write_chrome_trace(timeline: Timeline, folder: str) -> Path:
    """``folder/pp_trace.json``: the measured step as a Chrome trace (written to a temporary
    name, then renamed, so a reader never sees half a file)."""

    path = Path(folder) / TRACE_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".json.partial")
    partial.write_text(json.dumps(render_chrome_trace(timeline)))
    partial.replace(path)
    return path


def share_metrics(metrics: dict | None, rank: int, pp_group=None, device=None) -> dict:
    """Collective over ``pp_group``: pipeline rank 0's metrics to every rank of the group (the
    rank that owns Megatron's tensorboard writer is the last one)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return dict(metrics or {})
    box = [metrics if rank == 0 else None]
    dist.broadcast_object_list(box, group=pp_group, group_src=0, device=device)
    return dict(box[0] or {})


def megatron_writers() -> tuple[object | None, object | None, int | None]:
    """(tensorboard writer, wandb writer, iteration) of megatron.training, when it is loaded
    and initialized here; Nones otherwise. Never imports megatron.training itself."""
    global_vars = sys.modules.get("megatron.training.global_vars")
    if global_vars is None:
        return None, None, None
    try:
        writer = global_vars.get_tensorboard_writer()
        wandb_writer = global_vars.get_wandb_writer()
        args = megatron_compat.loaded_global_args()
        iteration = getattr(args, "curr_iteration", None) if args is not None else None
    except Exception:  # noqa: BLE001 - an uninitialized or changed megatron.training
        return None, None, None
    return writer, wandb_writer, iteration


def log_metrics(metrics: dict, iteration: int | None = None, timers=None,
                writer=None, wandb_writer=None) -> bool:
    """Write a traced step's scalars to Megatron's tensorboard / wandb writers (the ones given,
    else megatron.training's, when it runs) and, when Megatron's timers are configured or a
    writer took them, one INFO line to the "megatron_pp_ext" logger. Returns whether anything
    was written."""
    if not metrics:
        return False
    if writer is None and wandb_writer is None:
        writer, wandb_writer, megatron_iteration = megatron_writers()
        iteration = megatron_iteration if iteration is None else iteration
    wrote = False
    if writer is not None:
        for tag, value in metrics.items():
            writer.add_scalar(tag, value, iteration)
        wrote = True
    if wandb_writer is not None:
        wandb_writer.log(dict(metrics), iteration)
        wrote = True
    if timers is not None or wrote:
        logger.info("step %s: %s", iteration if iteration is not None else "-",
                    " ".join(f"{tag}={value:.4g}" for tag, value in metrics.items()))
        wrote = True
    return wrote


__all__ = [
    "BUBBLE_TAG", "PEAK_TAG", "PEAK_BYTES_TAG", "PREDICTED_BUBBLE_TAG", "MAKESPAN_TAG", "COMM_WAIT",
    "clock_offset", "rank_payload", "build_timeline", "local_timeline", "gather_timeline",
    "mean_durations", "message_latency", "calibrated_costs", "predicted_timeline", "summary_text", "step_metrics",
    "share_metrics", "megatron_writers", "log_metrics",
]
