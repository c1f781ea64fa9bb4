"""The two runs of ``verify``, one after the other, under whatever started the command (the
``train`` command's launchers: ``train.launcher.detect``).

* No launcher: each run is ``world size`` local gloo processes on the CPU
  (``train.processes.spawn``), as ``train`` starts them.
* torchrun / srun: every rank of the launch starts one child process per run
  (``python -m megatron_pp_ext.verify.rank``) with the launch's rank and world size and a
  rendezvous port of its own (the launch's port + 1 + the run's index; the child of rank 0 holds
  the store), and waits for it; the child of rank 0 writes the merged record, which rank 0
  compares. Each run thus starts with Megatron and the device fresh.

A run that fails (a rank raised, the plugin's timeout fired, the run outlived its time) is the
answer: the other run is not started and the report says which run failed and why.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

from ..train.launcher import Launch, detect
from ..train.processes import RankFunction, SpawnError, spawn, start_server
from ..train.quiet import hide_megatron_warnings
from .compare import compare_runs, tolerance_for
from .report import failure_report, run_stats, text_report, write_outputs
from .runs import VerifyPlan, VerifyRun, VerifySettings, plan_verify

VERIFY_RANK = RankFunction("megatron_pp_ext.verify.rank", "run_verify_rank")


class RunFailed(Exception):
    def __init__(self, run: VerifyRun, error: str):
        super().__init__(error)
        self.run, self.error = run, error


def _say(text: str) -> None:
    print(f"verify: {text}", flush=True)


def run_local(plan: VerifyPlan, run: VerifyRun, target=VERIFY_RANK) -> dict:
    """``run`` as local gloo processes; the merged record (rank 0's)."""
    try:
        return spawn(plan.world_size, target, run, timeout_s=plan.settings.run_timeout_s)[0]
    except SpawnError as exc:
        raise RunFailed(run, str(exc)) from None


def run_child(plan: VerifyPlan, run: VerifyRun, launch: Launch, index: int) -> dict | None:
    """``run`` as a child process of this launched rank; the merged record on rank 0."""
    folder = Path(tempfile.mkdtemp(prefix="megatron-pp-verify-"))
    (folder / "run.json").write_text(json.dumps(asdict(run)))
    out = folder / "record.json"
    env = dict(os.environ, RANK=str(launch.rank), WORLD_SIZE=str(launch.world_size),
               LOCAL_RANK=str(launch.local_rank), MASTER_ADDR=launch.master_addr or "127.0.0.1",
               MASTER_PORT=str(int(launch.master_port or 29500) + 1 + index),
               TORCHELASTIC_USE_AGENT_STORE="False")
    command = [sys.executable, "-m", "megatron_pp_ext.verify.rank", str(folder / "run.json"),
               str(out)]
    try:
        done = subprocess.run(command, env=env, timeout=plan.settings.run_timeout_s,
                              stderr=subprocess.PIPE, text=True)
    except subprocess.TimeoutExpired:
        raise RunFailed(run, f"rank {launch.rank}: the {run.name} run did not end within "
                        f"{plan.settings.run_timeout_s:g} s (--timeout-s)") from None
    if done.returncode != 0:
        log = Path(run.log_dir or "") / f"{run.name}-rank{launch.rank}.log"
        said = log.read_text()[-20000:] if run.log_dir and log.exists() else ""
        raise RunFailed(run, f"rank {launch.rank}: exit {done.returncode} (its output: "
                        f"{log})\n{done.stderr[-6000:]}{said}")
    return json.loads(out.read_text()) if out.exists() else None


def verify(settings: VerifySettings, targets: dict | None = None) -> int:
    """Run both runs, compare them, report; the exit status (0: IDENTICAL or WITHIN
    TOLERANCE). ``targets``: {run name: RankFunction} in place of the rank's own function, for
    a local launch (a test's fault injection)."""
    hide_megatron_warnings()
    launch = detect()
    plan = plan_verify(settings, None if launch.kind == "local" else launch.world_size)
    if launch.kind == "local":
        start_server()
        _say(f"{plan.world_size} gloo processes on this machine's CPUs per run "
             f"({plan.world_from})")
    records = {}
    try:
        for index, run in enumerate(plan.runs):
            if launch.rank == 0:
                _say(f"{run.name} run: {run.title}, {run.steps} steps")
            if launch.kind == "local":
                target = (targets or {}).get(run.name, VERIFY_RANK)
                records[run.name] = run_local(plan, run, target)
            else:
                records[run.name] = run_child(plan, run, launch, index)
    except RunFailed as failed:
        return _report_failure(plan, failed, launch.rank)
    if launch.rank != 0:
        return 0
    return _report(plan, records)


def _report(plan: VerifyPlan, records: dict) -> int:
    ref, cand = plan.runs
    verdict = compare_runs(records[ref.name], records[cand.name], tolerance_for(cand.argv))
    stats = {name: run_stats(record) for name, record in records.items()}
    print(text_report(plan, verdict, records, stats), flush=True)
    for path in write_outputs(plan, verdict, records, stats):
        _say(f"wrote {path}")
    _say(f"the ranks' own output (Megatron's logs): {plan.runs[0].log_dir}/")
    return verdict.exit_code


def _report_failure(plan: VerifyPlan, failed: RunFailed, rank: int) -> int:
    if rank != 0:
        return 1
    text, summary = failure_report(plan, failed.run.name, failed.error)
    print(text, flush=True)
    out = Path(plan.settings.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "verify.json").write_text(json.dumps(summary, indent=1))
    _say(f"wrote {out / 'verify.json'}")
    return 1
