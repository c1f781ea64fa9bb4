"""Bench (c): what the Executor costs per action when the stages do nothing.

Three settings, each figure the median over repeated steps (every repeat kept, for the
spread), in microseconds per action, as wall time and (where one process runs it all) as CPU
time, which other work on a shared machine does not inflate:

* ``instant``: one rank's action list of a p-rank schedule, run alone against a transport
  whose sends complete at once and whose receives return a ready tensor: the executor's own
  bookkeeping (communication plan, inbox, stash, fused calls, held-activation count). This is
  the figure to hold against the 50 us target.
* ``in-memory``: every rank as a thread of one process over the in-memory transport
  (``run_ranks_in_threads``); wall time over the total actions of all ranks (the threads share
  one interpreter, so this is the CPU cost per action, queue hand-offs included).
* ``gloo``: p processes over TorchDistTransport; wall time over the actions of one rank. This
  includes gloo's latency on the critical path, so it is a bound, not the executor's cost.
"""

from __future__ import annotations

import gc
import statistics
import time

import torch

from megatron_pp_ext.schedules import build_schedule

SHAPE = (8, 64)


class NoopWork:
    """A StageWork that computes nothing: a ready tensor out, nothing else."""

    def __init__(self, schedule, rank):
        self.first = min(schedule.stages_of(rank)) == 0
        self.tensor = torch.zeros(SHAPE, dtype=torch.float64)

    def forward(self, action, input_tensor):
        return self.tensor

    def backward(self, action, output_grad):
        return None if action.stage == 0 else self.tensor

    def weight(self, action):
        return None

    def deallocate(self, output):
        return None


class _Done:
    def __init__(self, tensor=None):
        self.tensor = tensor

    def done(self):
        return True

    def wait(self, timeout_s, poll=False):
        return self.tensor


class InstantTransport:
    """Sends complete at once; a receive is a ready tensor."""

    poll = False
    device = torch.device("cpu")

    def __init__(self):
        self.tensor = torch.zeros(SHAPE, dtype=torch.float64)

    def exchange(self, send, recv, variable_shapes):
        return (_Done() if send is not None else None,
                _Done(self.tensor.clone()) if recv is not None else None)


def per_action(wall: list, cpu: list, actions: int) -> dict:
    """Medians and every repeat (for the spread), in microseconds per action."""
    return {"us_per_action": 1e6 * statistics.median(wall),
            "cpu_us_per_action": 1e6 * statistics.median(cpu), "actions": actions,
            "us_rounds": [1e6 * x for x in wall], "cpu_us_rounds": [1e6 * x for x in cpu]}


def _executor(schedule, rank, transport, steps: dict):
    """An executor for one step of ``schedule`` on ``rank``; ``steps`` keeps each rank's
    compiled steps, derived on the first call (untimed: every setting warms up first), as
    the drop-in derives them once per schedule, so no timed step pays the lowering."""
    from megatron_pp_ext.runtime.executor import Executor, steps_for

    work = NoopWork(schedule, rank)
    if rank not in steps:
        steps[rank] = steps_for(schedule, rank, transport, work)
    return Executor(schedule, rank, transport, work, recv_shape=SHAPE, dtype=torch.float64,
                    device=torch.device("cpu"), timeout_s=60, steps=steps[rank])


def instant(name: str, p: int, m: int, v: int, reps: int = 20) -> dict:
    schedule = build_schedule(name, p, m, v)
    actions = sum(len(row) for row in schedule.actions)
    wall, cpu, steps = [], [], {}
    for rank in range(p):  # warm-up
        _executor(schedule, rank, InstantTransport(), steps).run()
    for _ in range(reps):
        # as timeit does: the cyclic collector off while timing (collected before each
        # repeat), so one repeat that happens to run a full collection is not its figure
        gc.collect()
        gc.disable()
        try:
            start, start_cpu = time.perf_counter(), time.thread_time()
            for rank in range(p):
                _executor(schedule, rank, InstantTransport(), steps).run()
            cpu.append((time.thread_time() - start_cpu) / actions)
            wall.append((time.perf_counter() - start) / actions)
        finally:
            gc.enable()
    return per_action(wall, cpu, actions)


def in_memory(name: str, p: int, m: int, v: int, reps: int = 10) -> dict:
    from megatron_pp_ext.runtime.inmemory import run_ranks_in_threads

    schedule = build_schedule(name, p, m, v)
    actions = sum(len(row) for row in schedule.actions)
    wall, cpu, steps = [], [], {}
    run_ranks_in_threads(p, lambda rank, transport: _executor(schedule, rank, transport,
                                                              steps).run())
    for _ in range(reps):
        start, start_cpu = time.perf_counter(), time.process_time()
        run_ranks_in_threads(p, lambda rank, transport: _executor(schedule, rank, transport,
                                                                  steps).run())
        cpu.append((time.process_time() - start_cpu) / actions)
        wall.append((time.perf_counter() - start) / actions)
    return per_action(wall, cpu, actions)


def _gloo_tree(rank: int, world: int, cases, reps: int) -> dict:
    import torch.distributed as dist

    from megatron_pp_ext.runtime.transport import TorchDistTransport

    transport = TorchDistTransport(None)
    out = {}
    for name, m, v in cases:
        schedule = build_schedule(name, world, m, v)
        steps = {}
        _executor(schedule, rank, transport, steps).run()  # warm-up
        runs = []
        for _ in range(reps):
            dist.barrier()
            start = time.perf_counter()
            _executor(schedule, rank, transport, steps).run()
            runs.append((start, time.perf_counter()))
        out[(name, m, v)] = runs
    return out


def gloo(cases, p: int, reps: int = 10, timeout_s: float = 300) -> dict:
    from megatron_pp_ext.train.processes import spawn

    per_rank = spawn(p, _gloo_tree, list(cases), reps, timeout_s=timeout_s)
    out = {}
    for name, m, v in cases:
        schedule = build_schedule(name, p, m, v)
        per_rank_actions = max(len(row) for row in schedule.actions)
        walls = [max(e for _, e in run) - min(s for s, _ in run)
                 for run in zip(*(r[(name, m, v)] for r in per_rank))]
        out[(name, m, v)] = {"us_per_action": 1e6 * statistics.median(walls) / per_rank_actions,
                             "us_rounds": [1e6 * x / per_rank_actions for x in walls],
                             "actions_per_rank": per_rank_actions}
    return out


def run(quick: bool = False) -> list[dict]:
    cases = [("1f1b", 4, 32, 1), ("zb-h2", 4, 32, 1), ("zb-v", 4, 32, 2),
             ("interleaved", 4, 32, 2)]
    if not quick:
        cases += [("1f1b", 8, 64, 1), ("zb-v", 8, 64, 2)]
    rows = []
    for name, p, m, v in cases:
        rows.append({"schedule": name, "p": p, "m": m, "v": v, "mode": "instant",
                     **instant(name, p, m, v, reps=10 if quick else 20)})
        rows.append({"schedule": name, "p": p, "m": m, "v": v, "mode": "in-memory threads",
                     **in_memory(name, p, m, v, reps=5 if quick else 10)})
    gloo_cases = [(name, m, v) for name, p, m, v in cases if p == 4]
    for (name, m, v), result in gloo(gloo_cases, 4, reps=5 if quick else 10).items():
        rows.append({"schedule": name, "p": 4, "m": m, "v": v, "mode": "gloo processes",
                     "us_per_action": result["us_per_action"], "cpu_us_per_action": None,
                     "us_rounds": result["us_rounds"], "cpu_us_rounds": [],
                     "actions": result["actions_per_rank"]})
    return rows
