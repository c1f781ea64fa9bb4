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

from megatron_pp_ext.schedules import build_schedule
from megatron_pp_ext.train.launcher import detect, slurm_master_port
from megatron_pp_ext.train.progress import Progress, format_step
from megatron_pp_ext.train.settings import TrainSettings
from support.train_cli import (
    P_OVER_M_HINT,
    assert_no_megatron_warnings,
    clean_env,
    run_train,
    run_train_all,
)

REPO = Path(__file__).resolve().parents[1]
PEER_CSV = REPO / "tests" / "data" / "torch_zb1p_2rank_2stagep_compute.csv"  # p=2, m=8, v=2



def _check_run(out: Path, proc, schedule: str, chunks: int, steps: int) -> dict:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert_no_megatron_warnings(proc.stdout + proc.stderr)
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["schedule"], summary["pp"], summary["chunks"]) == (schedule, 2, chunks)
    losses = summary["losses"]
    assert len(losses) == steps and len(summary["step_times_s"]) == steps
    assert losses[-1] < losses[0], losses  # it learns
    assert 0 <= summary["bubble_measured"] < 1 and 0 <= summary["bubble_predicted"] < 1
    assert len(summary["peak_activations"]) == 2
    # 2 ranks on this machine: they share its cores only where it has fewer than 2
    cores = len(os.sched_getaffinity(0))
    assert summary["pipeline_cores_shared"] == (cores if cores < 2 else None)
    assert ("ranks share this machine's" in proc.stdout) == (cores < 2)
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
    """Real runs, four side by side (each mostly imports Megatron in its ranks)."""
    # a schedule file: zb-v exported with the IR's writer; -p, -m and the V layout from it
    csv = tmp_path / "my_zbv.csv"
    csv.write_text(build_schedule("zb-v", 2, 4).to_csv())
    sizes = ["--pp", "2", "--microbatches", "4", "--steps", "3"]
    runs = run_train_all(["--schedule", "1f1b", *sizes, "--out", str(tmp_path / "1f1b")],
                         ["--schedule", str(csv), "--steps", "3", "--out", str(tmp_path / "csv")],
                         ["--schedule", "zb-v", *sizes, "--out", str(tmp_path / "zb-v")],
                         ["--schedule", "auto", *sizes, "--out", str(tmp_path / "auto")],
                         ["--schedule", "dualpipe", *sizes, "--out", str(tmp_path / "dual")])
    proc = runs[0]
    summary = _check_run(tmp_path / "1f1b", proc, "1f1b", 1, 3)
    assert summary["peak_activations"] == [2, 1]  # 1F1B: p - r
    assert summary["overlapped_pairs"] == [0, 0]  # a dense GPT computes no F&B pair
    assert "hint:" not in proc.stderr  # p <= m

    proc = runs[1]
    from_file = _check_run(tmp_path / "csv", proc, str(csv), 2, 3)
    assert (from_file["microbatches"], from_file["layout"]) == (4, "v")
    assert "with " + str(csv) in proc.stdout and "schedule my_zbv, p=2" in proc.stdout
    assert from_file["losses"] == pytest.approx(summary["losses"], rel=1e-4)

    zbv = _check_run(tmp_path / "zb-v", runs[2], "zb-v", 2, 3)
    assert zbv["layout"] == "v"
    # same model, same data, same optimizer: every schedule computes the same losses
    assert zbv["losses"] == pytest.approx(summary["losses"], rel=1e-4)

    proc = runs[3]
    auto = _check_run(tmp_path / "auto", proc, "auto", 1, 3)
    assert auto["auto_choice"] in ("gpipe", "1f1b", "zb-h1", "zb-h2", "zb-auto")
    said = [line for line in proc.stdout.splitlines() if line.startswith("auto: chose ")]
    assert len(said) == 1 and auto["auto_choice"] in said[0] and "faster" in said[0]
    assert auto["losses"] == pytest.approx(summary["losses"], rel=1e-4)  # switched, same training

    # dualpipe: each rank holds part r and a copy of part p-1-r, summed each step
    dual = _check_run(tmp_path / "dual", runs[4], "dualpipe", 2, 3)
    assert dual["layout"] == "dual" and dual["peak_activations"] == [3, 3]  # p + 1 whole parts
    assert dual["losses"] == pytest.approx(summary["losses"], rel=1e-4)


@pytest.mark.parametrize("args, words", [
    (["--schedule", "1f1bb"], "unknown schedule '1f1bb'"),
    (["--schedule", "auto", "--chunks", "3"], "--schedule auto takes --chunks 1"),
    (["--pp", "0"], "-p/--ranks 0 must be"),
    (["-p", "0"], "-p/--ranks 0 must be"),
    (["--ranks", "2", "-m", "0"], "-m/--microbatches 0 must be"),
    (["--schedule", "interleaved", "--pp", "4", "--microbatches", "3"], "interleaved"),
    (["--schedule", "InterleavedZeroBubble"], "has no equivalent here"),
    (["--csv", str(PEER_CSV), "-p", "4"],
     "-p/--ranks 4 does not fit the schedule file"),
    (["--csv", str(PEER_CSV), "-m", "4"], "written for 8 microbatches: use -m 8"),
    (["--csv", str(PEER_CSV), "--chunks", "1"], "places 2 stage(s) on each rank"),
    (["--csv", "no/such/file.csv"], "cannot read schedule file no/such/file.csv"),
    (["--csv", "schedule.txt"], "a schedule file ends in .csv"),
    (["--schedule", "1f1b", "--csv", str(PEER_CSV)], "give either --schedule 1f1b or --csv"),
    (["--schedule", "zb-v", "--chunks", "3"], "--chunks 3"),
    (["--pp", "3", "--layers", "8"], "--layers 8 must be a multiple of pp*v = 3*1"),
])
def test_bad_input_exits_2_with_one_line_before_spawning(args, words):
    """(In this process: support.cli_run; a refused command starts nothing either way.)"""
    from support.cli_run import cli_in_process
    from support.train_cli import REPO

    proc = cli_in_process("train", *args, cwd=REPO)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and words in lines[0], lines
    assert proc.stdout == ""  # nothing started: no process spawned, no step printed


def _start_under(launcher: str, out: Path, *args: str) -> list[subprocess.Popen]:
    """``train`` started as the local launcher (one command that starts its ranks) or torchrun
    (``--standalone``: a free port) would start it. (srun: a real two-task step,
    test_slurm.py's two-node job.)"""
    command = [sys.executable, "-m", "megatron_pp_ext", "train", *args, "--out", str(out)]
    pipes = dict(cwd=REPO, env=dict(clean_env(), OMP_NUM_THREADS="1"), stdout=subprocess.PIPE,
                 stderr=subprocess.PIPE, text=True)
    if launcher == "local":  # the same command, saying at its end whether it imported torch
        return [subprocess.Popen([sys.executable, "-c", _SAYS_TORCH, *command[3:]], **pipes)]
    assert launcher == "torchrun", launcher
    return [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                              "--nproc-per-node", "2", *command[1:]], **pipes)]


_SAYS_TORCH = (
    "import runpy, sys\n"
    "sys.argv = ['megatron_pp_ext', *sys.argv[1:]]\n"
    "try:\n"
    "    runpy.run_module('megatron_pp_ext', run_name='__main__')\n"
    "finally:\n"
    "    print('torch in the command process:', 'torch' in sys.modules)\n"
)


def _finish(procs: list[subprocess.Popen]) -> subprocess.CompletedProcess:
    """The launch's processes waited for: the worst exit status, their outputs joined."""
    try:
        outputs = [proc.communicate(timeout=240) for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
    return subprocess.CompletedProcess(
        procs[0].args, max(proc.returncode for proc in procs),
        "".join(o for o, _ in outputs), "".join(e for _, e in outputs))


def test_every_launcher_hints_p_over_m_once_and_keeps_megatron_warnings_out(tmp_path):
    """p > m is allowed (every schedule runs it) but rarely meant: one hint line on stderr
    (from rank 0), and the run goes on; under torchrun each rank is a process that imports
    Megatron itself, and its warnings, which do fire on this machine
    (test_megatron_warnings_fire_and_are_hidden), stay out of the output. The two launches run
    side by side. The local launcher's command process imports no torch. (Under srun: the
    real two-task step of test_slurm.py's two-node job, at p=2, m=1, checks the same.)"""
    launchers = ("local", "torchrun")
    started = {name: _start_under(name, tmp_path / name, "-p", "2", "-m", "1", "--steps", "1")
               for name in launchers}
    finished = {}
    for launcher in launchers:
        proc = finished[launcher] = _finish(started[launcher])
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert_no_megatron_warnings(proc.stdout + proc.stderr)
        assert f"gloo via {launcher}" in proc.stdout and "step 1/1" in proc.stdout
        hints = [line for line in proc.stderr.splitlines() if line.startswith("hint:")]
        assert hints == [P_OVER_M_HINT], (launcher, proc.stderr)
        summary = json.loads((tmp_path / launcher / "summary.json").read_text())
        assert (summary["launcher"], summary["microbatches"]) == (launcher, 1)
    # the local launcher's own process starts the ranks and never imports torch (~5 s of CPU
    # a run on a small machine); its ranks and their forkserver do
    assert "torch in the command process: False" in finished["local"].stdout


_WARN_AND_LOG = (
    "import sys\n"
    "from megatron_pp_ext.train.quiet import hide_megatron_warnings\n"
    "if sys.argv[1] == 'hide':\n"
    "    assert hide_megatron_warnings()\n"
    "import megatron.core.optimizer\n"  # warns: Transformer Engine and Apex are not installed
    "from megatron.core import num_microbatches_calculator as calc\n"
    "calc.init_num_microbatches_calculator(0, [4, 4, 100], 16, 1, 1)\n"  # logs: deprecated
    "import warnings\n"
    "from megatron_pp_ext.runtime import wgrad\n"
    "warnings.warn_explicit('the plugin still speaks', UserWarning, 'wgrad.py', 1,\n"
    "                      module=wgrad.__name__)\n"
)


def test_megatron_warnings_fire_and_are_hidden():
    """On this machine importing Megatron-Core warns (Python warnings) and Megatron's logger
    warns at WARNING (a rampup_batch_size deprecation): without the hiding both reach stderr;
    with it neither does, while a warning from the plugin's own modules still shows, and a
    PYTHONWARNINGS of the user's own turns the hiding off."""
    environ = clean_env()
    procs = [subprocess.Popen([sys.executable, "-c", _WARN_AND_LOG, mode], cwd=REPO,
                              env=environ, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for mode in ("show", "hide")]  # side by side
    try:
        outputs = [proc.communicate(timeout=120) for proc in procs]
        shown, hidden = [subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
                         for proc, (out, err) in zip(procs, outputs)]
    finally:
        for proc in procs:
            proc.kill()
    assert shown.returncode == 0, shown.stderr[-3000:]
    assert "UserWarning: Transformer Engine and Apex are not installed" in shown.stderr
    assert "rampup_batch_size is deprecated" in shown.stderr
    assert hidden.returncode == 0, hidden.stderr[-3000:]
    assert "Apex" not in hidden.stderr and "rampup_batch_size" not in hidden.stderr
    assert "the plugin still speaks" in hidden.stderr
    user = subprocess.run([sys.executable, "-c", "from megatron_pp_ext.train.quiet import "
                           "hide_megatron_warnings as h; print(h())"], cwd=REPO,
                          env=dict(os.environ, PYTHONWARNINGS="default"), capture_output=True,
                          text=True, timeout=60)
    assert user.stdout.strip() == "False"


# ---------------------------------------------------------------- pure parts


def test_names_in_any_case_and_schedule_files_in_the_settings():
    assert TrainSettings(schedule="ZB-V").schedule == "zb-v"
    assert TrainSettings(schedule="Interleaved1F1B").schedule == "interleaved"
    assert TrainSettings(schedule="AUTO").schedule == "auto"
    peer = TrainSettings(schedule=str(PEER_CSV), pp=2, microbatches=8)
    peer.check()
    assert (peer.is_file, peer.v, peer.layout, peer.num_layers) == (True, 2, "loop", 8)
    assert peer.first_step_schedule().text() == peer.file_schedule().text()


def test_the_command_line_takes_the_files_sizes_and_the_same_flags_as_every_command():
    from megatron_pp_ext.cli import build_parser
    from megatron_pp_ext.commands.train import settings_from

    parser = build_parser()
    settings = settings_from(parser.parse_args(["train", "--csv", str(PEER_CSV)]))
    assert (settings.schedule, settings.pp, settings.microbatches) == (str(PEER_CSV), 2, 8)
    for flags in (["-p", "3", "-m", "6", "-v", "1"], ["--ranks", "3", "--microbatches", "6",
                                                      "--chunks", "1"],
                  ["--pp", "3", "-m", "6"]):
        settings = settings_from(parser.parse_args(["train", *flags]))
        assert (settings.pp, settings.microbatches, settings.v) == (3, 6, 1)
    for command in ("simulate", "select", "train"):  # -p/--ranks/--pp and -m everywhere
        options = {s for a in parser._subparsers._group_actions[0].choices[command]._actions
                   for s in a.option_strings}
        assert {"-p", "--ranks", "--pp", "-m", "--microbatches"} <= options, command



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
