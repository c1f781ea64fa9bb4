"""The simulator's NCCL communication model: the lowered program timed under NCCL's rules."""

from __future__ import annotations

import random

import pytest

from megatron_pp_ext.analysis.nccl_rules import check_nccl_rules
from megatron_pp_ext.analysis.nccl_timing import time_program, unit_cost_makespans
from megatron_pp_ext.analysis.simulate import CostModel, action_durations, simulate
from megatron_pp_ext.analysis.lowering import lower, nccl_post_ahead, nccl_program
from megatron_pp_ext.ir import ScheduleError
from megatron_pp_ext.schedules import build_schedule
from megatron_pp_ext.timeline import COMM_WAIT, COMPUTE, P2P

BUILT_IN = [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1), ("zb-h2", 1),
            ("zb-v", 2), ("dualpipev", 2)]


def _events(timeline, category):
    return [(e.rank, e.label, e.start, e.end) for e in timeline.events if e.category == category]


def test_gpipe_p2_m2_by_hand():
    """Worked out by hand from Megatron's fused calls (``lower``, no receive posted ahead):
    rank 0's send_forward_recv_backward holds its host until rank 1 sends 0B0, which rank 1
    posts only after 1B0; and each send waits for its receive to be posted (rendezvous)."""
    schedule = build_schedule("gpipe", 2, 2)
    costs = CostModel(t_f=1, t_b=2, t_comm=0.5)
    timeline = time_program(lower(schedule), schedule, action_durations(costs.per_stage(
        schedule)), [0.5, 0.5], [2, 2])
    assert _events(timeline, COMPUTE) == [
        (0, "0F0", 0.0, 1.0), (0, "0F1", 1.0, 2.0),
        (0, "0B0", 6.5, 8.5),  # 0B0's gradient: rank 1 posts it at 6.0 (after 1B0), +0.5
        (0, "0B1", 9.0, 11.0),  # rank 0 posts its receive at 8.5 (after 0B0), +0.5
        (1, "1F0", 1.5, 2.5),  # rank 0 posts the send at 1.0 (after 0F0), +0.5
        (1, "1F1", 3.0, 4.0),  # rank 1 posts the receive at 2.5 (after 1F0), +0.5
        (1, "1B0", 4.0, 6.0), (1, "1B1", 6.0, 8.0),
    ]
    assert _events(timeline, P2P) == [
        (0, "#0 send_forward", 1.0, 1.5),
        (0, "#1 send_forward_recv_backward", 2.0, 6.5),
        (0, "#2 recv_backward", 8.5, 9.0),
        (1, "#0 recv_forward", 0.0, 1.5),
        (1, "#1 recv_forward", 2.5, 3.0),
        (1, "#2 send_backward", 6.0, 6.5),
        (1, "#3 send_backward", 8.0, 9.0),  # rank 0's receive runs from 8.5
    ]
    assert timeline.makespan == 11.0
    # The buffered model lets 0B1's gradient leave at 8.0 and land at 8.5, and 1F1's at 2.0:
    assert simulate(schedule, CostModel(t_f=1, t_b=2, t_comm=0.5)).makespan == 10.0


@pytest.mark.parametrize("name,chunks", BUILT_IN)
def test_never_faster_than_buffered_and_streams_serial(name, chunks):
    """NCCL's rules only add constraints to the buffered model (a message still leaves after
    its producer ends and takes t_comm), so no step is shorter; each rank's batches run one
    at a time, in posting order, and its host runs one thing at a time."""
    rng = random.Random(f"{name}")
    for p in range(1, 5):
        for m in range(1, 9):
            try:
                schedule = build_schedule(name, p, m, chunks)
            except ValueError:
                continue  # a (p, m) the schedule does not allow (interleaved)
            costs = CostModel(t_f=[rng.uniform(0.5, 2) for _ in range(p)],
                              t_i=[rng.uniform(0.5, 2) for _ in range(p)],
                              t_w=[rng.uniform(0.5, 2) for _ in range(p)],
                              t_comm=rng.uniform(0, 0.5))
            nccl = simulate(schedule, costs, communication="nccl")
            buffered = simulate(schedule, costs)
            assert nccl.makespan >= buffered.makespan - 1e-9, (name, p, m)
            for rank in range(p):
                for category in (P2P, None):
                    spans = sorted(
                        (e.start, e.end) for e in nccl.events if e.rank == rank and (
                            e.category == P2P if category else e.category in (COMPUTE,
                                                                              COMM_WAIT)))
                    assert all(a[1] <= b[0] + 1e-9 for a, b in zip(spans, spans[1:])), (
                        name, p, m, rank, category)
                assert [e.label for e in nccl.compute_events(rank)] == [
                    str(a) for a in schedule.actions[rank]]


def test_lockstep_posting_costs_dualpipev_time_even_without_transfer_time():
    """DualPipeV's NCCL program posts in lockstep rounds (its fused calls could hang): a round
    waits for its slowest member, which the buffered model does not see."""
    schedule = build_schedule("dualpipev", 4, 8)
    costs = CostModel(t_f=1, t_i=1, t_w=1, t_comm=0)
    buffered = simulate(schedule, costs).makespan
    assert simulate(schedule, costs, communication="nccl").makespan > buffered * 1.1


def test_unknown_communication_model():
    with pytest.raises(ValueError, match="communication='shared-memory': choose 'buffered'"):
        simulate(build_schedule("1f1b", 2, 2), communication="shared-memory")


def test_receives_posted_ahead_where_proven_and_faster():
    """GPipe's next receive goes out before the current forward computes (its transfer
    overlaps the compute); 1F1B's receives are all fused with sends, so nothing changes."""
    gpipe = build_schedule("gpipe", 2, 3)
    assert nccl_post_ahead(gpipe) and not nccl_post_ahead(build_schedule("1f1b", 4, 8))
    assert nccl_program(gpipe).text(1).splitlines()[:6] == [
        "post #0 [recv forward 1F0 <- 0]", "wait #0",
        "post #1 [recv forward 1F1 <- 0]", "1F0",  # posted ahead of 1F0
        "wait #1", "post #2 [recv forward 1F2 <- 0]"]
    assert lower(gpipe).text(1).splitlines()[:4] == [
        "post #0 [recv forward 1F0 <- 0]", "wait #0", "1F0", "post #1 [recv forward 1F1 <- 0]"]
    costs = CostModel(t_f=1, t_b=2, t_comm=0.5)
    # rank 1's receive of 1F1 runs during 1F0: 1F1 starts as 1F0 ends, not 0.5 later
    ahead = simulate(gpipe, costs, communication="nccl")
    assert [(e.label, e.start) for e in ahead.compute_events(1)][:2] == [("1F0", 1.5),
                                                                        ("1F1", 2.5)]
    plain = time_program(lower(gpipe), gpipe, action_durations(costs.per_stage(gpipe)),
                         [0.5, 0.5], ahead.peak_activations)
    assert [(e.label, e.start) for e in plain.compute_events(1)][:2] == [("1F0", 1.5),
                                                                        ("1F1", 3.0)]
    assert ahead.makespan < plain.makespan


def test_simulate_command_draws_the_batches(capsys):
    from megatron_pp_ext.cli import main

    assert main(["simulate", "--schedule", "dualpipev", "-p", "2", "-m", "4", "--t-comm",
                 "0.2", "--communication", "nccl"]) == 0
    out = capsys.readouterr().out
    timeline = simulate(build_schedule("dualpipev", 2, 4),
                        CostModel(t_f=1, t_i=1, t_w=1, t_comm=0.2), communication="nccl")
    assert f"makespan={timeline.makespan:g}" in out
    rows = [line.split("|")[0].strip() for line in out.splitlines() if "|" in line]
    assert rows[:4] == ["r0", "r0 p2p", "r1", "r1 p2p"]


@pytest.mark.parametrize("name,chunks", BUILT_IN)
def test_one_play_times_every_message_time_as_a_play_of_its_own(name, chunks):
    """The lowering compares postings at several message times from one play with a clock
    per message time (``unit_cost_makespans``): each step time equals the timeline's that
    ``time_program`` plays alone at that message time, and they differ, so no clock reads
    another's state."""
    schedule = build_schedule(name, 4, 8, chunks)
    program = nccl_program(schedule)
    stages = schedule.num_stages
    unit = {"F": [1.0] * stages, "B": [2.0] * stages, "I": [1.0] * stages,
            "W": [1.0] * stages}
    probes = (0.0, 0.3, 0.5, 1.0)
    alone = [time_program(program, schedule, unit, [t] * stages, [1] * 4).makespan
             for t in probes]
    assert unit_cost_makespans(program, schedule, probes, check=True) == alone
    assert len(set(alone)) == len(probes)


def test_the_timed_play_checks_nccls_rules_as_the_check_does():
    """Timed with ``check``, a program that can hang raises what ``check_nccl_rules`` raises
    (the ranks, the pending ops and the cycle), from the same play."""
    schedule = build_schedule("zb-v", 4, 8, 2)
    program = lower(schedule)  # Megatron's fused calls, which can hang on zb-v
    with pytest.raises(ScheduleError) as want:
        check_nccl_rules(program)
    with pytest.raises(ScheduleError) as got:
        unit_cost_makespans(program, schedule, (0.5, 1.0), check=True)
    assert str(got.value) == str(want.value)
    assert "cycle: rank" in str(want.value)
