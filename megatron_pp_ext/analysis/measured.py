"""Statistics of a measured timeline (``runtime.trace`` gathers it from the ranks): mean
durations per stage and kind, the message latency, the costs they calibrate, the simulator's
prediction under them, and the per-rank summary and scalars a traced step reports. No torch.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace

from ..ir import Action, Schedule
from ..timeline import COMM_WAIT, COMPUTE, Timeline
from ..units import format_bytes_iec
from .shared_cores import alone_on_a_core, simulate_shared_cores, wake_delay
from .simulate import CostModel, simulate

#: The scalars a traced step reports (tensorboard / wandb tags).
BUBBLE_TAG = "pipeline/bubble_fraction"
PREDICTED_BUBBLE_TAG = "pipeline/predicted_bubble_fraction"
PEAK_TAG = "pipeline/peak_activations"  # a count
PEAK_BYTES_TAG = "pipeline/peak_activation_bytes"
MAKESPAN_TAG = "pipeline/makespan_s"


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
    samples = []
    for e in timeline.events:
        if e.category != COMM_WAIT or "<-rank" not in e.label:
            continue
        try:
            action = Action.parse(e.label.split()[1].split("<-")[0])
        except (ValueError, IndexError):
            continue
        before, after = schedule.upstream(action.stage), schedule.downstream(action.stage)
        if action.kind == "F" and before is not None:
            producers = [f"{before}F{action.microbatch}"]
            stage = before
        elif action.kind in ("B", "I") and after is not None:
            producers = [f"{after}{k}{action.microbatch}" for k in ("B", "I")]
            stage = after
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
                       t_comm: float | None = None, cores: float | None = None,
                       woken_wait: float | None = None) -> Timeline:
    """The simulator's timeline of ``schedule`` under the costs measured in ``measured``
    (``t_comm`` as in :func:`calibrated_costs`). ``cores``: the ranks shared that many cores
    (more ranks than cores on one machine): the costs are taken alone on a core and the
    prediction shares the cores as the step did (``shared_cores``), a rank woken while they
    are all taken waiting ``woken_wait`` seconds for one (default: ``wake_delay`` of this
    machine's CPUs)."""
    if cores is None:
        predicted = simulate(schedule, calibrated_costs(measured, schedule, t_comm),
                             validate=False)
    else:
        latency = message_latency(measured, schedule) if t_comm is None else t_comm
        uncontended, host = alone_on_a_core(measured, cores)
        alone = replace(calibrated_costs(uncontended, schedule, latency), per="stage",
                        t_overhead=[host[schedule.rank_of(stage)]
                                    for stage in range(schedule.num_stages)])
        predicted = simulate_shared_cores(
            schedule, alone, cores, wake_delay() if woken_wait is None else woken_wait)
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
