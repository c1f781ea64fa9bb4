"""Observability: measured timelines (the executor's trace gathered into the simulator's
Timeline type), measured against predicted, the plan logged before the first step, and the
startup agreement's message."""

from __future__ import annotations

import logging

import pytest
import torch

from megatron_pp_ext.analysis.simulate import CostModel, simulate
from support.emulated import EmulatedCosts
from megatron_pp_ext.integration import agreement
from megatron_pp_ext.integration.plan import plan_text, warmup_counts
from megatron_pp_ext.runtime import trace
from megatron_pp_ext.schedules import build_schedule
from megatron_pp_ext.timeline import COMM_WAIT, Timeline

from support.inmemory import run_inmemory

# emulated cost of one F, I or W (a B is I + W) in seconds: sleeps, long enough that the
# per-action overhead of a loaded machine (the suite's other worker beside it) stays a small
# part of the measured bubble (at 0.03 s it once reached 5.02 points, the tolerance 5)
T = 0.06


def _compute_labels(timeline: Timeline, rank: int) -> list[str]:
    return [e.label for e in sorted(timeline.compute_events(rank), key=lambda e: e.start)]


# ------------------------------------------------------------------ in memory
def test_traced_inmemory_run_gives_one_event_per_action_in_order():
    schedule = build_schedule("zb-h1", 3, 5)
    results = run_inmemory(schedule, trace=True)
    timeline = trace.local_timeline(schedule, [result for result, _ in results])
    assert timeline.source == "measured" and timeline.unit == "s"
    assert (timeline.num_ranks, timeline.num_microbatches, timeline.chunks) == (3, 5, 1)
    for rank in range(3):
        assert _compute_labels(timeline, rank) == [str(a) for a in schedule.actions[rank]]
        for e in timeline.events:
            assert e.end >= e.start >= 0.0
    assert min(e.start for e in timeline.events) == 0.0
    assert timeline.peak_activations == simulate(schedule).peak_activations
    # waits are recorded too, and they never overlap the rank's computing
    waits = [e for e in timeline.events if e.category == COMM_WAIT]
    assert waits and all(e.label.startswith("wait ") for e in waits)


def test_tracing_is_off_by_default():
    schedule = build_schedule("1f1b", 2, 3)
    results = run_inmemory(schedule)
    assert all(result.events == [] for result, _ in results)


def test_calibrated_costs_are_the_measured_means_per_stage_and_kind():
    schedule = build_schedule("1f1b", 2, 4)
    results = run_inmemory(schedule, costs=EmulatedCosts(t_f=0.004, t_i=0.002, t_w=0.002),
                           trace=True)
    timeline = trace.local_timeline(schedule, [result for result, _ in results])
    costs = trace.calibrated_costs(timeline, schedule)
    for stage in range(2):  # at least the sleeps (a busy machine only adds; no upper bound)
        assert costs.t_f[stage] >= 0.004 and costs.t_b[stage] >= 0.004
    means = trace.mean_durations(timeline)
    assert costs.t_f == [means[(0, "F")], means[(1, "F")]]
    assert costs.t_b == [means[(0, "B")], means[(1, "B")]]


def test_summary_puts_measured_beside_predicted():
    schedule = build_schedule("1f1b", 4, 8)
    predicted = simulate(schedule, CostModel(t_f=1, t_i=1, t_w=1))
    measured = simulate(schedule, CostModel(t_f=1, t_i=1, t_w=1, t_comm=0.5))
    measured.source, measured.unit = "measured", "s"
    text = trace.summary_text(measured, predicted)
    lines = text.splitlines()
    assert lines[0] == "1f1b p=4 m=8 v=1: measured step, per rank"
    assert lines[1].split() == ["rank", "busy", "comm", "wait", "idle", "idle", "%", "peak",
                                "act.", "predicted"]
    row0 = lines[2].split()
    assert row0[0] == "0" and row0[1] == "24s" and row0[-2:] == ["4", "4"]
    assert f"predicted {100 * predicted.bubble_fraction:.2f}%" in text
    assert f"bubble: measured {100 * measured.bubble_fraction:.2f}%" in text
    assert "predicted 27.27%" in text


def test_metrics_go_to_the_writers():
    class Writer:
        def __init__(self):
            self.scalars = []

        def add_scalar(self, tag, value, step):
            self.scalars.append((tag, value, step))

    writer = Writer()
    metrics = {trace.BUBBLE_TAG: 0.25, trace.PEAK_TAG: 4.0}
    assert trace.log_metrics(metrics, iteration=7, writer=writer)
    assert writer.scalars == [("pipeline/bubble_fraction", 0.25, 7),
                              ("pipeline/peak_activations", 4.0, 7)]
    assert not trace.log_metrics(metrics)  # no writer, no timers: nothing to write to


def test_metrics_are_logged_when_megatron_timers_are_configured(caplog):
    metrics = {trace.BUBBLE_TAG: 0.25, trace.PEAK_TAG: 4.0}
    with caplog.at_level(logging.INFO, logger="megatron_pp_ext"):
        assert trace.log_metrics(metrics, iteration=3, timers=object())
    assert caplog.messages == ["step 3: pipeline/bubble_fraction=0.25 "
                               "pipeline/peak_activations=4"]


# ------------------------------------------------------------------ plan and agreement
def test_plan_text_for_1f1b():
    schedule = build_schedule("1f1b", 4, 8)
    assert warmup_counts(schedule) == [3, 2, 1, 0]
    text = plan_text(schedule, tensor_shape=(1024, 2, 4096), dtype=torch.bfloat16)
    lines = text.splitlines()
    assert lines[0] == ("pipeline plan: schedule 1f1b, p=4 pipeline ranks, m=8 microbatches, "
                        "v=1 model chunk(s) per rank (4 stages)")
    assert lines[1] == "one pipeline tensor: shape (1024, 2, 4096) x bfloat16 = 16.0 MiB"
    rows = [line.split() for line in lines[3:7]]
    assert [row[2] for row in rows] == ["3", "2", "1", "0"]  # warmup forwards
    assert [row[3] for row in rows] == ["4", "3", "2", "1"]  # peak activations
    assert [" ".join(row[4:]) for row in rows] == ["64.0 MiB", "48.0 MiB", "32.0 MiB",
                                                  "16.0 MiB"]
    assert lines[-1].startswith("predicted bubble: 27.27% ")


def test_plan_text_for_interleaved_uses_megatrons_warmup():
    schedule = build_schedule("interleaved", 4, 8, chunks=2)
    # Megatron: (p - r - 1) * 2 + (v - 1) * p
    assert warmup_counts(schedule) == [10, 8, 6, 4]
    assert "v=2 model chunk(s) per rank (8 stages)" in plan_text(schedule)


def test_agreement_message_names_ranks_and_values():
    base = agreement.settings("1f1b", 4, 8, 1, False, (16, 2, 32), torch.float32, False,
                              {"schedule": "1f1b", "trace": False})
    odd = dict(base, num_microbatches=4)
    assert agreement.fingerprint(base) == agreement.fingerprint(dict(base))
    assert agreement.fingerprint(base) != agreement.fingerprint(odd)
    text = agreement.describe_disagreement([base, base, odd, base], global_ranks=[0, 1, 2, 3])
    assert text.startswith("pipeline ranks disagree before the first step: ranks 0, 1, 3 have "
                           "num_microbatches=8, rank 2 has num_microbatches=4. Every rank")
    two = [dict(base, trace=True), base]
    text = agreement.describe_disagreement(two, global_ranks=[4, 6])
    assert "rank 0 (global rank 4) has trace=True, rank 1 (global rank 6) has trace=False" \
        in text


# ------------------------------------------------------------------ real processes
def emulated_traced_steps(rank, world_size, names, p, m, cost):
    """Spawn target: each schedule runs twice over gloo with the real executor and emulated
    stages (sleep costs); the second step is traced and gathered on rank 0."""
    import torch.distributed as dist

    from support.emulated import EmulatedStageWork, microbatch_inputs, stage_weights
    from megatron_pp_ext.runtime.executor import Executor
    from megatron_pp_ext.runtime.transport import TorchDistTransport

    transport = TorchDistTransport(None)
    out = {}
    for name in names:
        schedule = build_schedule(name, p, m)
        weights = stage_weights(schedule.num_stages, 6)
        inputs = microbatch_inputs(m, 3, 6)
        for traced in (False, True):  # a free first step warms up autograd and the sockets
            costs = EmulatedCosts(t_f=cost, t_i=cost, t_w=cost) if traced else None
            work = EmulatedStageWork(schedule, rank, weights, inputs, costs=costs)
            dist.barrier()
            result = Executor(schedule, rank, transport, work, recv_shape=(3, 6),
                              dtype=torch.float64, device=transport.device, timeout_s=30,
                              trace=traced).run()
        timeline = trace.gather_timeline(result, schedule, rank, None, transport.device)
        out[name] = None if timeline is None else timeline.to_dict()
    return out


def test_measured_bubble_matches_the_prediction_over_gloo():
    from megatron_pp_ext.train.processes import spawn

    p, m = 4, 8
    per_rank = spawn(p, emulated_traced_steps, ["1f1b", "zb-h1"], p, m, T, timeout_s=90)
    assert all(r[name] is None for r in per_rank[1:] for name in r)  # rank 0 only
    report = {}
    for name, data in per_rank[0].items():
        schedule = build_schedule(name, p, m)
        measured = Timeline.from_dict(data)
        assert measured.source == "measured" and measured.num_ranks == p
        for rank in range(p):
            assert _compute_labels(measured, rank) == [str(a) for a in schedule.actions[rank]]
        assert measured.peak_activations == simulate(schedule).peak_activations
        # the clocks were aligned: no rank finishes waiting for an activation before the
        # rank that computed it had finished computing it
        end_of = {e.label: e.end for e in measured.compute_events()}
        checked = 0
        for e in measured.events:
            if e.category == COMM_WAIT and e.label.startswith("wait ") and "<-rank" in e.label:
                action = e.label.split()[1].split("<-")[0]
                stage, kind, mb = int(action[0]), action[1], action[2:]
                if kind == "F":
                    assert e.end >= end_of[f"{stage - 1}F{mb}"] - 0.002, e
                    checked += 1
        assert checked >= m
        predicted = trace.predicted_timeline(measured, schedule)
        measured_pct, predicted_pct = 100 * measured.bubble_fraction, 100 * predicted.bubble_fraction
        report[name] = (measured_pct, predicted_pct, measured.makespan)
        assert abs(measured_pct - predicted_pct) < 5.0, trace.summary_text(measured, predicted)
    # 1F1B with t_B = 2 t_F: the textbook (p-1)/(m+p-1) = 27.27%; zb-h1 well below it
    assert abs(report["1f1b"][1] - 100 * 3 / 11) < 2.0, report
    assert report["zb-h1"][0] < report["1f1b"][0] - 10, report


def traced_megatron_steps(rank, world_size, name, trace_dir=None):
    """Spawn target: two steps of the tiny GPT through ScheduleFunction(trace=True)."""
    from support.reference import run_step
    from megatron_pp_ext.integration.forward_backward import ScheduleFunction

    records = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logger = logging.getLogger("megatron_pp_ext")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    fn = ScheduleFunction(name, trace=True, trace_dir=trace_dir)
    state = fn.state
    out = []
    for _ in range(2):
        run_step(rank, world_size, fn, pp=world_size, num_microbatches=4)
        out.append({
            "timeline": None if state.last_timeline is None else state.last_timeline.to_dict(),
            "summary": state.summary(), "metrics": dict(state.last_metrics),
            "events": len(state.last_step.events)})
    return {"steps": out, "logged": records}


def test_install_trace_sets_last_timeline_on_rank_0(tmp_path):
    from megatron_pp_ext.analysis.costs import load_costs
    from megatron_pp_ext.train.processes import spawn

    per_rank = spawn(2, traced_megatron_steps, "zb-h1", str(tmp_path), timeout_s=90)
    # trace_dir (Megatron-LM: --pp-trace-dir): the last step as a Chrome trace, which the
    # commands' --costs reads: the measured F, I, W of both ranks
    last = Timeline.from_dict(per_rank[0]["steps"][-1]["timeline"])
    measured = load_costs(str(tmp_path / trace.TRACE_FILE))
    assert measured.num_ranks == 2
    assert measured.t_f == pytest.approx(
        [sum(e.duration for e in last.compute_events(r) if e.kind == "F") / 4 for r in range(2)],
        rel=1e-6)
    schedule = build_schedule("zb-h1", 2, 4)
    for step in per_rank[0]["steps"]:
        timeline = Timeline.from_dict(step["timeline"])
        for rank in range(2):
            assert _compute_labels(timeline, rank) == [str(a) for a in schedule.actions[rank]]
        assert "bubble: measured" in step["summary"]
        assert step["metrics"][trace.BUBBLE_TAG] == pytest.approx(timeline.bubble_fraction)
    for step in per_rank[1]["steps"]:
        assert step["timeline"] is None and step["summary"] is None
        assert step["events"] >= len(schedule.actions[1])
        # the scalars reach every pipeline rank (Megatron's writer lives on the last one)
        assert set(step["metrics"]) >= {trace.BUBBLE_TAG, trace.PEAK_TAG}
    # the plan is logged once, before the first step, by pipeline rank 0 only
    plans = [m for m in per_rank[0]["logged"] if m.startswith("pipeline plan:")]
    assert len(plans) == 1 and "schedule zb-h1, p=2 pipeline ranks, m=4" in plans[0]
    assert not any(m.startswith("pipeline plan:") for m in per_rank[1]["logged"])
