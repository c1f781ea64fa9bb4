"""The GPU check's one-screen summary: a verdict and timing per schedule, one line per other
part, and the RESULT line; it says whether the whole check passed."""

from __future__ import annotations

import time

from bench.gpu_fabric import SCHEDULES
from bench.gpu_nccl import NOT_RUN
from bench.gpu_timing import merge_runs_ms


def print_schedules(runs, cuda: bool) -> None:
    """Per schedule: PASS (its runs, postings, max error) or FAIL (which runs), and timing."""
    for schedule in SCHEDULES:
        mine = [run for run in runs if run.name == schedule]
        bad = [run for run in mine if not run.ok]
        sizes = ", ".join(f"p={r.p} m={r.m}" for r in mine)
        postings = "/".join(sorted({r.posting for r in mine}))
        timing = merge_runs_ms(mine)
        if bad:
            text = (f"FAIL  {schedule:<11} {len(bad)} of {len(mine)} runs failed: "
                    + ", ".join(f"p={r.p} m={r.m}" for r in bad))
        else:
            text = (f"PASS  {schedule:<11} {len(mine)} runs ({sizes}), {postings} posting: "
                    f"order = action list, gradients equal to pp=1 "
                    f"(max err {max(r.max_err for r in mine):.2g})")
        print(text)
        print(f"      {'':<11} mean ms/action {timing}; step "
              f"{min(r.wall_ms for r in mine):.1f}-{max(r.wall_ms for r in mine):.1f} ms "
              f"({'CUDA events' if cuda else 'perf_counter'})")


def print_nccl(nccl) -> None:
    if nccl.status == NOT_RUN:
        print(f"{NOT_RUN} real NCCL (multi-GPU) part: {nccl.detail}")
        return
    nccl_bad = [r for r in nccl.runs if not r.ok]
    print(f"{nccl.status:<5} real NCCL (multi-GPU) part: {len(nccl.runs) - len(nccl_bad)} "
          f"of {len(nccl.runs)} runs with gradients equal to pp=1"
          + "".join(f"; FAILED {r.name} p={r.p} m={r.m}" for r in nccl_bad)
          + f"; {nccl.detail[:600]}")


def print_summary(header: str, runs, stream_status: str, stream_detail: str, nccl,
                  cuda: bool, started: float, verify=(NOT_RUN, "not asked")) -> bool:
    """The summary after the parts (``started``: their perf_counter start; ``verify``: part
    4's status and what it says); True: all passed (a part NOT RUN is said so, not counted as
    a failure)."""
    failed = [run for run in runs if not run.ok]
    print()
    print("=" * 100)
    print(f"GPU check summary: {header}")
    print_schedules(runs, cuda)
    print(f"{stream_status:<5} CUDA stream check: {stream_detail}")
    print_nccl(nccl)
    print(f"{verify[0]:<5} verify on GPUs (pretrain_gpt.py): {verify[1]}")
    not_run = [label for label, status in (("CUDA stream check", stream_status),
                                           ("real NCCL part", nccl.status),
                                           ("verify on GPUs", verify[0]))
               if status == NOT_RUN]
    ok = not failed and "FAIL" not in (stream_status, nccl.status, verify[0])
    ran = f"{NOT_RUN}: {', '.join(not_run)}" if not_run else "every part ran"
    print(f"RESULT: {'PASS' if ok else 'FAIL'} ({len(runs) - len(failed)} of {len(runs)} "
          f"fabric runs passed; {ran}) in {time.perf_counter() - started:.1f} s")
    return ok
