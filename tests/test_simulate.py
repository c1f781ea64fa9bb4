"""The cost-model simulator against the published bubble formulas and hand-worked timelines."""

import csv
import io
from fractions import Fraction
from pathlib import Path

import pytest

from megatron_pp_ext.analysis.simulate import CostModel, simulate
from megatron_pp_ext.ir import Action, Schedule, ScheduleError
from megatron_pp_ext.schedules import build_schedule
from megatron_pp_ext.timeline import COMM_WAIT

PEER_CSV = Path(__file__).parent / "data" / "torch_zb1p_2rank_2stagep_compute.csv"
EQUAL = CostModel(t_f=1, t_b=1)  # t_F = t_B: the papers' tables


def spans(timeline, rank, category=None):
    """[(label, start, end)] of one rank, in time order."""
    return [
        (e.label, e.start, e.end)
        for e in timeline.events
        if e.rank == rank and (category is None or e.category == category)
    ]


# ---------------------------------------------------------------- published numbers
@pytest.mark.parametrize("name,peaks", [("1f1b", [4, 3, 2, 1]), ("gpipe", [8, 8, 8, 8])])
def test_1f1b_and_gpipe_bubble_and_peaks_p4_m8(name, peaks):
    p, m = 4, 8
    timeline = simulate(build_schedule(name, p, m), EQUAL)
    assert timeline.makespan == 2 * (m + p - 1) == 22
    assert timeline.bubble_fraction == (p - 1) / (m + p - 1)  # exactly 3/11
    assert timeline.peak_activations == peaks
    assert [timeline.busy(r) for r in range(p)] == [16.0] * 4


@pytest.mark.parametrize("p,m", [(2, 5), (3, 7), (8, 16), (5, 2)])
def test_1f1b_bubble_formula_for_any_f_b_ratio(p, m):
    timeline = simulate(build_schedule("1f1b", p, m), CostModel(t_f=1, t_b=2))
    assert timeline.makespan == 3 * (m + p - 1)
    assert timeline.bubble_fraction == pytest.approx((p - 1) / (m + p - 1), abs=1e-12)


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 16), (8, 16)])
@pytest.mark.parametrize("v", [2, 3])
def test_interleaved_bubble(p, m, v):
    """Measured: with equal per-chunk costs and m a multiple of p the bubble fraction is exactly
    (p-1)/(v*m + p-1), and the idle time is 1F1B's divided by v. For p=4, m=8, v=2 that is
    3/19 = 0.158 against 1F1B's 3/11 = 0.273: a ratio of 11/19 = 0.58, which tends to the
    "about 1/2" (1/v) as m grows, since the fractions' denominators carry the p-1 term."""
    share = CostModel(t_f=1, t_b=1)  # a rank's share: each of its v chunks costs 1/v of it
    schedule = build_schedule("interleaved", p, m, v)
    interleaved = simulate(schedule, share)
    chunk = CostModel.for_stages(t_f=1 / v, t_b=1 / v)  # the same, given per stage
    assert simulate(schedule, chunk).events == interleaved.events
    plain = simulate(build_schedule("1f1b", p, m), EQUAL)
    assert interleaved.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1), abs=1e-12)
    for rank in range(p):
        assert interleaved.idle(rank) == pytest.approx(plain.idle(rank) / v, abs=1e-9)
    ratio = interleaved.bubble_fraction / plain.bubble_fraction
    assert ratio == pytest.approx((m + p - 1) / (v * m + p - 1), abs=1e-12)


def test_interleaved_p4_m8_is_about_half_of_1f1b():
    interleaved = simulate(build_schedule("interleaved", 4, 8, 2), EQUAL)
    plain = simulate(build_schedule("1f1b", 4, 8), EQUAL)
    assert interleaved.bubble_fraction == pytest.approx(3 / 19, abs=1e-12)
    ratio = interleaved.bubble_fraction / plain.bubble_fraction
    assert ratio == pytest.approx(float(Fraction(11, 19)))
    assert interleaved.peak_activations == [11, 9, 7, 5]  # chunk activations, 1/2 the size each


# ---------------------------------------------------------------- hand-worked timelines
def test_1f1b_p2_m2_every_event():
    timeline = simulate(build_schedule("1f1b", 2, 2), CostModel(t_f=1, t_b=2))
    assert spans(timeline, 0) == [
        ("0F0", 0, 1), ("0F1", 1, 2), ("wait 0B0<-rank 1", 2, 4), ("0B0", 4, 6),
        ("wait 0B1<-rank 1", 6, 7), ("0B1", 7, 9),
    ]
    assert spans(timeline, 1) == [
        ("wait 1F0<-rank 0", 0, 1), ("1F0", 1, 2), ("1B0", 2, 4), ("1F1", 4, 5), ("1B1", 5, 7),
    ]
    assert timeline.makespan == 9
    assert timeline.bubble_fraction == pytest.approx(1 / 3)
    assert timeline.comm_wait(0) == 3 and timeline.comm_wait(1) == 1


def test_comm_time_delays_remote_inputs_only():
    timeline = simulate(build_schedule("1f1b", 2, 1), CostModel(t_f=1, t_comm=0.5))
    assert spans(timeline, 0) == [("0F0", 0, 1), ("wait 0B0<-rank 1", 1, 5), ("0B0", 5, 7)]
    assert spans(timeline, 1) == [("wait 1F0<-rank 0", 0, 1.5), ("1F0", 1.5, 2.5),
                                  ("1B0", 2.5, 4.5)]
    assert timeline.makespan == 7
    # same-rank handoff (p=1, two chunks) is free: no wait, no delay
    local = simulate(build_schedule("interleaved", 1, 1, 2), CostModel(t_comm=5))
    assert spans(local, 0) == [("0F0", 0, 0.5), ("1F0", 0.5, 1), ("1B0", 1, 2), ("0B0", 2, 3)]


def test_per_stage_and_per_rank_costs():
    timeline = simulate(build_schedule("1f1b", 2, 1), CostModel(t_f=[1, 3], t_b=[2, 1]))
    assert spans(timeline, 1, "compute") == [("1F0", 1, 4), ("1B0", 4, 5)]
    assert spans(timeline, 0, "compute") == [("0F0", 0, 1), ("0B0", 5, 7)]
    interleaved = build_schedule("interleaved", 2, 2, 2)
    # a rank's share (a number, or one per rank) is split over the rank's 2 chunks; a list
    # with one number per stage is each stage's own time, as given
    share = CostModel(t_f=[1, 2], t_i=0.5, t_w=[1, 1, 2, 2], t_comm=[0.1, 0.2])
    costs = share.per_stage(interleaved)
    assert costs["t_f"] == [0.5, 1, 0.5, 1]  # stages 0, 2 on rank 0; 1, 3 on rank 1
    assert costs["t_i"] == [0.25] * 4
    assert costs["t_w"] == [1, 1, 2, 2]
    assert costs["t_b"] == [1.25, 1.25, 2.25, 2.25]  # t_i + t_w
    assert costs["t_comm"] == [0.1, 0.2, 0.1, 0.2]  # per message: never divided by v
    per_stage = CostModel.for_stages(t_f=[1, 2], t_i=0.5, t_w=[1, 1, 2, 2]).per_stage(
        interleaved)
    assert per_stage["t_f"] == [1, 2, 1, 2] and per_stage["t_i"] == [0.5] * 4
    assert per_stage["t_b"] == [1.5, 1.5, 2.5, 2.5]


def test_cost_model_rejects_bad_values():
    schedule = build_schedule("interleaved", 2, 2, 2)
    with pytest.raises(ValueError, match=r"t_f has 3 values: give one number, one per stage \(4\) "
                                         r"or one per rank \(2\)"):
        simulate(schedule, CostModel(t_f=[1, 2, 3]))
    with pytest.raises(ValueError, match=r"t_w=-1: costs must be >= 0"):
        simulate(schedule, CostModel(t_w=-1))
    with pytest.raises(ValueError, match=r"per='chunk': choose 'rank'"):
        CostModel(per="chunk")


def test_default_costs():
    costs = CostModel().per_stage(build_schedule("1f1b", 3, 2))
    assert costs == {"t_f": [1.0] * 3, "t_i": [1.0] * 3, "t_w": [1.0] * 3, "t_comm": [0.0] * 3,
                     "t_overhead": [0.0] * 3, "t_b": [2.0] * 3}


# ---------------------------------------------------------------- one cost convention
def test_default_costs_compare_every_schedule_directly():
    """A cost is a rank's share: with the defaults (t_F = t_I = t_W = 1 per rank and
    microbatch) every rank computes m (t_F + t_B) = 24 under every schedule, and the V
    schedules and interleaved come out faster than 1F1B (their chunks cost 1/2 each)."""
    p, m = 4, 8
    spans_ = {}
    for name in ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2", "zb-v", "dualpipev"):
        timeline = simulate(build_schedule(name, p, m))
        assert [timeline.busy(r) for r in range(p)] == pytest.approx([24.0] * p), name
        spans_[name] = timeline.makespan
    assert spans_["1f1b"] == 33  # (m + p - 1)(t_F + t_B)
    assert spans_["zb-v"] == 25.5 < spans_["1f1b"]  # (p - 1) t_F / 2 of bubble
    assert spans_["interleaved"] == 28.5 < spans_["1f1b"]  # (p - 1)(t_F + t_B) / 2
    assert spans_["dualpipev"] == 25.5 and spans_["zb-h1"] == 27


def test_chunk_actions_cost_a_share_over_v_but_overhead_and_comm_do_not_shrink():
    schedule = build_schedule("zb-v", 2, 4)
    timeline = simulate(schedule, CostModel(t_f=2, t_i=1, t_w=3, t_comm=0.25,
                                            t_overhead=0.5))
    durations = {e.label[1:2]: e.duration for e in timeline.compute_events()}
    assert durations == {"F": 1 + 0.5, "I": 0.5 + 0.5, "W": 1.5}  # W carries no overhead
    starts = {e.label: e.start for e in timeline.compute_events()}
    assert starts["1F0"] == 1.5 + 0.25  # 0F0 ends at 1.5 on rank 0; the message takes 0.25
    same = CostModel.for_stages(t_f=1, t_i=0.5, t_w=1.5, t_comm=0.25, t_overhead=0.5)
    assert simulate(schedule, same).events == timeline.events


def test_whole_backward_alone_runs_plain_schedules_and_refuses_split_ones():
    """t_b without t_i and t_w (what a 1F1B run measures): nothing is made up for I and W."""
    measured = CostModel(t_f=0.0025, t_b=0.0028)
    plain = simulate(build_schedule("1f1b", 4, 8), measured)
    assert plain.makespan == pytest.approx(11 * (0.0025 + 0.0028))
    assert not measured.split_known
    for name in ("zb-h1", "zb-h2", "zb-v", "dualpipev"):
        with pytest.raises(ValueError, match=rf"{name} splits the backward into I .* only "
                                             r"t_b.*--assume-split X"):
            simulate(build_schedule(name, 4, 8), measured)
    # one half given: the other is the rest of t_b
    costs = CostModel(t_f=1, t_i=1.5, t_b=2).per_stage(build_schedule("zb-h1", 2, 2))
    assert costs["t_w"] == [0.5, 0.5] and costs["t_b"] == [2, 2]
    with pytest.raises(ValueError, match="t_i=3 exceeds t_b=2"):
        CostModel(t_i=3, t_b=2).per_stage(build_schedule("zb-h1", 2, 2))


def test_one_compute_event_per_action():
    schedule = build_schedule("interleaved", 4, 8, 2)
    timeline = simulate(schedule)
    assert sorted(e.label for e in timeline.compute_events()) == sorted(
        t for row in schedule.text() for t in row
    )
    assert all(e.label.startswith("wait ") for e in timeline.events if e.category == COMM_WAIT)
    assert (timeline.source, timeline.unit, timeline.chunks) == ("predicted", "t", 2)
    for rank in range(4):  # a rank runs its list in order, one action at a time
        compute = timeline.compute_events(rank)
        assert [e.label for e in compute] == schedule.text()[rank]
        assert all(a.end <= b.start for a, b in zip(compute, compute[1:]))


# ---------------------------------------------------------------- loaded and invalid schedules
def test_peer_csv_simulates_to_its_own_grid():
    """With unit costs each action of PyTorch's ZB1P file starts at its own CSV column, but for
    one: the file leaves rank 0 idle at column 3 and runs 2F1 at column 4, while the simulator
    starts every action as soon as it can, so 2F1 runs at 3 (its input, 1F1, ends at 3) and
    the idle slot moves behind it (2I0 waits for 3I0, which ends at 5, either way)."""
    text = PEER_CSV.read_text()
    schedule = Schedule.from_csv(text)
    # one CSV column = one action of one stage: unit costs per stage (2 stages per rank)
    timeline = simulate(schedule, CostModel.for_stages(t_f=1, t_i=1, t_w=1), channels="kind")
    for rank, row in enumerate(csv.reader(io.StringIO(text))):
        starts = {e.label: e.start for e in timeline.compute_events(rank)}
        for column, cell in enumerate(row):
            if cell:
                action = Action.parse(cell)
                if action.kind == "B":  # the legacy file's input-gradient half
                    action = Action(action.stage, "I", action.microbatch)
                expected = 3 if (rank, cell) == (0, "2F1") else column
                assert starts[str(action)] == expected, (rank, cell)
    assert timeline.makespan == 49
    assert timeline.peak_activations == [4, 4]
    # the same as a rank's share of 1 per kind: each of a rank's two stages costs 1/2
    assert simulate(schedule, CostModel(), channels="kind").makespan == 24.5


def test_invalid_schedules_raise_not_hang():
    deadlocked = Schedule("hand", 2, (0, 1), [
        [Action.parse(t) for t in "0F0 0B0 0F1 0B1".split()],
        [Action.parse(t) for t in "1F0 1F1 1B0 1B1".split()],
    ])
    with pytest.raises(ScheduleError, match="deadlock between ranks 0 -> 1 -> 0"):
        simulate(deadlocked)
    with pytest.raises(ScheduleError, match="deadlock between ranks 0 -> 1 -> 0"):
        simulate(deadlocked, validate=False)




def test_window_bubble_shows_what_zb_h2_adds_over_zb_h1():
    """Equal costs, p=4, m=8: one step of zb-h1 and zb-h2 lasts as long (3m + p - 1), but
    zb-h2 leaves no gap inside any rank's own window (its parallelogram)."""
    from megatron_pp_ext.schedules import build_schedule

    costs = CostModel(t_f=1, t_i=1, t_w=1)
    h1 = simulate(build_schedule("zb-h1", 4, 8), costs)
    h2 = simulate(build_schedule("zb-h2", 4, 8), costs)
    one_f_one_b = simulate(build_schedule("1f1b", 4, 8), costs)
    assert h1.makespan == h2.makespan == 27 and one_f_one_b.makespan == 33
    assert h2.window_bubble_fraction == 0.0
    assert h1.window_bubble_fraction == pytest.approx(6 / 102)
    assert one_f_one_b.window_bubble_fraction == pytest.approx(18 / 114)


def test_per_action_overhead_charges_schedules_with_more_actions_more():
    """t_overhead is added to every F, B and I (not W): 1F1B at p=4, m=8 has 22 of them on
    its critical path."""
    from megatron_pp_ext.schedules import build_schedule

    base = CostModel(t_f=1, t_i=1, t_w=1)
    with_overhead = CostModel(t_f=1, t_i=1, t_w=1, t_overhead=0.1)
    one_f_one_b = build_schedule("1f1b", 4, 8)
    assert simulate(one_f_one_b, base).makespan == 33
    assert simulate(one_f_one_b, with_overhead).makespan == pytest.approx(33 + 0.1 * 22)
    zb_h1 = build_schedule("zb-h1", 4, 8)
    # W actions carry no overhead: only the F and I actions on the critical path grow
    assert simulate(zb_h1, with_overhead).makespan < 27 + 0.1 * 27


# ---------------------------------------------------------------- the command line
def simulate_cli(*args, cwd=None):
    """``simulate`` in this process (support.cli_run)."""
    from support.cli_run import cli_in_process

    return cli_in_process("simulate", *args, cwd=cwd or Path(__file__).resolve().parents[1])


def test_cli_default_costs_v_schedules_and_interleaved_beat_1f1b():
    import json

    got = {}
    for name in ("1f1b", "zb-v", "interleaved", "dualpipev"):
        done = simulate_cli("--schedule", name, "-p", "4", "-m", "8", "--format", "json")
        assert done.returncode == 0 and done.stderr == "", done.stderr
        got[name] = json.loads(done.stdout)
    assert got["zb-v"]["makespan"] < got["1f1b"]["makespan"]
    assert got["interleaved"]["makespan"] < got["1f1b"]["makespan"]
    assert (got["1f1b"]["makespan"], got["zb-v"]["makespan"], got["interleaved"]["makespan"],
            got["dualpipev"]["makespan"]) == (33, 25.5, 28.5, 25.5)
    # peaks in one unit (v=1 activations), the chunk counts beside them
    assert got["1f1b"]["peak_activations"] == [4, 3, 2, 1]
    assert got["zb-v"]["peak_activations"] == [4, 4, 4, 4]
    assert got["zb-v"]["peak_chunk_activations"] == [8, 8, 8, 8]
    assert got["interleaved"]["peak_activations"] == [5.5, 4.5, 3.5, 2.5]
    assert "v=1 units" in got["zb-v"]["activation_unit"]
    assert got["zb-v"]["unit"] == "t" and got["zb-v"]["costs"]["per"] == "rank"


def test_cli_ascii_labels_chunk_peaks_and_out_says_wrote(tmp_path):
    done = simulate_cli("--schedule", "zb-v", "-p", "4", "-m", "8")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == (
        "peak activations per rank: [8, 8, 8, 8] chunk-activations (1/2 of a rank's layers "
        "each) = [4, 4, 4, 4] in v=1 units (one microbatch, all of a rank's layers)")
    target = tmp_path / "zbv.txt"
    done = simulate_cli("--schedule", "zb-v", "-p", "4", "-m", "8", "--out", str(target))
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"wrote {target}\n"
    assert target.read_text().startswith("zb-v p=4 m=8 v=2 (predicted)")


def test_cli_hint_when_p_exceeds_m():
    done = simulate_cli("--schedule", "1f1b", "-p", "8", "-m", "4")
    assert done.returncode == 0
    assert done.stderr == ("hint: p=8 > m=4: most ranks idle most of the step; use m >= p "
                           "(Megatron needs m >= p for interleaved)\n")
    assert simulate_cli("--schedule", "1f1b", "-p", "4", "-m", "4").stderr == ""


def test_cli_whole_backward_costs_refuse_split_schedules_or_take_an_assumption():
    import json

    refused = simulate_cli("--schedule", "zb-h1", "-p", "4", "-m", "8", "--t-f", "2",
                           "--t-b", "4")
    assert refused.returncode == 2 and refused.stdout == ""
    assert refused.stderr.startswith("error: zb-h1 splits the backward into I")
    assumed = simulate_cli("--schedule", "zb-h1", "-p", "4", "-m", "8", "--t-f", "2",
                           "--t-b", "4", "--assume-split", "0.25", "--format", "json")
    assert assumed.returncode == 0, assumed.stderr
    explicit = simulate(build_schedule("zb-h1", 4, 8), CostModel(t_f=2, t_i=1, t_w=3))
    assert json.loads(assumed.stdout)["makespan"] == explicit.makespan
