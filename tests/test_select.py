"""Schedule selection: ranking by predicted step time under a per-rank memory budget."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_pp_ext.analysis.select import MiB, chunk_costs, select_schedules
from megatron_pp_ext.analysis.simulate import CostModel, simulate
from megatron_pp_ext.schedules import build_schedule

ROOT = Path(__file__).resolve().parents[1]
EQUAL = CostModel(t_f=1, t_i=1, t_w=1)


def names(entries):
    return [(e.name, e.chunks) for e in entries]


def test_tight_budget_excludes_gpipe_and_zb_h2_with_their_numbers():
    selection = select_schedules(4, 8, EQUAL, activation_bytes=64 * MiB,
                                 memory_budget_bytes=256 * MiB)
    reasons = {(e.name, e.chunks): e.reason for e in selection.excluded}
    assert reasons[("gpipe", 1)] == (
        "peak 8 x 64 MiB = 512 MiB on rank 0 exceeds the 256 MiB budget")
    assert reasons[("zb-h2", 1)] == (
        "peak 7 x 64 MiB = 448 MiB on rank 0 exceeds the 256 MiB budget")
    assert reasons[("interleaved", 2)] == (
        "peak 11 x 32 MiB chunk-activations (1/2 of 64 MiB) = 352 MiB on rank 0 exceeds the "
        "256 MiB budget")
    # 1F1B holds p - r = 4 activations on rank 0: exactly the budget, which fits.
    assert names(selection.ranked) == [("zb-v", 2), ("zb-h1", 1), ("1f1b", 1)]
    assert [r.peak_bytes for r in selection.ranked] == [256 * MiB] * 3


def test_loose_budget_equal_costs_the_winner_is_zero_bubble():
    selection = select_schedules(4, 8, EQUAL, activation_bytes=1 * MiB,
                                 memory_budget_bytes=1024 * MiB)
    assert selection.excluded == []
    best = selection.best
    assert best.name in ("zb-h1", "zb-h2", "zb-v", "dualpipev")
    one_f_one_b = next(r for r in selection.ranked if r.name == "1f1b")
    assert one_f_one_b.makespan == pytest.approx(3 * (8 + 4 - 1))  # (m + p - 1)(t_F + t_B)
    assert best.makespan < 0.8 * one_f_one_b.makespan
    assert best.bubble < one_f_one_b.bubble


def test_ranking_is_by_predicted_makespan_of_chunk_costs():
    costs = CostModel(t_f=2, t_i=1.5, t_w=1, t_comm=0.1)
    selection = select_schedules(4, 8, costs, activation_bytes=MiB,
                                 memory_budget_bytes=1e12)
    spans = [r.makespan for r in selection.ranked]
    assert spans == sorted(spans)
    for r in selection.ranked:  # each figure is the simulator's, with 1/v chunk costs
        timeline = simulate(build_schedule(r.name, 4, 8, r.chunks), chunk_costs(costs, r.chunks))
        assert r.makespan == pytest.approx(timeline.makespan)
        assert r.bubble == pytest.approx(timeline.bubble_fraction)
        # the same total work on every rank whatever v: m x (t_F + t_I + t_W) per rank
        assert timeline.busy(0) == pytest.approx(8 * 4.5)


def test_interleaved_needs_m_at_least_p_and_says_so():
    selection = select_schedules(4, 2, EQUAL, activation_bytes=MiB,
                                 memory_budget_bytes=1e12, chunks_options=(2, 4))
    reasons = {(e.name, e.chunks): e.reason for e in selection.excluded}
    assert set(reasons) == {("interleaved", 2), ("interleaved", 4)}
    assert "use m >= p microbatches" in reasons[("interleaved", 2)]
    assert ("interleaved", 2) not in names(selection.ranked)
    assert ("1f1b", 1) in names(selection.ranked)


def test_candidates_and_per_rank_costs():
    scalar = select_schedules(4, 8, EQUAL, MiB, 1e12, candidates=["1f1b", ("zb-v", 2)])
    listed = select_schedules(4, 8, CostModel(t_f=[1] * 4, t_i=[1] * 4, t_w=[1] * 4), MiB,
                              1e12, candidates=["1f1b", ("zb-v", 2)])
    assert names(scalar.ranked) == [("zb-v", 2), ("1f1b", 1)]
    assert [r.makespan for r in listed.ranked] == [r.makespan for r in scalar.ranked]
    slow_last = select_schedules(4, 8, CostModel(t_f=[1, 1, 1, 2], t_i=1, t_w=1), MiB, 1e12,
                                 candidates=["1f1b"])
    assert slow_last.best.makespan > scalar.ranked[1].makespan
    with pytest.raises(ValueError, match="one number >= 0 per rank"):
        select_schedules(4, 8, CostModel(t_f=[1, 2]), MiB, 1e12)
    with pytest.raises(ValueError, match="unknown schedule 'zb-h3'"):
        select_schedules(4, 8, EQUAL, MiB, 1e12, candidates=["zb-h3"])


def test_nothing_fits():
    selection = select_schedules(4, 8, EQUAL, activation_bytes=64 * MiB,
                                 memory_budget_bytes=32 * MiB)
    assert selection.ranked == [] and selection.best is None
    assert len(selection.excluded) == 9  # 6 schedules + interleaved at v = 2, 3, 4


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "megatron_pp_ext", "select", *args],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)


def test_cli_json_and_text():
    args = ["--ranks", "4", "--microbatches", "8", "--t-f", "20", "--t-i", "20", "--t-w", "20",
            "--t-comm", "0.5", "--activation-mb", "64", "--memory-budget-mb", "256"]
    done = run_cli(*args, "--format", "json")
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert [(r["name"], r["chunks"]) for r in data["ranked"]] == [
        ("zb-v", 2), ("zb-h1", 1), ("1f1b", 1)]
    assert data["ranked"][2]["peak_activations"] == [4, 3, 2, 1]
    assert data["ranked"][0]["makespan"] < data["ranked"][1]["makespan"]
    excluded = {(e["name"], e["chunks"]): e["reason"] for e in data["excluded"]}
    assert excluded[("zb-h2", 1)].startswith("peak 7 x 64 MiB = 448 MiB on rank 0")

    text = run_cli(*args)
    assert text.returncode == 0, text.stderr
    lines = text.stdout.splitlines()
    assert lines[2].split() == ["#", "schedule", "v", "step", "time", "vs", "best", "bubble",
                                "peak", "memory"]
    assert lines[3].split()[:3] == ["1", "zb-v", "2"]
    assert "  gpipe (v=1): peak 8 x 64 MiB = 512 MiB on rank 0 exceeds the 256 MiB budget" \
        in lines


def test_cli_bad_input_is_one_line_and_exit_2():
    done = run_cli("-p", "4", "-m", "8", "--t-f", "1,2", "--activation-mb", "1",
                   "--memory-budget-mb", "10")
    assert done.returncode == 2
    assert done.stderr.startswith("error: t_f=[1.0, 2.0]") and done.stderr.count("\n") == 1
