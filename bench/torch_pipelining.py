"""Bench (a)'s PyTorch rows: ``torch.distributed.pipelining`` on the same emulated device.

Each rank builds ``PipelineStage``s over :class:`SleepChunk` modules and runs one of torch's
schedule classes on the default (gloo) group, in the same process tree and rounds as the
plugin's and Megatron's schedules (``bench.emulated_device.tree``).

A chunk costs what the plugin's stages cost: t/v forward, t/v for the input-gradient half
of its backward, t/v for the weight-gradient half. The two halves are two nodes of one
autograd Function (``y = _Lasting(x, t_i) + _Lasting(w, t_w)``), so torch's own split
(``stage_backward_input`` / ``stage_backward_weight`` in ``pipelining/_backward.py``) runs
exactly one of them in each half: its I asks autograd for the input's gradient only (the
activation path runs, t_I), its W starts again from the sum's node and reaches the weight
only (the weight path runs, t_W). A full backward runs both (t_I + t_W).

    .venv/bin/python -m bench.torch_pipelining   # one chunk's F, I, W and full backward
                                                 # alone, then every action of each schedule
"""

from __future__ import annotations

import time

import torch

# (label, torch schedule name for get_schedule_class, v, layout). "loop": rank r holds
# stages r, r + p, ...; "v": rank r holds stages r and 2p - 1 - r.
TORCH = [("torch 1F1B", "1F1B", 1, "loop"),
         ("torch Interleaved1F1B v=2", "Interleaved1F1B", 2, "loop"),
         ("torch InterleavedZeroBubble v=2", "InterleavedZeroBubble", 2, "loop"),
         ("torch ZBVZeroBubble", "ZBVZeroBubble", 2, "v"),
         ("torch DualPipeV", "DualPipeV", 2, "v")]


def _device_clock():
    from bench.emulated_device import DeviceClock  # one emulation for every runtime

    return DeviceClock


class _Lasting(torch.autograd.Function):
    """Identity; its backward lasts ``cost``. A chunk has two: on the activation's path (its
    backward is the input-gradient half, t_i) and on the weight's (the weight-gradient half,
    t_w)."""

    @staticmethod
    def forward(ctx, x, cost: float):
        ctx.cost = cost
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        start = time.perf_counter()
        out = grad.clone()
        _device_clock().wait_until(start + ctx.cost)
        return out, None


class SleepChunk(torch.nn.Module):
    """One chunk: ``y = x + w``, a forward of t_f, the activation and the weight reaching
    ``y`` through separate Functions (the backward halves, t_i and t_w)."""

    def __init__(self, t_f: float, t_i: float, t_w: float, first: bool):
        super().__init__()
        self.t_f, self.t_i, self.t_w, self.first = t_f, t_i, t_w, first
        self.weight = torch.nn.Parameter(torch.zeros(1, dtype=torch.float64))

    def forward(self, x):
        start = time.perf_counter()
        if self.first:
            # The data needs no gradient, but a real first stage's layers still backpropagate
            # through their activations: keep the activation path (t_i) in the graph.
            x = x.detach().requires_grad_()
        y = _Lasting.apply(x, self.t_i) + _Lasting.apply(self.weight, self.t_w)
        _device_clock().wait_until(start + self.t_f)
        return y


def loss_fn(output, target=None):
    return output.sum()


def stage_indices(rank: int, p: int, v: int, layout: str) -> list[int]:
    if layout == "v":
        return [rank, 2 * p - 1 - rank]
    return [rank + c * p for c in range(v)]


def schedule_class(name: str):
    """Torch's class for ``name`` (a ValueError where this torch has none)."""
    from torch.distributed.pipelining.schedules import get_schedule_class

    return get_schedule_class(name)


def make_stage(index: int, num_stages: int, cost: float, rows: int, width: int):
    """A ``PipelineStage`` with static shapes (no metadata exchange in the steps). A received
    activation needs a gradient (torch takes ``requires_grad`` from the example), the data
    does not."""
    from torch.distributed.pipelining import PipelineStage

    example = torch.empty(rows, width, dtype=torch.float64)
    received = example.clone().requires_grad_(index > 0)
    return PipelineStage(SleepChunk(cost, cost, cost, first=(index == 0)), index, num_stages,
                         torch.device("cpu"), input_args=(received,),
                         output_args=(example.clone().requires_grad_(),))


class TorchRunner:
    """One rank's stages and schedule object for one (label, m); ``step()`` runs one step."""

    def __init__(self, label: str, rank: int, p: int, m: int, t: float, rows: int,
                 width: int):
        _, name, v, layout = next(row for row in TORCH if row[0] == label)
        self.stages = [make_stage(s, p * v, t / v, rows, width)
                       for s in stage_indices(rank, p, v, layout)]
        stages = self.stages[0] if v == 1 else self.stages  # single-stage classes take one
        self.schedule = schedule_class(name)(stages, n_microbatches=m, loss_fn=loss_fn)
        self.first = any(stage.is_first for stage in self.stages)
        self.last = any(stage.is_last for stage in self.stages)
        self.batch = torch.ones(m * rows, width, dtype=torch.float64)  # split into m
        self.target = torch.zeros(m)  # torch indexes one per microbatch; loss_fn ignores it

    def step(self) -> None:
        args = (self.batch,) if self.first else ()
        kwargs = {"target": self.target} if self.last else {}
        self.schedule.step(*args, **kwargs)
        for stage in self.stages:
            stage.submod.weight.grad = None


def runner_or_error(label: str, rank: int, p: int, m: int, t: float, rows: int, width: int):
    """A ``TorchRunner``, or the exception's text where torch refuses the configuration
    (e.g. DualPipeV with fewer microbatches than stages)."""
    try:
        return TorchRunner(label, rank, p, m, t, rows, width), None
    except (ValueError, RuntimeError, AssertionError, NotImplementedError) as error:
        return None, f"{type(error).__name__}: {error}"


# ------------------------------------------------------------------ the split, timed alone
def time_split(t: float = 0.020, v: int = 2, rows: int = 8, width: int = 64,
               repeats: int = 5) -> dict:
    """One middle chunk's forward, torch's ``stage_backward_input``, ``stage_backward_weight``
    and full ``stage_backward`` (the calls a ``PipelineStage`` makes), each timed alone, in
    ms, median of ``repeats``. Expected: t/v for F, I and W, 2t/v for the full backward."""
    import statistics

    from torch.distributed.pipelining._backward import (
        stage_backward, stage_backward_input, stage_backward_weight)

    chunk = SleepChunk(t / v, t / v, t / v, first=False)
    times = {"F": [], "I": [], "W": [], "full": []}

    def timed(kind, call):
        start = time.perf_counter()
        result = call()
        times[kind].append(1e3 * (time.perf_counter() - start))
        return result

    for _ in range(repeats):
        for split in (True, False):
            x = torch.ones(rows, width, dtype=torch.float64, requires_grad=True)
            y = timed("F", lambda: chunk(x))
            grad = torch.ones_like(y)
            if split:
                _, groups = timed("I", lambda: stage_backward_input(
                    [y], [grad], [x], iter(chunk.parameters())))
                timed("W", lambda: stage_backward_weight(iter(chunk.parameters()), groups))
            else:
                timed("full", lambda: stage_backward((y,), (grad,), [x]))
    return {kind: statistics.median(values) for kind, values in times.items()}


def timed_actions(stage) -> list:
    """Wrap a stage's compute calls so each records (stage, kind, ms): F, I (the input half,
    ``full_backward=False``), B (a full backward) and W. The schedules wait for their
    receives outside these calls, so the times are the compute alone."""
    records = []

    def wrap(name, kind_of):
        method = getattr(stage, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            result = method(*args, **kwargs)
            records.append((stage.stage_index, kind_of(kwargs),
                            1e3 * (time.perf_counter() - start)))
            return result

        setattr(stage, name, timed)

    wrap("forward_one_chunk", lambda kwargs: "F")
    wrap("backward_one_chunk", lambda kwargs: "B" if kwargs.get("full_backward", True) else "I")
    wrap("backward_weight_one_chunk", lambda kwargs: "W")
    return records


def action_tree(rank: int, world: int, label: str, m: int, t: float) -> list:
    """Spawn target: one warm-up step, then one step with every compute action timed."""
    import torch.distributed as dist

    runner = TorchRunner(label, rank, world, m, t, 8, 64)
    runner.step()
    per_stage = [timed_actions(stage) for stage in runner.stages]
    dist.barrier()
    runner.step()
    dist.barrier()
    return [record for records in per_stage for record in records]


def action_summary(label: str, p: int = 4, m: int = 8, t: float = 0.020) -> dict:
    """(first stage or not, kind) -> (count, median ms) of one timed step at (p, m)."""
    import statistics

    from megatron_pp_ext.train.processes import spawn

    per_rank = spawn(p, action_tree, label, m, t, timeout_s=300)
    groups: dict = {}
    for stage, kind, ms in (x for records in per_rank for x in records):
        groups.setdefault(("stage 0" if stage == 0 else "other stages", kind), []).append(ms)
    return {key: (len(v), statistics.median(v)) for key, v in sorted(groups.items())}


if __name__ == "__main__":
    result = time_split()
    print("one chunk (t = 20 ms, v = 2: t/v = 10 ms), median of 5, ms: " +
          ", ".join(f"{kind} {ms:.2f}" for kind, ms in result.items()))
    for label, _, v, _ in TORCH:
        summary = action_summary(label)
        print(f"{label} at p=4, m=8 (a chunk: {20 / v:g} ms), one step, count x median ms: " +
              ", ".join(f"{where} {kind} {n} x {ms:.2f}"
                        for (where, kind), (n, ms) in summary.items()))
