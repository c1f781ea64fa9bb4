"""The GPU check's part 1: one step of a schedule over the in-memory fabric, checked against
the pp=1 run (the schedules, the gradient and loss comparison, and each run's result line).

**Every schedule over the in-memory NCCL-rules fabric** (``tests/support/nccl_fabric.py``:
rendezvous sends, one Work per batch, one stream of batches per rank, data visible only after
the wait), all 7 schedules at p = 2, 4 and m = 4, 8, every rank a thread of this process
running the real ``Executor`` (Megatron or lockstep posting, as on NCCL) with the toy autograd
stages (``tests/support/emulated.py``), whose weights, inputs, outputs and the fabric's copies
all live on ``--device``. Checked: each rank computed exactly its action list, in order, and
every stage's gradient and every loss equal the pp=1 run's on the same device and dtype (CPU:
float64, rtol = atol = 1e-12; CUDA: float32, rtol 1e-4, atol 1e-5, TF32 off: the pipeline sums
a weight's gradient over microbatches in its own order). Timing, per action kind (F, B, I, W):
CUDA events recorded before and after each action on the rank's stream (read after a
synchronize), or perf_counter on the CPU; and the step's wall time (threads started to device
synchronized). One GPU runs every rank: the event times include other ranks' kernels
interleaved on the GPU, and the toy stages are launch-bound, so these are a smoke check, not a
benchmark.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from bench.gpu_streams import CudaStreamFabric, rank_stream
from bench.gpu_timing import ActionTimer, TimedWork, format_ms, merge_ms
from megatron_pp_ext.analysis.lowering import nccl_choice
from megatron_pp_ext.runtime.executor import Executor
from megatron_pp_ext.runtime.inmemory import run_ranks_in_threads
from megatron_pp_ext.schedules import build_schedule
from support.emulated import microbatch_inputs, stage_weights
from support.inmemory import reference_gradients
from support.nccl_fabric import NcclRulesFabric

SCHEDULES = ["gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2", "zb-v", "dualpipev"]
TWO_CHUNKS = {"interleaved", "zb-v", "dualpipev"}
#: (rtol, atol) of the comparison with pp=1, by dtype
TOLERANCES = {torch.float64: (1e-12, 1e-12), torch.float32: (1e-4, 1e-5)}


def build(name: str, p: int, m: int):
    return build_schedule(name, p, m, chunks=2 if name in TWO_CHUNKS else 1)


def reference(num_stages: int, m: int, rows: int, width: int, device, dtype):
    """The unpipelined run on the same device and dtype (support.inmemory's)."""
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
                  cuda: bool | None = None, reference_fn=None) -> Run:
    """One step of ``name`` over the fabric, checked. ``cuda`` (default: the device's type)
    takes the CUDA path (streams, events, CudaStreamFabric); tests pass True on the CPU with
    a stand-in for torch.cuda, to run this path's logic where no GPU is. ``reference_fn``
    (default: ``reference``) gives the pp=1 run to compare with."""
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
        want, want_losses = (reference_fn or reference)(schedule.num_stages, m, rows, width,
                                                        device, dtype)
        run.grads_ok, run.losses_ok, run.max_err, problems = compare(
            grads, losses, want, want_losses, dtype, device)
        run.problems += problems
    except Exception as exc:  # noqa: BLE001 - reported as this run's failure
        run.problems.append(f"{type(exc).__name__}: {str(exc)[:600]}")
    return run
