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
from collections import defaultdict
from pathlib import Path
from typing import Sequence

from ..analysis.simulate import CostModel, simulate
from ..ir import Action, Schedule
from ..timeline import COMM_WAIT, COMPUTE, Event, Timeline
from .memory import format_bytes_iec

logger = logging.getLogger("megatron_pp_ext")

#: The scalars a traced step reports (tensorboard / wandb tags).
BUBBLE_TAG = "pipeline/bubble_fraction"
PREDICTED_BUBBLE_TAG = "pipeline/predicted_bubble_fraction"
PEAK_TAG = "pipeline/peak_activations"  # a count
PEAK_BYTES_TAG = "pipeline/peak_activation_bytes"
MAKESPAN_TAG = "pipeline/makespan_s"


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
    from ..analysis.render import render_chrome_trace

    path = Path(folder) / TRACE_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".json.partial")
    partial.write_text(json.dumps(render_chrome_trace(timeline)))
    partial.replace(path)
    return path


def mean_durations(timeline: Timeline) -> dict[tuple[int, str], float]:
    """Mean duration of each (stage, kind) over the timeline's compute events."""
    total: dict[tuple[int, str], float] = defaultdict(float)
    count: dict[tuple[int, str], int] = defaultdict(int)
    for e in timeline.events:
        if e.category != COMPUTE:
            continue
        action = Action.parse(e.label)
        total[(action.stage, action.kind)] += e.duration
        count[(action.stage, action.kind)] += 1
    return {key: total[key] / count[key] for key in total}


def message_latency(timeline: Timeline, schedule: Schedule) -> float:
    """The median time from the end of an action to the end of its consumer's wait for the
    result, over the messages the consumer was already waiting for (0.0 if none): what one
    message costs end to end (the sender's post, the wire, the receiver's wake-up)."""
    end_of = {(e.rank, e.label): e.end for e in timeline.events if e.category == COMPUTE}
    last = schedule.num_stages - 1
    samples = []
    for e in timeline.events:
        if e.category != COMM_WAIT or "<-rank" not in e.label:
            continue
        try:
            action = Action.parse(e.label.split()[1].split("<-")[0])
        except (ValueError, IndexError):
            continue
        if action.kind == "F" and action.stage > 0:
            producers = [f"{action.stage - 1}F{action.microbatch}"]
            stage = action.stage - 1
        elif action.kind in ("B", "I") and action.stage < last:
            producers = [f"{action.stage + 1}{k}{action.microbatch}" for k in ("B", "I")]
            stage = action.stage + 1
        else:
            continue
        for label in producers:
            produced = end_of.get((schedule.rank_of(stage), label))
            if produced is not None and e.start <= produced <= e.end:
                samples.append(e.end - produced)
    if not samples:
        return 0.0
    samples.sort()
    return samples[len(samples) // 2]


def calibrated_costs(timeline: Timeline, schedule: Schedule,
                     t_comm: float | None = None) -> CostModel:
    """A ``CostModel`` with the measured mean F, B, I, W durations of every stage (seconds).

    A stage that ran whole backwards gets its mean B as ``t_b`` (and half of it as ``t_i`` and
    ``t_w``); one that ran split backwards gets its means of I and W, and ``t_b = t_i + t_w``.
    A kind never measured on a stage costs 0. ``t_comm`` is the message latency to predict
    with: by default the measured one (:func:`message_latency`); 0.0 predicts compute alone.
    """
    if t_comm is None:
        t_comm = message_latency(timeline, schedule)
    means = mean_durations(timeline)
    t_f, t_b, t_i, t_w = [], [], [], []
    for stage in range(schedule.num_stages):
        f = means.get((stage, "F"), 0.0)
        b = means.get((stage, "B"))
        i, w = means.get((stage, "I")), means.get((stage, "W"))
        if b is None:
            i, w = i or 0.0, w or 0.0
            b = i + w
        else:
            i = b / 2 if i is None else i
            w = b / 2 if w is None else w
        t_f.append(f)
        t_b.append(b)
        t_i.append(i)
        t_w.append(w)
    return CostModel(t_f=t_f, t_i=t_i, t_w=t_w, t_b=t_b, t_comm=t_comm)


def predicted_timeline(measured: Timeline, schedule: Schedule,
                       t_comm: float | None = None) -> Timeline:
    """The simulator's timeline of ``schedule`` under the costs measured in ``measured``
    (``t_comm`` as in :func:`calibrated_costs`)."""
    predicted = simulate(schedule, calibrated_costs(measured, schedule, t_comm),
                         validate=False)
    predicted.unit = "s"
    return predicted


# ---------------------------------------------------------------- reporting
def summary_text(measured: Timeline, predicted: Timeline | None = None) -> str:
    """Per rank busy / comm-wait / idle time and peak activations, then makespan and bubble,
    measured beside predicted (when given)."""
    unit = measured.unit if measured.unit != "t" else ""
    makespan = measured.makespan
    rows = measured.per_rank_summary()
    predicted_peaks = list(predicted.peak_activations) if predicted is not None else []
    with_bytes = any(b is not None for b in measured.peak_bytes)
    lines = [
        f"{measured.schedule} p={measured.num_ranks} m={measured.num_microbatches} "
        f"v={measured.chunks}: {measured.source} step, per rank",
        f"{'rank':>4}  {'busy':>10}  {'comm wait':>10}  {'idle':>10}  {'idle %':>6}  "
        f"{'peak act.':>9}" + (f"  {'predicted':>9}" if predicted is not None else "")
        + (f"  {'peak bytes':>10}" if with_bytes else ""),
    ]
    for row in rows:
        r = row["rank"]
        idle_pct = 100 * row["idle"] / makespan if makespan > 0 else 0.0
        line = (f"{r:>4}  {row['busy']:>9.4g}{unit}  {row['comm_wait']:>9.4g}{unit}  "
                f"{row['idle']:>9.4g}{unit}  {idle_pct:>5.1f}%  {row['peak_activations']!s:>9}")
        if predicted is not None:
            line += f"  {predicted_peaks[r] if r < len(predicted_peaks) else '-'!s:>9}"
        if with_bytes:
            line += f"  {format_bytes_iec(row['peak_bytes']):>10}"
        lines.append(line)
    if with_bytes:
        lines.append("peak act.: a count of chunk-activations held (the simulator's unit); "
                     "peak bytes: measured (saved tensors, W queue, waiting arrivals)")
    bubble = 100 * measured.bubble_fraction
    if predicted is None:
        lines.append(f"makespan {makespan:.4g}{unit}; bubble {bubble:.2f}%")
    else:
        predicted_bubble = 100 * predicted.bubble_fraction
        p_unit = predicted.unit if predicted.unit != "t" else ""
        lines.append(f"makespan: measured {makespan:.4g}{unit}, predicted "
                     f"{predicted.makespan:.4g}{p_unit}")
        lines.append(f"bubble: measured {bubble:.2f}%, predicted {predicted_bubble:.2f}% "
                     f"({bubble - predicted_bubble:+.2f} points; predicted = the simulator with "
                     "this step's mean F/B/I/W per stage and median message latency)")
    return "\n".join(lines)


def step_metrics(measured: Timeline, predicted: Timeline | None = None) -> dict[str, float]:
    """The scalars of one traced step, by tensorboard tag."""
    metrics = {
        BUBBLE_TAG: measured.bubble_fraction,
        PEAK_TAG: float(max(measured.peak_activations, default=0)),
        MAKESPAN_TAG: measured.makespan,
    }
    known = [b for b in measured.peak_bytes if b is not None]
    if known:
        metrics[PEAK_BYTES_TAG] = float(max(known))
    if predicted is not None:
        metrics[PREDICTED_BUBBLE_TAG] = predicted.bubble_fraction
    return metrics


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
        args = getattr(global_vars, "_GLOBAL_ARGS", None)
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
    "BUBBLE_TAG", "PEAK_TAG", "PREDICTED_BUBBLE_TAG", "MAKESPAN_TAG", "COMM_WAIT",
    "clock_offset", "rank_payload", "build_timeline", "local_timeline", "gather_timeline",
    "mean_durations", "message_latency", "calibrated_costs", "predicted_timeline", "summary_text", "step_metrics",
    "share_metrics", "megatron_writers", "log_metrics",
]
