"""Activation bytes of real runs: the tiny Megatron-Core GPT trained by ``python -m
megatron_pp_ext train`` (2 gloo processes, p=2, m=4, 2 steps each), and ``select`` choosing
under a budget in bytes, checked against the peaks the runs measured."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_pp_ext.integration.auto import AutoSchedule, measured_activation_bytes
from megatron_pp_ext.runtime.executor import StepResult
from megatron_pp_ext.schedules import build_schedule
from support.train_cli import run_train_all

REPO = Path(__file__).resolve().parents[1]
LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_STEP_ID")
SCHEDULES = ("1f1b", "zb-h1", "zb-h2", "gpipe")

pytestmark = pytest.mark.megatron_cpu


def _cli(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_ENV}
    return subprocess.run([sys.executable, "-m", "megatron_pp_ext", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{schedule: (summary, stdout, out folder)} for four real runs."""
    folders = {name: tmp_path_factory.mktemp(name) for name in SCHEDULES}
    procs = run_train_all(*[["--schedule", name, "-p", "2", "-m", "4", "--steps", "2", "--out",
                             str(folders[name])] for name in SCHEDULES])  # side by side
    out = {}
    for name, proc in zip(SCHEDULES, procs):
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        folder = folders[name]
        out[name] = (json.loads((folder / "summary.json").read_text()), proc.stdout, folder)
    return out


def test_summary_has_peak_bytes_per_rank(runs):
    summary, stdout, folder = runs["1f1b"]
    peak = summary["peak_activation_bytes"]
    assert summary["peak_activations"] == [2, 1]  # the count, as before
    assert len(peak) == 2 and all(isinstance(b, int) and b > 0 for b in peak)
    assert peak[0] >= peak[1]  # 1F1B: the first rank holds the most
    per_stage = summary["activation_bytes_per_stage"]
    assert len(per_stage) == 2 and all(b > 0 for b in per_stage)
    # 1F1B at p=2: rank 0 holds exactly two microbatches' saved tensors, rank 1 one; the
    # simulator's count in bytes says the same
    assert peak == [2 * per_stage[0], per_stage[1]]
    assert summary["peak_activation_bytes_predicted"] == peak
    assert [p["w_queue"] + p["waiting"] for p in summary["peak_activation_bytes_parts"]] == [0, 0]
    assert summary["device_peak_bytes"] is None  # the CPU: no CUDA allocator
    # train's step lines, with units
    lines = [line for line in stdout.splitlines() if line.startswith("step ")]
    assert len(lines) == 2
    assert all("peak activations (count) [2, 1]" in line and "activation memory [" in line
               and "MiB" in line for line in lines), lines
    # the timeline's table and the Chrome trace
    page = (folder / "timeline.html").read_text()
    assert "peak activation bytes (measured)" in page
    assert "peak activation bytes (predicted)" in page  # the simulator's count in bytes
    assert f'title="{peak[0]} bytes"' in page
    trace = json.loads((folder / "trace.json").read_text())
    assert trace["otherData"]["peak_bytes"] == peak


def test_the_w_queue_counts_in_a_real_split_run(runs):
    summary = runs["zb-h1"][0]
    parts = summary["peak_activation_bytes_parts"]
    # the last rank's peak is reached with pending W's: the Megatron linears' inputs and
    # output gradients held by the W queue
    assert parts[1]["w_queue"] > 0
    assert sum(parts[1].values()) == summary["peak_activation_bytes"][1]
    # I frees the graph, W holds less than the F saved: the count in bytes is an upper bound
    assert all(m <= p for m, p in zip(summary["peak_activation_bytes"],
                                      summary["peak_activation_bytes_predicted"]))
    # gpipe holds every microbatch at once: exactly m x one F
    gpipe = runs["gpipe"][0]
    assert gpipe["peak_activation_bytes"] == [4 * b for b in gpipe["activation_bytes_per_stage"]]


def test_select_under_a_budget_between_measured_peaks_picks_one_that_fits(runs):
    measured = {name: max(runs[name][0]["peak_activation_bytes"]) for name in SCHEDULES}
    assert measured["zb-h1"] < measured["zb-h2"] < measured["gpipe"]
    budget = (measured["zb-h1"] + measured["zb-h2"]) // 2
    summary_path = runs["zb-h1"][2] / "summary.json"  # split costs and activation bytes
    proc = _cli("select", "--costs", str(summary_path), "--schedules", ",".join(SCHEDULES),
                "--memory-budget", f"{budget}B", "--format", "json")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["memory_budget_bytes"] == budget
    assert data["activation_bytes"] == [int(b) for b in
                                        runs["zb-h1"][0]["activation_bytes_per_stage"]]
    assert data["activation_bytes_from"].startswith("measured")
    chosen = data["ranked"][0]["name"]
    assert measured[chosen] <= budget  # what it picked fits, as measured
    # the selector's fit agrees with the measurements: excluded exactly those whose measured
    # peak exceeds the budget
    assert {e["name"] for e in data["excluded"]} == {n for n in SCHEDULES if measured[n] > budget}
    assert {r["name"] for r in data["ranked"]} == {n for n in SCHEDULES if measured[n] <= budget}
    # the same in MiB with the old flag
    old = _cli("select", "--costs", str(summary_path), "--schedules", ",".join(SCHEDULES),
               "--memory-budget-mb", str(budget / 2 ** 20), "--format", "json")
    assert json.loads(old.stdout)["ranked"][0]["name"] == chosen


def test_auto_chooses_with_the_measured_bytes():
    """auto's choice (rank 0's part, without processes): per-rank measured bytes, a budget
    between 1F1B's peak and ZB-H2's, equal costs: the split schedules would be faster, ZB-H2
    does not fit, ZB-H1 does."""
    schedule = build_schedule("1f1b", 2, 4)
    result = StepResult([], 2, None, saved_bytes_per_stage={0: 1000})
    assert measured_activation_bytes(result) == 1000
    auto = AutoSchedule(layout="one-chunk", memory_budget_bytes=2500)
    auto.measured_activation = [1000, 1100]
    costs = {s: {"F": 1.0, "I": 1.0, "W": 1.0} for s in range(2)}
    choice = auto._choose(costs, schedule, [None, None])
    # counts at p=2, m=4: 1f1b [2, 1], zb-h1 [2, 2], zb-h2 [3, 3], gpipe [4, 4]; x [1000, 1100]
    assert choice.schedule == "zb-h1"
    assert "zb-h2 excluded" in choice.reason and "gpipe excluded" in choice.reason
    assert "measured activation per microbatch" in choice.reason
