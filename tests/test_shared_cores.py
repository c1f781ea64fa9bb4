"""Ranks sharing fewer cores than there are ranks (analysis/shared_cores.py): the work a
measured action did, and the prediction with the cores shared, against hand-worked steps and
against the simulator where every rank has a core; and the train job's count of the cores
its ranks share (the last test imports train.measure, with torch)."""

import pytest

from megatron_pp_ext.analysis.measured import calibrated_costs, predicted_timeline
from megatron_pp_ext.analysis.shared_cores import (alone_on_a_core, core_share,
                                                   simulate_shared_cores, wake_delay)
from megatron_pp_ext.analysis.simulate import CostModel, simulate
from megatron_pp_ext.schedules import build_schedule
from megatron_pp_ext.timeline import COMPUTE


def _compute(timeline):
    return sorted((e.rank, e.label, e.start, e.end) for e in timeline.events
                  if e.category == COMPUTE)


def test_two_ranks_on_one_core_take_turns_as_worked_by_hand():
    """1F1B, p=2, m=2, t_F=1, t_B=2, one core: F1 on rank 0 and F0 on rank 1 run together at
    half speed (1 -> 3), B0 of stage 0 shares with F1 then B1 of stage 1 (5 -> 9): 12 t, the
    24 t of work spread over one core, a quarter of it idle."""
    schedule = build_schedule("1f1b", 2, 2)
    costs = CostModel(t_f=1.0, t_b=2.0, t_i=1.0, t_w=1.0, t_comm=0.0)
    shared = simulate_shared_cores(schedule, costs, cores=1)
    assert _compute(shared) == [
        (0, "0B0", 5.0, 9.0), (0, "0B1", 10.0, 12.0), (0, "0F0", 0.0, 1.0), (0, "0F1", 1.0, 3.0),
        (1, "1B0", 3.0, 5.0), (1, "1B1", 7.0, 10.0), (1, "1F0", 1.0, 3.0), (1, "1F1", 5.0, 7.0)]
    assert shared.makespan == 12.0 and shared.bubble_fraction == pytest.approx(0.25)
    # a core each: the simulator's buffered step exactly
    assert simulate(schedule, costs).makespan == 9.0
    assert simulate_shared_cores(schedule, costs, cores=2).makespan == 9.0


@pytest.mark.parametrize("name, p, m", [("1f1b", 4, 8), ("zb-v", 4, 8), ("interleaved", 4, 8),
                                         ("dualpipev", 4, 8)])
def test_a_core_per_rank_is_the_simulators_prediction(name, p, m):
    v = 1 if name == "1f1b" else 2
    schedule = build_schedule(name, p, m, v)
    stages = schedule.num_stages
    costs = CostModel(t_f=[1.0 + 0.1 * s for s in range(stages)], t_i=1.3, t_w=0.7,
                      t_b=2.0, t_comm=0.05)
    alone = simulate(schedule, costs, validate=False)
    shared = simulate_shared_cores(schedule, costs, cores=p)
    assert [(r, lab) for r, lab, *_ in _compute(shared)] == [
        (r, lab) for r, lab, *_ in _compute(alone)]
    assert [t for x in _compute(shared) for t in x[2:]] == pytest.approx(
        [t for x in _compute(alone) for t in x[2:]])


def test_the_work_of_a_measured_action_is_its_share_of_the_cores():
    """Measured with two ranks on one core, each action of the hand-worked step did its cost:
    the uncontended timeline's means give back t_F = 1 and t_B = 2 on every stage."""
    schedule = build_schedule("1f1b", 2, 2)
    costs = CostModel(t_f=1.0, t_b=2.0, t_i=1.0, t_w=1.0, t_comm=0.0)
    measured = simulate_shared_cores(schedule, costs, cores=1)
    alone = calibrated_costs(alone_on_a_core(measured, 1)[0], schedule, 0.0)
    assert alone.t_f == pytest.approx([1.0, 1.0]) and alone.t_b == pytest.approx([2.0, 2.0])
    # taken as they were measured, the costs carry the contention: F up to 2 t
    as_measured = calibrated_costs(measured, schedule, 0.0)
    assert as_measured.t_f == pytest.approx([1.5, 2.0])


@pytest.mark.parametrize("name, v", [("1f1b", 1), ("zb-v", 2), ("interleaved", 2)])
def test_the_prediction_from_a_shared_machine_reproduces_its_step(name, v):
    """p=4, m=8 on 2 cores: predicted from its own measured step with the cores shared, the
    step comes back (bubble and makespan); priced at the measured means as if each rank had a
    core, 1F1B's bubble is 8 points off (27.6% against 19.1%)."""
    schedule = build_schedule(name, 4, 8, v)
    costs = CostModel(t_f=1.0, t_i=1.0, t_w=1.0, t_b=2.0, t_comm=0.0)
    measured = simulate_shared_cores(schedule, costs, cores=2)
    again = predicted_timeline(measured, schedule, t_comm=0.0, cores=2, woken_wait=0.0)
    assert again.makespan == pytest.approx(measured.makespan)
    assert again.bubble_fraction == pytest.approx(measured.bubble_fraction)
    if name == "1f1b":
        naive = predicted_timeline(measured, schedule, t_comm=0.0)
        assert measured.bubble_fraction == pytest.approx(13 / 68)
        assert naive.bubble_fraction - measured.bubble_fraction > 0.08


def test_the_hosts_time_between_actions_is_taken_back_as_overhead():
    """Simulated with 0.3 t of host work before each F, B and I (shared like the compute,
    outside the compute events, as the measured step shows it), 1F1B p=4, m=8 on 2 cores gives
    the overhead back per rank, and its prediction reproduces the step."""
    schedule = build_schedule("1f1b", 4, 8)
    costs = CostModel(t_f=1.0, t_b=2.0, t_i=1.0, t_w=1.0, t_comm=0.0, t_overhead=0.3)
    measured = simulate_shared_cores(schedule, costs, cores=2)
    assert alone_on_a_core(measured, 2)[1] == pytest.approx([0.3] * 4)
    again = predicted_timeline(measured, schedule, t_comm=0.0, cores=2, woken_wait=0.0)
    assert again.makespan == pytest.approx(measured.makespan)
    assert again.bubble_fraction == pytest.approx(measured.bubble_fraction)
    plain = simulate_shared_cores(schedule, CostModel(t_f=1.0, t_b=2.0, t_comm=0.0), cores=2)
    assert measured.bubble_fraction > plain.bubble_fraction + 0.05  # the host's time is idle


def test_a_rank_woken_while_the_cores_are_taken_waits_idle():
    """Half of Linux's base slice (0.75 ms x (1 + log2 CPUs, at most 8)); 1F1B p=4, m=8 on
    2 cores, a woken rank waiting 0.5 t for a core: the ranks that wait show it as idle (the
    bubble rises), and where a core is free nobody waits (on 4 cores: the same step)."""
    assert [wake_delay(c) for c in (1, 2, 3, 4, 8, 64)] == pytest.approx(
        [0.000375, 0.00075, 0.00075, 0.001125, 0.0015, 0.0015])
    schedule = build_schedule("1f1b", 4, 8)
    costs = CostModel(t_f=1.0, t_b=2.0, t_comm=0.0)
    plain, waiting = (simulate_shared_cores(schedule, costs, cores=2, woken_wait=w)
                      for w in (0.0, 0.5))
    assert waiting.bubble_fraction > plain.bubble_fraction + 0.01
    assert simulate_shared_cores(schedule, costs, cores=4, woken_wait=0.5).events == \
        simulate_shared_cores(schedule, costs, cores=4).events


def test_core_share_and_bad_input():
    assert [core_share(k, 2) for k in (0, 1, 2, 3, 4)] == [1.0, 1.0, 1.0, 2 / 3, 0.5]
    with pytest.raises(ValueError, match="cores=0"):
        simulate_shared_cores(build_schedule("1f1b", 2, 2), CostModel(), cores=0)


def test_pipeline_cores_counts_the_machine_the_ranks_share(monkeypatch):
    from megatron_pp_ext.train.measure import pipeline_cores

    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert pipeline_cores("cpu", 4, 4) == 2.0
    assert pipeline_cores("cpu", 4, 2) == 1.0  # two data-parallel pipelines split the cores
    assert pipeline_cores("cuda", 4, 4) is None
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert pipeline_cores("cpu", 4, 4) is None  # ranks on another machine too
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert pipeline_cores("cpu", 2, 2) is None  # a core each
