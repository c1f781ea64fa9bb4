"""``python -m megatron_pp_ext train``: real training of the tiny Megatron-Core GPT through
Megatron's get_forward_backward_func() with the plugin installed, as subprocesses (gloo, CPU);
bad input; and the pure parts (launcher detection, progress lines)."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_pp_ext.train.launcher import detect, slurm_master_port
from megatron_pp_ext.train.progress import Progress, format_step
from megatron_pp_ext.train.settings import TrainSettings

REPO = Path(__file__).resolve().parents[1]


def _train(*args: str, timeout: float = 150) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_STEP_ID")}
    return subprocess.run([sys.executable, "-m", "megatron_pp_ext", "train", *args], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=timeout)


def _check_run(out: Path, proc, schedule: str, chunks: int, steps: int) -> dict:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["schedule"], summary["pp"], summary["chunks"]) == (schedule, 2, chunks)
    losses = summary["losses"]
    assert len(losses) == steps and len(summary["step_times_s"]) == steps
    assert losses[-1] < losses[0], losses  # it learns
    assert 0 <= summary["bubble_measured"] < 1 and 0 <= summary["bubble_predicted"] < 1
    assert len(summary["peak_activations"]) == 2
    # the per-step lines, one per step (stdout is not a terminal: no bar)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("step ")]
    assert len(lines) == steps and all("loss" in l and "bubble" in l for l in lines), proc.stdout

    page = (out / "timeline.html").read_text()
    assert page.startswith("<!DOCTYPE html>") and "</html>" in page
    assert "predicted" in page and "measured" in page
    assert page.index("predicted") < page.index("measured")  # predicted above measured
    # self-contained: nothing fetched from anywhere (the SVG namespace is a name, not a fetch)
    assert not re.search(r"<script|<link|<img|src=|href=|@import|url\((?!#)", page)
    trace = json.loads((out / "trace.json").read_text())
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert spans and {e["tid"] for e in spans} == {0, 1}
    return summary


def test_train_1f1b_and_zb_v(tmp_path):
    """Two real runs (about 15 s each, mostly importing Megatron in the ranks)."""
    out = tmp_path / "1f1b"
    proc = _train("--schedule", "1f1b", "--pp", "2", "--microbatches", "4", "--steps", "3",
                  "--out", str(out))
    summary = _check_run(out, proc, "1f1b", 1, 3)
    assert summary["peak_activations"] == [2, 1]  # 1F1B: p - r

    out = tmp_path / "zb-v"
    proc = _train("--schedule", "zb-v", "--pp", "2", "--microbatches", "4", "--steps", "3",
                  "--out", str(out))
    zbv = _check_run(out, proc, "zb-v", 2, 3)
    assert zbv["layout"] == "v"
    # same model, same data, same optimizer: every schedule computes the same losses
    assert zbv["losses"] == pytest.approx(summary["losses"], rel=1e-4)

    out = tmp_path / "auto"
    proc = _train("--schedule", "auto", "--pp", "2", "--microbatches", "4", "--steps", "3",
                  "--out", str(out))
    auto = _check_run(out, proc, "auto", 1, 3)
    assert auto["auto_choice"] in ("gpipe", "1f1b", "zb-h1", "zb-h2")
    said = [line for line in proc.stdout.splitlines() if line.startswith("auto: chose ")]
    assert len(said) == 1 and auto["auto_choice"] in said[0] and "faster" in said[0]
    assert auto["losses"] == pytest.approx(summary["losses"], rel=1e-4)  # switched, same training


@pytest.mark.parametrize("args, words", [
    (["--schedule", "1f1bb"], "unknown schedule '1f1bb'"),
    (["--schedule", "auto", "--chunks", "3"], "--schedule auto takes --chunks 1"),
    (["--pp", "0"], "--pp 0 must be"),
    (["--schedule", "interleaved", "--pp", "4", "--microbatches", "3"], "interleaved"),
    (["--schedule", "zb-v", "--chunks", "3"], "--chunks 3"),
    (["--pp", "3", "--layers", "8"], "--layers 8 must be a multiple of pp*v = 3*1"),
])
def test_bad_input_exits_2_with_one_line_before_spawning(args, words):
    proc = _train(*args, timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and words in lines[0], lines
    assert proc.stdout == ""  # nothing started: no process spawned, no step printed


# ---------------------------------------------------------------- pure parts


def test_default_layers_fit_every_schedule():
    for schedule in ("1f1b", "interleaved", "zb-v", "dualpipev"):
        for pp in (1, 2, 3, 4, 8):
            settings = TrainSettings(schedule=schedule, pp=pp, microbatches=2 * pp)
            if pp == 1 and settings.v > 1:
                continue
            assert settings.num_layers % (pp * settings.v) == 0 and settings.num_layers >= 8
            settings.check()


def test_detect_launchers():
    assert detect({}).kind == "local"
    torchrun = detect({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1",
                       "MASTER_ADDR": "node7", "MASTER_PORT": "29500"})
    assert (torchrun.kind, torchrun.rank, torchrun.world_size, torchrun.local_rank) == (
        "torchrun", 3, 4, 1)
    assert detect({"RANK": "0", "WORLD_SIZE": "1"}).kind == "local"  # one process: we spawn
    srun = detect({"SLURM_PROCID": "2", "SLURM_NTASKS": "4", "SLURM_STEP_NUM_TASKS": "4",
                   "SLURM_STEP_ID": "0", "SLURM_LOCALID": "2", "SLURM_JOB_ID": "1234",
                   "SLURM_NNODES": "1", "SLURM_JOB_NODELIST": "node1"})
    assert (srun.kind, srun.rank, srun.world_size, srun.local_rank) == ("srun", 2, 4, 2)
    assert srun.master_addr == "127.0.0.1" and srun.master_port == slurm_master_port(
        {"SLURM_JOB_ID": "1234"}) == str(15000 + 1234)
    # srun --ntasks=1 (scripts/slurm/train_cpu.sbatch), and a batch script outside srun
    assert detect({"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_STEP_ID": "0"}).kind == "local"
    assert detect({"SLURM_PROCID": "0", "SLURM_NTASKS": "4"}).kind == "local"
    assert detect({"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_STEP_ID": "0",
                   "SLURM_STEP_NUM_TASKS": "4", "MASTER_ADDR": "head",
                   "MASTER_PORT": "4242"}).master_addr == "head"


def test_progress_lines():
    line = format_step(3, 20, 2.5, 0.25, 0.4, 0.3, [4, 3, 2, 1])
    assert line == ("step  3/20  loss  2.5000  time  0.250 s  bubble  40.0% (predicted 30.0%)  "
                    "peak activations [4, 3, 2, 1]")
    plain = io.StringIO()
    progress = Progress(2, stream=plain, tty=False)
    progress.start()
    progress.step(1, "one")
    progress.step(2, "two")
    progress.close()
    assert plain.getvalue() == "one\ntwo\n"
    tty = io.StringIO()
    progress = Progress(2, stream=tty, tty=True, width=4)
    progress.start()
    progress.step(1, "one")
    progress.step(2, "two")
    progress.close()
    text = tty.getvalue()
    assert "\r" in text and "[##..] 1/2" in text and "\x1b" not in text
    assert text.endswith("two\n")
