"""Run Megatron-LM's own ``tests/unit_tests/pipeline_parallel/test_schedules.py`` on the CPU:
8 ranks (the tests use tp=2 x pp=4), one pytest process per rank, gloo, with or without
megatron_pp_ext installed. Not part of ``pytest tests`` (it needs a Megatron-LM checkout).

    .venv/bin/python tests_megatron_lm/peer_schedules/run_peer_tests.py \
        --megatron-lm /tmp/Megatron-LM [--schedule 1f1b] [--repeat 20] [-k custom_pgs]

``--schedule`` sets MEGATRON_PP_SCHEDULE for the ranks (the plugin mlm_cpu_plugin.py then calls
``megatron_pp_ext.install(schedule=...)``); without it Megatron's own schedules run (baseline).
The checkout's ``megatron`` package is NOT imported: a staging directory holding only a link
to the checkout's ``tests`` is put on the path, so ``megatron.core`` is the installed
megatron-core (the version the plugin targets). pytest-mock (imported by the test file) is
looked for in --deps (``pip install --no-deps --target DIR pytest-mock``) or the venv.

A run that outlives --timeout gets SIGUSR1 on every rank (faulthandler dumps all threads'
stacks into the rank's log), then is killed. Per run: logs/run<N>/rank<R>.log and .json.
A test counts as passed in a run only when all 8 ranks passed it.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
TEST_FILE = "tests/unit_tests/pipeline_parallel/test_schedules.py"
WORLD = 8


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_once(args, staging: Path, run_dir: Path) -> dict:
    run_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    path = [str(staging), str(HERE)] + ([args.deps] if args.deps else [])
    env = dict(os.environ, WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(port), MLM_PEER_OUT=str(run_dir), OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(path + [os.environ.get("PYTHONPATH", "")]),
               PYTHONUNBUFFERED="1", CUDA_VISIBLE_DEVICES="")
    env.pop("MEGATRON_PP_SCHEDULE", None)
    if args.schedule:
        env["MEGATRON_PP_SCHEDULE"] = args.schedule
    env["MLM_PEER_FIX_NEW_GROUP"] = "1" if args.fix_new_group_race else "0"
    cmd = [sys.executable, "-m", "pytest", "--noconftest", "-p", "mlm_cpu_plugin",
           "-p", "no:cacheprovider", "-q", "-rfE", "--rootdir", str(staging),
           str(staging / TEST_FILE)] + (["-k", args.k] if args.k else [])
    procs = []
    for rank in range(WORLD):
        log = open(run_dir / f"rank{rank}.log", "w")
        procs.append((subprocess.Popen(cmd, cwd=staging, stdout=log, stderr=subprocess.STDOUT,
                                       env=dict(env, RANK=str(rank), LOCAL_RANK=str(rank)),
                                       start_new_session=True), log))
    deadline = time.monotonic() + args.timeout
    timed_out = False
    while any(p.poll() is None for p, _ in procs):
        if time.monotonic() > deadline:
            timed_out = True
            for p, _ in procs:
                if p.poll() is None:
                    p.send_signal(signal.SIGUSR1)  # faulthandler: stacks into the log
            time.sleep(3)
            for p, _ in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
            break
        time.sleep(0.5)
    for p, log in procs:
        p.wait()
        log.close()
    per_test: dict[str, dict[int, str]] = defaultdict(dict)
    errors: dict[str, str] = {}
    for rank in range(WORLD):
        f = run_dir / f"rank{rank}.json"
        if not f.exists():
            continue
        for nodeid, entry in json.loads(f.read_text())["results"].items():
            per_test[nodeid][rank] = entry["outcome"]
            if "error" in entry and nodeid not in errors:
                errors[nodeid] = f"rank {rank}: " + entry["error"].strip().splitlines()[-1]
    outcome = {}
    for nodeid, ranks in per_test.items():
        values = set(ranks.values())
        if len(ranks) < WORLD:
            outcome[nodeid] = "incomplete"
        elif values == {"passed"}:
            outcome[nodeid] = "passed"
        elif values == {"skipped"}:
            outcome[nodeid] = "skipped"
        else:
            outcome[nodeid] = "failed"
    return {"timed_out": timed_out, "returncodes": [p.returncode for p, _ in procs],
            "outcome": outcome, "errors": errors}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--megatron-lm", default=os.environ.get("MEGATRON_LM_PATH"),
                        help="a checkout of NVIDIA/Megatron-LM (branch core_r0.19.0)")
    parser.add_argument("--schedule", default=None, help="install this schedule (else none)")
    parser.add_argument("-k", default=None, help="pytest -k expression")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--fix-new-group-race", action="store_true",
                        help="replace the test helper _populate_embedding_and_position_groups "
                             "by one that calls new_group as torch requires (mlm_cpu_plugin.py)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per run")
    parser.add_argument("--deps", default="/tmp/mlm_peer_deps",
                        help="extra site dir holding pytest_mock ('' for none)")
    parser.add_argument("--logs", default=None, help="where run logs go (default: a tmp dir)")
    args = parser.parse_args()
    if not args.megatron_lm or not (Path(args.megatron_lm) / TEST_FILE).exists():
        parser.error(f"--megatron-lm (or MEGATRON_LM_PATH) must name a checkout with {TEST_FILE}")
    staging = Path(tempfile.mkdtemp(prefix="mlm_peer_stage_"))
    (staging / "tests").symlink_to(Path(args.megatron_lm).resolve() / "tests")
    logs = Path(args.logs or tempfile.mkdtemp(prefix="mlm_peer_logs_"))
    totals: dict[str, Counter] = defaultdict(Counter)
    for i in range(args.repeat):
        t0 = time.monotonic()
        result = run_once(args, staging, logs / f"run{i}")
        for nodeid, outcome in result["outcome"].items():
            totals[nodeid][outcome] += 1
        bad = {n: o for n, o in result["outcome"].items() if o not in ("passed", "skipped")}
        print(f"run {i}: {time.monotonic() - t0:.0f} s, timed_out={result['timed_out']}, "
              f"rc={result['returncodes']}, "
              f"{sum(o == 'passed' for o in result['outcome'].values())} passed, "
              f"not passed: {bad or 'none'}", flush=True)
        for nodeid, err in result["errors"].items():
            print(f"    {nodeid.split('::')[-1]}: {err[:400]}", flush=True)
    print(f"\nschedule: {args.schedule or 'none (Megatron-Core own)'}; runs: {args.repeat}; "
          f"new_group race fixed: {args.fix_new_group_race}; "
          f"logs: {logs}")
    for nodeid, counts in sorted(totals.items()):
        print(f"  {nodeid.split('::')[-1]:<70} {dict(counts)}")
    ok = all(set(c) <= {"passed", "skipped"} for c in totals.values()) and bool(totals)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
