"""GPU check: one short script to run whenever a GPU is at hand.

    .venv/bin/python bench/gpu_check.py                # cuda if torch sees a GPU, else cpu
    .venv/bin/python bench/gpu_check.py --quick        # p=2, 4; m=4 (NCCL part: m=4)
    .venv/bin/python bench/gpu_check.py --device cpu --quick    # the part CI runs

Three parts, then a one-screen summary; the exit code is non-zero if any check failed.

1. **Every schedule over the in-memory NCCL-rules fabric** (``tests/support/nccl_fabric.py``:
   rendezvous sends, one Work per batch, one stream of batches per rank, data visible only
   after the wait), all 7 schedules at p = 2, 4 and m = 4, 8, every rank a thread of this
   process running the real ``Executor`` (Megatron or lockstep posting, as on NCCL) with the
   toy autograd stages (``tests/support/emulated.py``), whose weights, inputs, outputs and the
   fabric's copies all live on ``--device``. Checked: each rank computed exactly its action
   list, in order, and every stage's gradient and every loss equal the pp=1 run's on the same
   device and dtype (CPU: float64, rtol = atol = 1e-12; CUDA: float32, rtol 1e-4, atol 1e-5,
   TF32 off: the pipeline sums a weight's gradient over microbatches in its own order).
   Timing, per action kind (F, B, I, W): CUDA events recorded before and after each action on
   the rank's stream (read after a synchronize), or perf_counter on the CPU; and the step's
   wall time (threads started to device synchronized). One GPU runs every rank: the event
   times include other ranks' kernels interleaved on the GPU, and the toy stages are
   launch-bound, so these are a smoke check, not a benchmark.
2. **CUDA streams** (CUDA only). On CUDA the fabric is ``CudaStreamFabric``: each rank
   computes on a stream of its own, each transfer is a copy on the receiving rank's
   communication stream, ordered after the sender's stream reached the post (an event) and
   held back by a GPU sleep; a wait makes the waiting rank's current stream wait for every
   copy of its batch (NCCL's ``work.wait()``). Part 1's gradients on that fabric show every
   received tensor was used on the current stream only after its wait. The control here shows
   the check has teeth: a stream that reads the buffer without the wait sees the stale
   data, with the wait the copied data; and one fabric transfer behind a 0.1 s GPU sleep is
   read correctly through the handle's wait.
3. **Real NCCL** where torch sees 2 or more GPUs (one GPU cannot host several NCCL ranks):
   2 processes (torch.multiprocessing, spawn), ``init_process_group("nccl")``, one GPU each,
   every schedule at p=2 (zb-v and dualpipev: a 2-chunk toy of 4 stages; interleaved v=2)
   through ``TorchDistTransport`` on its batched path with the ``Executor``; gradients equal
   pp=1. With fewer GPUs the summary says NOT RUN and why (never counted as a pass).

No network; nothing is written except a temporary folder for the NCCL ranks' results.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import shutil
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for _path in (str(ROOT / "tests"), str(ROOT)):  # the toy stages live with the tests' support
    if _path not in sys.path:
        sys.path.insert(0, _path)

import torch  # noqa: E402

from megatron_pp_ext.runtime.executor import Executor  # noqa: E402
from megatron_pp_ext.runtime.inmemory import run_ranks_in_threads  # noqa: E402
from megatron_pp_ext.analysis.lowering import nccl_choice  # noqa: E402
from megatron_pp_ext.schedules import build_schedule  # noqa: E402
from support.emulated import microbatch_inputs, stage_weights  # noqa: E402
from support.inmemory import RecordingWork  # noqa: E402
from support.nccl_fabric import NcclRulesFabric  # noqa: E402

SCHEDULES = ["gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2", "zb-v", "dualpipev"]
TWO_CHUNKS = {"interleaved", "zb-v", "dualpipev"}
KINDS = ("F", "B", "I", "W")
#: (rtol, atol) of the comparison with pp=1, by dtype
TOLERANCES = {torch.float64: (1e-12, 1e-12), torch.float32: (1e-4, 1e-5)}
NCCL_WORLD = 2
NOT_RUN = "NOT RUN"


def build(name: str, p: int, m: int):
    return build_schedule(name, p, m, chunks=2 if name in TWO_CHUNKS else 1)


# ----------------------------------------------------------------------------- timing
class ActionTimer:
    """Start / end marks per action: CUDA events on the current stream, or perf_counter."""

    def __init__(self, cuda: bool):
        self.cuda, self.marks = cuda, []  # (kind, start, end)

    def _mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()  # on the current stream: the rank's
        return event

    def timed(self, kind: str, fn):
        start = self._mark()
        out = fn()
        self.marks.append((kind, start, self._mark()))
        return out

    def ms_by_kind(self) -> dict[str, list[float]]:
        """Milliseconds per action, by kind (on CUDA: call after a synchronize)."""
        out: dict[str, list[float]] = {}
        for kind, start, end in self.marks:
            ms = start.elapsed_time(end) if self.cuda else (end - start) * 1e3
            out.setdefault(kind, []).append(ms)
        return out


class TimedWork(RecordingWork):
    """The toy stages, recording the order of what they computed and each action's time."""

    def __init__(self, *args, timer: ActionTimer, **kwargs):
        super().__init__(*args, **kwargs)
        self.timer = timer

    def forward(self, action, input_tensor):
        return self.timer.timed("F", lambda: super(TimedWork, self).forward(action, input_tensor))

    def backward(self, action, output_grad):
        return self.timer.timed(action.kind,
                                lambda: super(TimedWork, self).backward(action, output_grad))

    def weight(self, action):
        return self.timer.timed("W", lambda: super(TimedWork, self).weight(action))


def merge_ms(timers) -> dict[str, list[float]]:
    merged: dict[str, list[float]] = {}
    for timer in timers:
        for kind, values in timer.ms_by_kind().items():
            merged.setdefault(kind, []).extend(values)
    return merged


def format_ms(ms_by_kind: dict[str, list[float]]) -> str:
    return " ".join(f"{k} {sum(v) / len(v):.3f}" for k in KINDS if (v := ms_by_kind.get(k)))


# ----------------------------------------------------------------------------- CUDA streams
class CudaStreamFabric(NcclRulesFabric):
    """NCCL's rules plus NCCL's stream semantics, on one GPU.

    Each transfer is a copy on the receiving rank's communication stream, ordered after the
    sender's stream reached the post (an event recorded there) and held back by a GPU sleep
    of ``sleep_cycles``; a wait makes the waiting rank's current stream wait for every copy of
    the batch (one Work per batch, as NCCL's ``work.wait()``). A received tensor read on the
    current stream before its wait would read an unfinished copy."""

    def __init__(self, world_size: int, device, sleep_cycles: int = 100_000):
        super().__init__(world_size, device=device)  # nothing is matched before a post
        self.sleep_cycles = sleep_cycles
        self.comm_streams = [torch.cuda.Stream(device=self.device) for _ in range(world_size)]

    def post(self, batch) -> None:  # the rank's host thread: its current stream
        batch.posted = torch.cuda.Event()
        batch.posted.record(torch.cuda.current_stream(self.device))
        super().post(batch)

    def _match(self, pair) -> None:  # a stream thread, under the fabric's lock
        sends, recvs = self.sends[pair], self.recvs[pair]
        while sends and recvs:
            send, recv = sends.popleft(), recvs.popleft()
            stream = self.comm_streams[recv.batch.rank]
            with torch.cuda.device(self.device), torch.cuda.stream(stream):
                stream.wait_event(send.batch.posted)
                if self.sleep_cycles:
                    torch.cuda._sleep(self.sleep_cycles)
                source = send.tensor.detach()
                recv.received = source.clone()
                source.record_stream(stream)  # not reused before the copy has read it
                ready = torch.cuda.Event()
                ready.record(stream)
            send.ready = recv.ready = ready
            send.done = recv.done = True
            self.lock.notify_all()

    def wait_batch(self, batch, timeout_s: float) -> None:  # the rank's host thread
        super().wait_batch(batch, timeout_s)
        current = torch.cuda.current_stream(self.device)
        for op in batch.ops:
            current.wait_event(op.ready)
            if op.received is not None:
                op.received.record_stream(current)


@contextlib.contextmanager
def rank_stream(device: torch.device, stream):
    if stream is None:
        yield
        return
    with torch.cuda.device(device), torch.cuda.stream(stream):
        yield


# ----------------------------------------------------------------------------- pp = 1
def reference(num_stages: int, m: int, rows: int, width: int, device, dtype):
    """The unpipelined run on the same device and dtype (support.inmemory's)."""
    from support.inmemory import reference_gradients

    return reference_gradients(num_stages, m, rows, width, device=device, dtype=dtype)


def compare(grads: dict, losses: dict, want: dict, want_losses: list, dtype, device):
    """(gradients equal, losses equal, max abs gradient error, problems)."""
    rtol, atol = TOLERANCES[dtype]
    problems, worst, grads_ok = [], 0.0, True
    for stage, expected in want.items():
        got = grads.get(stage)
        if got is None:
            problems.append(f"stage {stage}: no gradient")
            grads_ok = False
            continue
        if got.device.type != torch.device(device).type:
            problems.append(f"stage {stage}: gradient on {got.device}, not {device}")
            grads_ok = False
        got = got.to(expected.device)
        worst = max(worst, float((got - expected).abs().max()))
        if not torch.allclose(got, expected, rtol=rtol, atol=atol):
            problems.append(f"stage {stage}: gradient differs (max abs err "
                            f"{float((got - expected).abs().max()):.3g})")
            grads_ok = False
    losses_ok = sorted(losses) == list(range(len(want_losses))) and all(
        math.isclose(losses[mb], value, rel_tol=rtol, abs_tol=atol)
        for mb, value in enumerate(want_losses))
    if not losses_ok:
        problems.append("losses differ from pp=1")
    return grads_ok, losses_ok, worst, problems


# ----------------------------------------------------------------------------- part 1
@dataclass
class Run:
    name: str
    p: int
    m: int
    posting: str = "?"
    order_ok: bool = False
    grads_ok: bool = False
    losses_ok: bool = False
    max_err: float = float("nan")
    wall_ms: float = float("nan")
    ms_by_kind: dict = field(default_factory=dict)
    problems: list = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.order_ok and self.grads_ok and self.losses_ok and not self.problems

    def line(self) -> str:
        verdict = "ok  " if self.ok else "FAIL"
        grads = "gradients equal to pp=1" if self.grads_ok and self.losses_ok else \
            "gradients NOT equal to pp=1"
        order = "order = action list" if self.order_ok else "order NOT the action list"
        text = (f"{verdict} {self.name:<11} p={self.p} m={self.m:<2} {self.posting:<8} "
                f"{order}; {grads} (max err {self.max_err:.2g}); step {self.wall_ms:.1f} ms; "
                f"ms/action {format_ms(self.ms_by_kind)}")
        return text + "".join(f"\n       {problem}" for problem in self.problems)


def run_on_fabric(name: str, p: int, m: int, device: torch.device, dtype, rows: int,
                  width: int, timeout_s: float, sleep_cycles: int,
                  cuda: bool | None = None) -> Run:
    """One step of ``name`` over the fabric, checked. ``cuda`` (default: the device's type)
    takes the CUDA path (streams, events, CudaStreamFabric); tests pass True on the CPU with
    a stand-in for torch.cuda, to run this path's logic where no GPU is."""
    run = Run(name, p, m)
    try:
        schedule = build(name, p, m)
        choice = nccl_choice(schedule)
        run.posting = choice.posting + (", ahead" if choice.post_ahead else "")
        cuda = device.type == "cuda" if cuda is None else cuda
        weights = stage_weights(schedule.num_stages, width, device=device, dtype=dtype)
        inputs = microbatch_inputs(m, rows, width, device=device, dtype=dtype)
        if cuda:
            fabric = CudaStreamFabric(p, device, sleep_cycles=sleep_cycles)
            streams = [torch.cuda.Stream(device=device) for _ in range(p)]
            torch.cuda.synchronize(device)  # weights and inputs are there for every stream
        else:
            fabric, streams = NcclRulesFabric(p, device=device), [None] * p
        timers = [ActionTimer(cuda) for _ in range(p)]

        def rank_fn(rank, transport):
            with rank_stream(device, streams[rank]):
                work = TimedWork(schedule, rank, weights, inputs, timer=timers[rank])
                executor = Executor(schedule, rank, transport, work, recv_shape=(rows, width),
                                    dtype=dtype, device=device, timeout_s=timeout_s,
                                    program=choice.program)
                return executor.run(), work

        start = time.perf_counter()
        results = run_ranks_in_threads(p, rank_fn, timeout_s=timeout_s + 10, fabric=fabric)
        if cuda:
            torch.cuda.synchronize(device)
        run.wall_ms = (time.perf_counter() - start) * 1e3
        run.ms_by_kind = merge_ms(timers)
        run.order_ok = all(
            [str(a) for a in result.executed] == [str(a) for a in schedule.actions[rank]]
            and work.computed == [str(a) for a in schedule.actions[rank]]
            for rank, (result, work) in enumerate(results))
        grads, losses = {}, {}
        for _result, work in results:
            grads.update(work.gradients())
            losses.update(work.losses)
        want, want_losses = reference(schedule.num_stages, m, rows, width, device, dtype)
        run.grads_ok, run.losses_ok, run.max_err, problems = compare(
            grads, losses, want, want_losses, dtype, device)
        run.problems += problems
    except Exception as exc:  # noqa: BLE001 - reported as this run's failure
        run.problems.append(f"{type(exc).__name__}: {str(exc)[:600]}")
    return run


# ----------------------------------------------------------------------------- part 2
def stream_check(device: torch.device, dtype) -> tuple[bool, str]:
    """Do a consumer stream's reads need the wait? (control: without it, stale data)."""
    from megatron_pp_ext.runtime.transport import RecvRequest

    cycles = 200_000_000  # ~0.1 s at 2 GHz
    n = 1 << 20
    with torch.cuda.device(device):
        src = torch.full((n,), 7.0, device=device, dtype=dtype)
        dst = torch.zeros(n, device=device, dtype=dtype)
        comm, consumer = torch.cuda.Stream(device=device), torch.cuda.Stream(device=device)
        dst.clone().copy_(src)  # the kernels loaded before the race below
        torch.cuda.synchronize(device)
        with torch.cuda.stream(comm):
            torch.cuda._sleep(5 * cycles)  # ~0.5 s: the host reaches the read long before
            dst.copy_(src)
            ready = torch.cuda.Event()
            ready.record(comm)
        with torch.cuda.stream(consumer):
            early = dst.clone()  # no wait: the copy has not run yet
            consumer.wait_event(ready)
            late = dst.clone()
        torch.cuda.synchronize(device)
        stale, fresh = bool((early == 0).all()), bool((late == 7).all())

        # one transfer through the fabric, its copy behind a 0.1 s sleep, read after the wait
        fabric = CudaStreamFabric(2, device, sleep_cycles=cycles)
        try:
            payload = torch.arange(4096, device=device, dtype=dtype)
            torch.cuda.synchronize(device)
            with torch.cuda.stream(consumer):
                _, handle = fabric.transport(1).exchange(
                    None, RecvRequest(0, (4096,), dtype, device), False)
                fabric.transport(0).exchange((payload, 1), None, False)
                got = handle.wait(10.0).clone()  # read on the consumer stream after the wait
            torch.cuda.synchronize(device)
            through_fabric = bool(torch.equal(got, payload))
        finally:
            fabric.close()
    ok = stale and fresh and through_fabric
    detail = (f"a read without the wait saw {'stale' if stale else 'COPIED (no teeth)'} data, "
              f"after the wait {'the copy' if fresh else 'WRONG data'}; a fabric transfer "
              f"behind a 0.1 s GPU sleep read after its wait: "
              f"{'right' if through_fabric else 'WRONG'}; part 1 ran on this fabric (every "
              "copy on the receiver's stream behind a GPU sleep)")
    return ok, detail


# ----------------------------------------------------------------------------- part 3
def nccl_unavailable(no_nccl: bool) -> str | None:
    """Why the real NCCL part cannot run here (None: it can)."""
    import torch.distributed as dist

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


def _nccl_rank(rank: int, world: int, port: int, out_dir: str, configs, rows: int,
               width: int, timeout_s: float, backend: str) -> None:
    """One NCCL rank (a spawned process, GPU ``rank``): every config through
    TorchDistTransport; what it saw goes to ``out_dir/rank{rank}.pt``. ``backend`` "gloo"
    (tests only): the same on the CPU, inside ``support.nccl_rules.nccl_rules()`` (gloo made
    to batch as NCCL does; the transport then takes its NCCL code path by itself)."""
    import datetime

    import torch.distributed as dist

    from megatron_pp_ext.runtime.transport import TorchDistTransport

    nccl = backend == "nccl"
    records = []
    stack = contextlib.ExitStack()
    failed = False
    try:
        if nccl:
            torch.cuda.set_device(rank)
            device = torch.device("cuda", rank)
            torch.backends.cuda.matmul.allow_tf32 = False
        else:
            device = torch.device("cpu")

        def barrier():
            dist.barrier(device_ids=[rank]) if nccl else dist.barrier()

        def synchronize():
            if nccl:
                torch.cuda.synchronize(device)

        # the executor's timeout well inside the group's (NCCL's watchdog comes later)
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world,
                                timeout=datetime.timedelta(seconds=3 * timeout_s))
        if not nccl:
            from support.nccl_rules import nccl_rules

            stack.enter_context(nccl_rules())
        for name, p, m in configs:
            record = {"config": (name, p, m)}
            records.append(record)
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
            barrier()  # also: no rank's first NCCL call is a batch_isend_irecv
            synchronize()
            start = time.perf_counter()
            result = executor.run()
            synchronize()
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
        barrier()
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


@dataclass
class NcclPart:
    status: str  # "PASS", "FAIL", NOT_RUN
    detail: str
    runs: list = field(default_factory=list)


def nccl_part(ms: list[int], rows: int, width: int, timeout_s: float, no_nccl: bool,
              backend: str = "nccl") -> NcclPart:
    """``backend`` "gloo" (tests only): the same processes, runs and checks on the CPU."""
    nccl = backend == "nccl"
    reason = nccl_unavailable(no_nccl) if nccl else None
    if reason is not None:
        return NcclPart(NOT_RUN, reason)
    import torch.multiprocessing as tmp

    from megatron_pp_ext.train.processes import free_port

    # first a small 1f1b (checked too), so that the communicators' setup is not in the
    # step times of the rest
    configs = [("1f1b", NCCL_WORLD, 2)] + [(name, NCCL_WORLD, m) for name in SCHEDULES
                                           for m in ms]
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

    part = NcclPart("PASS", f"{NCCL_WORLD} processes, init_process_group({backend!r}), "
                    f"{'GPUs 0-1' if nccl else 'CPU'}, TorchDistTransport (batched), float32")
    errors = [r["error"] for rank_records in records for r in rank_records if "error" in r]
    device = torch.device("cuda", 0) if nccl else torch.device("cpu")
    if nccl:
        torch.backends.cuda.matmul.allow_tf32 = False
    for name, p, m in configs:
        run = Run(name, p, m)
        part.runs.append(run)
        mine = [next((r for r in rank_records if r.get("config") == (name, p, m)
                      and "order_ok" in r), None) for rank_records in records]
        if any(r is None for r in mine):
            run.problems.append("not completed on every rank")
            continue
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
        want, want_losses = reference(schedule_stages, m, rows, width, device, torch.float32)
        run.grads_ok, run.losses_ok, run.max_err, problems = compare(
            grads, losses, want, want_losses, torch.float32, device)
        run.problems += problems
    if error is not None or errors or not all(run.ok for run in part.runs):
        part.status = "FAIL"
        part.detail = "; ".join(filter(None, [error, *errors])) or part.detail
    return part


# ----------------------------------------------------------------------------- main
def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cpu", "cuda"], default=None,
                        help="default: cuda if torch sees a GPU, else cpu")
    parser.add_argument("--quick", action="store_true", help="m=4 only (a short run)")
    parser.add_argument("--ps", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--ms", type=int, nargs="+", default=None, help="default 4 8")
    parser.add_argument("--rows", type=int, default=None, help="default cpu 4, cuda 64")
    parser.add_argument("--width", type=int, default=None, help="default cpu 16, cuda 512")
    parser.add_argument("--dtype", choices=["float32", "float64"], default=None,
                        help="default cpu float64, cuda float32")
    parser.add_argument("--timeout", type=float, default=60.0, help="per step, seconds")
    parser.add_argument("--sleep-cycles", type=int, default=100_000,
                        help="CUDA: GPU sleep before each fabric copy")
    parser.add_argument("--no-nccl", action="store_true", help="skip the real NCCL part")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: --device cuda, but torch sees no GPU", file=sys.stderr)
        return 2
    cuda = args.device == "cuda"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dtype = getattr(torch, args.dtype or ("float32" if cuda else "float64"))
    ms = args.ms or ([4] if args.quick else [4, 8])
    rows = args.rows or (64 if cuda else 4)
    width = args.width or (512 if cuda else 16)
    rtol, atol = TOLERANCES[dtype]
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = False
    name = torch.cuda.get_device_name(device) if cuda else "CPU"
    run_on_fabric("1f1b", 2, 2, device, dtype, rows, width, args.timeout,
                  args.sleep_cycles)  # warm-up (CUDA context, cuBLAS, autograd), not reported
    header = (f"device {device} ({name}), {dtype}, toy stages {rows}x{width}, "
              f"rtol {rtol:g} atol {atol:g} against pp=1 on the same device")
    print(f"gpu_check: {header}", flush=True)
    started = time.perf_counter()

    print("[1] every schedule over the in-memory NCCL-rules fabric"
          + (" (CUDA streams, events)" if cuda else " (perf_counter timing)"), flush=True)
    runs = []
    for schedule in SCHEDULES:
        for p in args.ps:
            for m in ms:
                run = run_on_fabric(schedule, p, m, device, dtype, rows, width, args.timeout,
                                    args.sleep_cycles)
                runs.append(run)
                print("  " + run.line(), flush=True)

    if cuda:
        print("[2] CUDA stream check", flush=True)
        try:
            stream_ok, stream_detail = stream_check(device, dtype)
        except Exception as exc:  # noqa: BLE001
            stream_ok, stream_detail = False, f"{type(exc).__name__}: {exc}"
        stream_status = "PASS" if stream_ok else "FAIL"
    else:
        stream_status, stream_detail = NOT_RUN, "device is cpu (no CUDA streams)"

    print("[3] real NCCL, 2 processes", flush=True)
    nccl = nccl_part(ms, rows if cuda else 64, width if cuda else 512, args.timeout,
                     args.no_nccl)
    for run in nccl.runs:
        print("  " + run.line(), flush=True)

    failed = [run for run in runs if not run.ok]
    print()
    print("=" * 100)
    print(f"GPU check summary: {header}")
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
    print(f"{stream_status:<5} CUDA stream check: {stream_detail}")
    if nccl.status == NOT_RUN:
        print(f"{NOT_RUN} real NCCL (multi-GPU) part: {nccl.detail}")
    else:
        nccl_bad = [r for r in nccl.runs if not r.ok]
        print(f"{nccl.status:<5} real NCCL (multi-GPU) part: {len(nccl.runs) - len(nccl_bad)} "
              f"of {len(nccl.runs)} runs with gradients equal to pp=1"
              + "".join(f"; FAILED {r.name} p={r.p} m={r.m}" for r in nccl_bad)
              + f"; {nccl.detail[:600]}")
    not_run = [label for label, status in (("CUDA stream check", stream_status),
                                           ("real NCCL part", nccl.status))
               if status == NOT_RUN]
    ok = not failed and stream_status != "FAIL" and nccl.status != "FAIL"
    ran = f"{NOT_RUN}: {', '.join(not_run)}" if not_run else "every part ran"
    print(f"RESULT: {'PASS' if ok else 'FAIL'} ({len(runs) - len(failed)} of {len(runs)} "
          f"fabric runs passed; {ran}) in {time.perf_counter() - started:.1f} s")
    return 0 if ok else 1


def merge_runs_ms(runs) -> str:
    merged: dict[str, list[float]] = {}
    for run in runs:
        for kind, values in run.ms_by_kind.items():
            merged.setdefault(kind, []).extend(values)
    return format_ms(merged) or "-"


if __name__ == "__main__":
    sys.exit(main())
