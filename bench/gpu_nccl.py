"""The GPU check's part 3, real NCCL: 2 spawned rank processes, every schedule through
``TorchDistTransport``, and their results checked against pp=1 in the parent.

**Real NCCL** where torch sees 2 or more GPUs (one GPU cannot host several NCCL ranks):
2 processes (torch.multiprocessing, spawn), ``init_process_group("nccl")``, one GPU each,
every schedule at p=2 (zb-v and dualpipev: a 2-chunk toy of 4 stages; interleaved v=2)
through ``TorchDistTransport`` on its batched path with the ``Executor``; gradients equal
pp=1. With fewer GPUs the summary says NOT RUN and why (never counted as a pass). Nothing is
written except a temporary folder for the ranks' results.

The ranks' target, ``_nccl_rank``, lives here: spawn pickles it as ``bench.gpu_nccl._nccl_rank``
and each child imports this module (the parent's sys.path, with the repository root, goes
with it).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import shutil
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as tmp

from bench.gpu_fabric import SCHEDULES, Run, build, compare, reference
from bench.gpu_timing import ActionTimer, TimedWork
from megatron_pp_ext.analysis.lowering import nccl_choice
from megatron_pp_ext.runtime.executor import Executor
from megatron_pp_ext.runtime.transport import TorchDistTransport
from megatron_pp_ext.train.processes import free_port
from support.emulated import microbatch_inputs, stage_weights

NCCL_WORLD = 2
NOT_RUN = "NOT RUN"


def nccl_unavailable(no_nccl: bool) -> str | None:
    """Why the real NCCL part cannot run here (None: it can)."""
    if no_nccl:
        return "--no-nccl given"
    if not dist.is_available():
        return "torch.distributed is not available"
    gpus = torch.cuda.device_count()
    if gpus < NCCL_WORLD:
        return (f"torch sees {gpus} GPU(s), the real NCCL path needs {NCCL_WORLD} "
                "(one GPU cannot host several NCCL ranks)")
    if not dist.is_nccl_available():
        return "this torch has no NCCL"
    return None


# ----------------------------------------------------------------------------- a rank
def _rank_device(rank: int, nccl: bool) -> torch.device:
    if not nccl:
        return torch.device("cpu")
    torch.cuda.set_device(rank)
    torch.backends.cuda.matmul.allow_tf32 = False
    return torch.device("cuda", rank)


def _barrier(rank: int, nccl: bool) -> None:
    dist.barrier(device_ids=[rank]) if nccl else dist.barrier()


def _synchronize(device: torch.device, nccl: bool) -> None:
    if nccl:
        torch.cuda.synchronize(device)


def _run_config(record: dict, rank: int, device: torch.device, rows: int, width: int,
                timeout_s: float, nccl: bool) -> None:
    """One step of ``record["config"]`` on this rank; what it saw goes into ``record``."""
    name, p, m = record["config"]
    schedule = build(name, p, m)
    choice = nccl_choice(schedule)
    record["posting"] = choice.posting + (", ahead" if choice.post_ahead else "")
    transport = TorchDistTransport()  # it finds its batched path itself: checked
    record["batched"] = bool(getattr(transport, "batched", False))
    record["transport_device"] = str(transport.device)
    timer = ActionTimer(cuda=nccl)
    work = TimedWork(schedule, rank,
                     stage_weights(schedule.num_stages, width, device=device,
                                   dtype=torch.float32),
                     microbatch_inputs(m, rows, width, device=device,
                                       dtype=torch.float32), timer=timer)
    executor = Executor(schedule, rank, transport, work, recv_shape=(rows, width),
                        dtype=torch.float32, device=device, timeout_s=timeout_s,
                        program=choice.program)
    _barrier(rank, nccl)  # also: no rank's first NCCL call is a batch_isend_irecv
    _synchronize(device, nccl)
    start = time.perf_counter()
    result = executor.run()
    _synchronize(device, nccl)
    record["wall_ms"] = (time.perf_counter() - start) * 1e3
    actions = [str(a) for a in schedule.actions[rank]]
    record["order_ok"] = ([str(a) for a in result.executed] == actions
                          and work.computed == actions)
    record["grads"] = {s: g.detach().cpu() for s, g in work.gradients().items()
                       if g is not None}
    record["grad_device"] = sorted({str(g.device) for g in work.gradients().values()
                                    if g is not None})
    record["losses"] = dict(work.losses)
    record["ms_by_kind"] = timer.ms_by_kind()


def _nccl_rank(rank: int, world: int, port: int, out_dir: str, configs, rows: int,
               width: int, timeout_s: float, backend: str) -> None:
    """One NCCL rank (a spawned process, GPU ``rank``): every config through
    TorchDistTransport; what it saw goes to ``out_dir/rank{rank}.pt``. ``backend`` "gloo"
    (tests only): the same on the CPU, inside ``support.nccl_rules.nccl_rules()`` (gloo made
    to batch as NCCL does; the transport then takes its NCCL code path by itself)."""
    nccl = backend == "nccl"
    records = []
    stack = contextlib.ExitStack()
    failed = False
    try:
        device = _rank_device(rank, nccl)
        # the executor's timeout well inside the group's (NCCL's watchdog comes later)
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world,
                                timeout=datetime.timedelta(seconds=3 * timeout_s))
        if not nccl:
            from support.nccl_rules import nccl_rules  # torch.distributed's internals

            stack.enter_context(nccl_rules())
        for name, p, m in configs:
            record = {"config": (name, p, m)}
            records.append(record)
            _run_config(record, rank, device, rows, width, timeout_s, nccl)
        _barrier(rank, nccl)
    except BaseException:  # noqa: BLE001 - goes back to the parent
        failed = True
        records.append({"error": f"rank {rank}: {traceback.format_exc()[-2000:]}"})
    finally:
        torch.save(records, Path(out_dir) / f"rank{rank}.pt")
    try:
        stack.close()
        if not failed:  # after a failure ops may be pending: destroying could block
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - the results are saved already
        pass
    # Leave without the interpreter's teardown, as forked ranks do (os._exit): a spawned
    # child's teardown can abort in torch's C++ threads ("terminate called without an active
    # exception", seen on gloo here) after everything is saved.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# ----------------------------------------------------------------------------- the parent
@dataclass
class NcclPart:
    status: str  # "PASS", "FAIL", NOT_RUN
    detail: str
    runs: list = field(default_factory=list)


def _spawn_ranks(configs, rows: int, width: int, timeout_s: float, backend: str):
    """(error or None, each rank's records): the ranks run and gone, their folder removed."""
    out_dir = tempfile.mkdtemp(prefix="gpu_check_nccl_")
    error = None
    try:
        context = tmp.start_processes(
            _nccl_rank, args=(NCCL_WORLD, free_port(), out_dir, configs, rows, width,
                              timeout_s, backend),
            nprocs=NCCL_WORLD, join=False, start_method="spawn")
        deadline = time.monotonic() + 90 + timeout_s + 5 * len(configs)
        try:
            while not context.join(timeout=1.0):
                if time.monotonic() > deadline:
                    error = "the NCCL ranks did not finish in time (stopped)"
                    break
        except Exception as exc:  # noqa: BLE001 - a rank died
            error = f"a rank failed: {str(exc)[:1000]}"
        finally:
            for process in context.processes:
                if process.is_alive():
                    process.terminate()
                    process.join(5)
        records = []
        for rank in range(NCCL_WORLD):
            path = Path(out_dir) / f"rank{rank}.pt"
            try:
                records.append(torch.load(path, weights_only=False))  # our own child's
            except Exception as exc:  # noqa: BLE001 - missing or cut short
                records.append([{"error": f"rank {rank}: no results ({exc})"}])
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
    return error, records


def _check_config(config, records, device: torch.device, rows: int, width: int,
                  reference_fn) -> Run:
    """The run of one config, from every rank's record of it, checked against pp=1."""
    name, p, m = config
    run = Run(name, p, m)
    mine = [next((r for r in rank_records if r.get("config") == (name, p, m)
                  and "order_ok" in r), None) for rank_records in records]
    if any(r is None for r in mine):
        run.problems.append("not completed on every rank")
        return run
    run.posting = mine[0]["posting"]
    run.order_ok = all(r["order_ok"] for r in mine)
    run.wall_ms = max(r["wall_ms"] for r in mine)
    for r in mine:
        for kind, values in r["ms_by_kind"].items():
            run.ms_by_kind.setdefault(kind, []).extend(values)
        if not r["batched"]:
            run.problems.append("TorchDistTransport did not take its batched path")
        if not r["transport_device"].startswith(device.type):
            run.problems.append(f"transport device {r['transport_device']}")
        if any(not d.startswith(device.type) for d in r["grad_device"]):
            run.problems.append(f"gradients on {r['grad_device']}")
    grads, losses = {}, {}
    for r in mine:
        grads.update({s: g.to(device) for s, g in r["grads"].items()})
        losses.update(r["losses"])
    schedule_stages = build(name, p, m).num_stages
    want, want_losses = reference_fn(schedule_stages, m, rows, width, device, torch.float32)
    run.grads_ok, run.losses_ok, run.max_err, problems = compare(
        grads, losses, want, want_losses, torch.float32, device)
    run.problems += problems
    return run


def nccl_part(ms: list[int], rows: int, width: int, timeout_s: float, no_nccl: bool,
              backend: str = "nccl", reference_fn=None) -> NcclPart:
    """``backend`` "gloo" (tests only): the same processes, runs and checks on the CPU.
    ``reference_fn`` (default: ``reference``) gives the pp=1 run to compare with."""
    nccl = backend == "nccl"
    reason = nccl_unavailable(no_nccl) if nccl else None
    if reason is not None:
        return NcclPart(NOT_RUN, reason)
    # first a small 1f1b (checked too), so that the communicators' setup is not in the
    # step times of the rest
    configs = [("1f1b", NCCL_WORLD, 2)] + [(name, NCCL_WORLD, m) for name in SCHEDULES
                                           for m in ms]
    error, records = _spawn_ranks(configs, rows, width, timeout_s, backend)
    part = NcclPart("PASS", f"{NCCL_WORLD} processes, init_process_group({backend!r}), "
                    f"{'GPUs 0-1' if nccl else 'CPU'}, TorchDistTransport (batched), float32")
    errors = [r["error"] for rank_records in records for r in rank_records if "error" in r]
    device = torch.device("cuda", 0) if nccl else torch.device("cpu")
    if nccl:
        torch.backends.cuda.matmul.allow_tf32 = False
    for config in configs:
        part.runs.append(_check_config(config, records, device, rows, width,
                                       reference_fn or reference))
    if error is not None or errors or not all(run.ok for run in part.runs):
        part.status = "FAIL"
        part.detail = "; ".join(filter(None, [error, *errors])) or part.detail
    return part
