"""PipeDream (weight stashing, vertical sync) and PipeDream-2BW: schedules of the same IR, run
by the same executor on the in-memory transport with toy stages; their semantics proven."""

from __future__ import annotations

import pytest
import torch

from megatron_pp_ext.schedules.validate import validate_schedule
from megatron_pp_ext.ir import Schedule, ScheduleError
from megatron_pp_ext.runtime.weight_versions import plan_versions
from megatron_pp_ext.schedules import (
    REGISTRY,
    build_async_schedule,
    build_schedule,
    canonical_name,
    is_async_schedule,
)
from support.pipedream import final_weights, reference_2bw, reference_pipedream, run_async

SIZES = [(2, 2, 3), (3, 4, 2), (4, 4, 3), (4, 6, 2)]  # (p, m, steps)
# PipeDream also runs m < p (its updates are per microbatch) and p = 1 (plain SGD)
PIPEDREAM_SIZES = SIZES + [(4, 2, 3), (1, 3, 2)]


def _versions(results):
    got = {}
    for _result, work in results:
        got.update(work.versions_of())
    return got


def _losses(results):
    losses = {}
    for _result, work in results:
        losses.update(work.losses)
    return [losses[j] for j in sorted(losses)]


# ------------------------------------------------------------------------------- the IR
@pytest.mark.parametrize("name", ["pipedream", "pipedream-2bw"])
def test_builders_validate_and_span_steps_without_flush(name):
    schedule = build_async_schedule(name, 4, 4, steps=3)
    validate_schedule(schedule)
    assert schedule.num_microbatches == 12 and schedule.options["steps"] == 3
    # one 1F1B list over all 12 microbatches: rank 0's first backward comes after 4 forwards
    # and the steady state crosses the batch boundaries with no drain in between
    row = [str(a) for a in schedule.actions[0]]
    assert row[:5] == ["0F0", "0F1", "0F2", "0F3", "0B0"]
    assert row.index("0F4") < row.index("0B3") and row.index("0F8") < row.index("0B7")
    # the JSON form keeps the update rule; the CSV is a plain action list
    again = Schedule.from_json(schedule.to_json())
    assert again.options["weight_update"] == schedule.options["weight_update"]
    assert Schedule.from_csv(schedule.to_csv()).text() == schedule.text()


def test_async_schedules_are_opt_in():
    assert "pipedream" not in REGISTRY and "pipedream-2bw" not in REGISTRY
    assert is_async_schedule("PipeDream") and is_async_schedule("pipedream-2bw")
    for name in ("pipedream", "pipedream-2bw"):
        with pytest.raises(ScheduleError, match="asynchronous.*forward_backward_func"):
            canonical_name(name)
        with pytest.raises(ScheduleError, match="asynchronous"):
            build_schedule(name, 4, 8)


def test_the_drop_in_refuses_them_with_the_supported_way():
    from megatron_pp_ext.integration.options import PipelineOptions

    for name in ("pipedream", "PipeDream-2BW"):
        with pytest.raises(ScheduleError, match=r"flushes every step.*AsyncPipeline.*train "
                           r"--schedule pipedream"):
            PipelineOptions(schedule=name)


def test_2bw_needs_m_at_least_p():
    with pytest.raises(ScheduleError, match=r"m=3 .* >= p=4"):
        build_async_schedule("pipedream-2bw", 4, 3)


def test_plan_counts_the_papers_versions():
    p = 4
    stash = plan_versions(build_async_schedule("pipedream", p, 8, steps=2))
    assert stash.max_held == [p - r for r in range(p)]
    assert stash.max_in_flight == [p - r for r in range(p)]
    vsync = plan_versions(build_async_schedule("pipedream", p, 8, steps=2, vertical_sync=True))
    assert vsync.max_in_flight == [p - r for r in range(p)]
    # every stage keeps each version from its first use (by the microbatch entering after it
    # was made on stage 0) to its newest: p versions on every rank
    assert vsync.max_held == [p] * p
    two = plan_versions(build_async_schedule("pipedream-2bw", p, 4, steps=4))
    assert two.max_held == [2] * p
    # the last stage has one microbatch in flight at a time
    assert two.max_in_flight == [min(2, p - r) for r in range(p)]


# ------------------------------------------------------------------------ semantics in a run
@pytest.mark.parametrize("p,m,steps", PIPEDREAM_SIZES)
def test_stashing_f_and_b_use_the_same_version(p, m, steps):
    schedule = build_async_schedule("pipedream", p, m, steps=steps)
    results = run_async(schedule)
    versions = _versions(results)
    total = m * steps
    for s in range(p):
        for j in range(total):
            assert versions[(s, j, "F")] == versions[(s, j, "B")], (s, j)
            # the stage's newest version at its forward: one update per earlier backward
            assert versions[(s, j, "F")] == max(j - (p - 1 - s), 0), (s, j)
    for rank, (_result, work) in enumerate(results):
        assert work.max_versions_held() <= p - rank
        assert work.max_in_flight <= p - rank
        assert work.updates == total


@pytest.mark.parametrize("p,m,steps", PIPEDREAM_SIZES)
def test_vertical_sync_every_stage_uses_the_entry_version(p, m, steps):
    schedule = build_async_schedule("pipedream", p, m, steps=steps, vertical_sync=True)
    results = run_async(schedule)
    versions = _versions(results)
    plan = plan_versions(schedule)
    for j in range(m * steps):
        entered = versions[(0, j, "F")]
        assert entered == max(j - (p - 1), 0)
        for s in range(p):
            assert versions[(s, j, "F")] == versions[(s, j, "B")] == entered, (s, j)
    for rank, (_result, work) in enumerate(results):
        assert work.max_in_flight <= p - rank
        assert work.max_versions_held() == plan.max_held[rank] <= p


@pytest.mark.parametrize("p,m,steps", SIZES)
def test_2bw_two_versions_one_batch_late(p, m, steps):
    schedule = build_async_schedule("pipedream-2bw", p, m, steps=steps)
    results = run_async(schedule)
    versions = _versions(results)
    for s in range(p):
        for j in range(m * steps):
            assert versions[(s, j, "F")] == versions[(s, j, "B")] == max(j // m - 1, 0)
    for _result, work in results:
        assert work.max_versions_held() <= 2
        assert work.updates == steps


@pytest.mark.parametrize("p,m,steps", PIPEDREAM_SIZES)
@pytest.mark.parametrize("vertical_sync", [False, True])
def test_pipedream_weights_equal_the_papers_update_rule(p, m, steps, vertical_sync):
    schedule = build_async_schedule("pipedream", p, m, steps=steps, vertical_sync=vertical_sync)
    results = run_async(schedule)
    want, want_losses = reference_pipedream(p, m * steps, vertical_sync)
    got = final_weights(results)
    for s in range(p):
        torch.testing.assert_close(got[s], want[s], rtol=1e-12, atol=1e-12)
    assert _losses(results) == pytest.approx(want_losses, rel=1e-12, abs=1e-12)


@pytest.mark.parametrize("p,m,steps", SIZES)
def test_2bw_weights_equal_the_papers_update_rule(p, m, steps):
    schedule = build_async_schedule("pipedream-2bw", p, m, steps=steps)
    results = run_async(schedule)
    want, want_losses = reference_2bw(p, m, steps)
    got = final_weights(results)
    for s in range(p):
        torch.testing.assert_close(got[s], want[s], rtol=1e-12, atol=1e-12)
    assert _losses(results) == pytest.approx(want_losses, rel=1e-12, abs=1e-12)


def test_the_references_differ_from_each_other():
    """The checks above can tell the rules apart: stashing, vertical sync and a flushed
    (synchronous) update give different weights on the same data."""
    p, total = 4, 8
    stash, _ = reference_pipedream(p, total)
    vsync, _ = reference_pipedream(p, total, vertical_sync=True)
    assert not torch.allclose(stash[1], vsync[1])
    results = run_async(build_async_schedule("pipedream", p, total, steps=1))
    got = final_weights(results)
    assert torch.allclose(got[1], stash[1]) and not torch.allclose(got[1], vsync[1])


def test_adam_updates_each_stage_with_its_own_parameters():
    schedule = build_async_schedule("pipedream-2bw", 2, 2, steps=3)
    results = run_async(schedule, optimizer="adam", lr=0.01)
    for _result, work in results:
        (stage,) = work.modules
        state = work.optimizer.state[work.modules[stage].weight]
        assert int(state["step"]) == 3  # one Adam step per batch on this stage


# ------------------------------------------------------------------------------ the simulator
@pytest.mark.parametrize("name", ["pipedream", "pipedream-2bw"])
def test_simulated_steady_state_has_no_bubble(name):
    from megatron_pp_ext.analysis.render import render_ascii
    from megatron_pp_ext.analysis.simulate import CostModel, async_steady_state

    p, m = 4, 8
    state = async_steady_state(name, p, m, CostModel(t_f=1, t_b=2))
    assert state.per_microbatch == pytest.approx(3.0) == state.floor  # F + B, nothing idle
    assert state.flushed_1f1b == pytest.approx(33 / 8)  # (m + p - 1) (F + B) / m
    assert state.versions_held == ([p - r for r in range(p)] if name == "pipedream"
                                   else [2] * p)
    # the drawing is the whole run: 4 batches of 8 microbatches, one fill and one drain
    assert state.makespan == pytest.approx(3 * (4 * m + p - 1))
    text = render_ascii(state.timeline)
    assert "0F31" in text and "3B31" in text
    slow = async_steady_state(name, p, m, CostModel(t_f=1, t_b=2, t_comm=0.5))
    assert state.floor < slow.per_microbatch < slow.flushed_1f1b


def test_an_async_schedule_file_is_refused_by_the_drop_in_loader(tmp_path):
    from megatron_pp_ext.schedules import load_schedule_file

    path = tmp_path / "pd.json"
    path.write_text(build_async_schedule("pipedream-2bw", 2, 2, steps=2).to_json())
    with pytest.raises(ScheduleError, match="asynchronous .*AsyncPipeline"):
        load_schedule_file(str(path))


def test_install_and_megatron_arguments_refuse_them_before_patching():
    import argparse

    import megatron_pp_ext
    from megatron_pp_ext.integration.megatron_args import _schedule_value

    with pytest.raises(ScheduleError, match="flushes every step"):
        megatron_pp_ext.install(schedule="pipedream")
    from megatron.core.pipeline_parallel import schedules as megatron_schedules

    assert megatron_schedules.get_forward_backward_func.__module__ == \
        "megatron.core.pipeline_parallel.schedules"  # not patched
    with pytest.raises(argparse.ArgumentTypeError, match="asynchronous"):
        _schedule_value("pipedream-2bw")


def test_simulate_command_draws_the_asynchronous_run(capsys):
    from megatron_pp_ext.analysis.simulate import async_steady_state
    from megatron_pp_ext.cli import main

    assert main(["simulate", "--schedule", "PipeDream", "-p", "4", "-m", "4"]) == 0
    out = capsys.readouterr().out.splitlines()
    steady = async_steady_state("pipedream", 4, 4)
    assert out[-1] == (f"steady state: {steady.per_microbatch:g} t per microbatch (floor "
                       f"{steady.floor:g}, flushed 1f1b {steady.flushed_1f1b:g}); weight "
                       "versions held per rank [4, 3, 2, 1] (count); the run: 4 batches of "
                       "m=4, never flushed")
    assert steady.per_microbatch == steady.floor == 3 < steady.flushed_1f1b
    assert [line.split("|")[0].strip() for line in out if "|" in line] == ["r0", "r1", "r2", "r3"]
