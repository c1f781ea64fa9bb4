"""Run a schedule on the in-memory transport with the emulated (toy autograd) stages."""

from __future__ import annotations

import torch

from support.emulated import (
    EmulatedCosts,
    EmulatedStageWork,
    microbatch_inputs,
    stage_weights,
)
from megatron_pp_ext.integration.stage_copies import sum_stage_copies
from megatron_pp_ext.runtime.executor import Executor, program_for
from megatron_pp_ext.runtime.inmemory import run_ranks_in_threads
from megatron_pp_ext.runtime.transport import InMemoryTransport
from support.nccl_fabric import NcclRulesFabric, NcclRulesTransport

WIDTH, ROWS = 6, 3


class RecordingWork(EmulatedStageWork):
    """Emulated stages that also record the order in which actions were really computed."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.computed: list[str] = []

    def forward(self, action, input_tensor):
        self.computed.append(str(action))
        return super().forward(action, input_tensor)

    def backward(self, action, output_grad):
        self.computed.append(str(action))
        return super().backward(action, output_grad)

    def weight(self, action):
        self.computed.append(str(action))
        return super().weight(action)


class PairingWork(RecordingWork):
    """A model that offers DualPipe's overlapped F&B pair in one call (``pairs`` records each
    as ``"F+B"``); computed one after the other, which is what the arithmetic needs."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.pairs: list[str] = []

    def overlapped_forward_backward(self, f_action, f_input, b_action, b_grad):
        self.pairs.append(f"{f_action}+{b_action}")
        return self.forward(f_action, f_input), self.backward(b_action, b_grad)


def run_inmemory(schedule, delays=None, costs: EmulatedCosts | None = None, timeout_s=20.0,
                 trace=False, nccl_rules=False, variable_shapes=False, timers=None,
                 fabric: NcclRulesFabric | None = None, program=None, pairs=False,
                 memory: bool = False, sum_copies: bool = False):
    """Returns per rank: (StepResult, RecordingWork). ``nccl_rules``: over the fabric that
    enforces NCCL's rules (support.nccl_fabric; pass ``fabric`` to read what was posted),
    posting as the executor does on NCCL. ``timers``: one Megatron ``Timers`` per rank (a
    process has its own; threads must not share one). ``program``: the one every rank runs,
    when the caller has it (else the one ``executor.program_for`` would pick). ``pairs``: the
    stages compute DualPipe's F&B pairs in one call (``PairingWork``). ``memory``: measure
    activation bytes (``StepResult.peak_bytes``; off by default, as in the package: the
    autograd walk after every F costs a quarter of such a run's CPU). ``sum_copies``: after
    the step, dualpipe's pair exchange (``stage_copies.sum_stage_copies``, the drop-in's) over
    the same transport gives both copies of each part the summed gradient."""
    work_class = PairingWork if pairs else RecordingWork
    weights = stage_weights(schedule.model_stages, WIDTH)
    inputs = microbatch_inputs(schedule.num_microbatches, ROWS, WIDTH)
    if nccl_rules:
        fabric = fabric or NcclRulesFabric(schedule.num_ranks)
    # what every rank's executor would pick for its transport, lowered once for all of them
    # (the transport and work classes say what the instances would: on the fabric, batched,
    # the checked NCCL program)
    program = program or program_for(
        schedule, NcclRulesTransport if nccl_rules else InMemoryTransport, work_class,
        timers[0] if timers else None, variable_shapes)

    def rank_fn(rank, transport):
        delay = delays[rank] if delays else 0.0
        work = work_class(schedule, rank, weights, inputs, costs=costs, delay=delay)
        executor = Executor(schedule, rank, transport, work, recv_shape=(ROWS, WIDTH),
                            dtype=torch.float64, device=torch.device("cpu"),
                            timeout_s=timeout_s, trace=trace, variable_shapes=variable_shapes,
                            timers=timers[rank] if timers else None, memory=memory,
                            program=program)
        result = executor.run()
        if sum_copies:
            chunks = [_Chunk(work.params[stage]) for stage in schedule.stages_of(rank)]
            sum_stage_copies(chunks, schedule, rank, transport, timeout_s)
        return result, work

    return run_ranks_in_threads(schedule.num_ranks, rank_fn, timeout_s=timeout_s + 10,
                                fabric=fabric)


class _Chunk:
    """A model chunk as ``stage_copies.gradient_tensors`` reads one: its parameters' grads."""

    def __init__(self, weight):
        self.weight = weight

    def parameters(self):
        return [self.weight]


def reference_gradients(num_stages: int, num_microbatches: int, rows: int = ROWS,
                        width: int = WIDTH, device=None, dtype=torch.float64):
    """The unpipelined run (pp = 1): every stage in sequence, same weights and data."""
    weights = [w.clone().requires_grad_(True)
               for w in stage_weights(num_stages, width, device=device, dtype=dtype)]
    losses = []
    for x in microbatch_inputs(num_microbatches, rows, width, device=device, dtype=dtype):
        for w in weights:
            x = torch.tanh(x @ w)
        loss = x.sum() / num_microbatches
        loss.backward()
        losses.append(float(loss.detach()))
    return {s: w.grad for s, w in enumerate(weights)}, losses


def assert_equals_pp1(results, schedule, where: str = "") -> None:
    """Every stage's gradient and every microbatch's loss of an in-memory run equal the pp=1
    run's (float64: to 1e-12)."""
    grads, losses = gathered(results, schedule)
    m = schedule.num_microbatches
    want, want_losses = reference_gradients(schedule.model_stages, m)
    assert sorted(grads) == sorted(want), where
    for stage, grad in want.items():
        torch.testing.assert_close(grads[stage], grad, rtol=1e-12, atol=1e-12,
                                   msg=lambda text: f"{where} stage {stage}: {text}")
    got = [float(losses[mb]) for mb in range(m)]
    assert all(abs(a - b) <= 1e-12 * max(1.0, abs(b)) for a, b in zip(got, want_losses)), \
        (where, got, want_losses)


def gathered(results, schedule=None):
    """Every stage's gradient and every microbatch's loss; with ``schedule`` the gradients
    are per model part, a dualpipe part's two copies summed (what the drop-in's sum does; a
    copy no microbatch crossed, dualpipe's second direction at m = 1, has none to add)."""
    grads, losses = {}, {}
    for _result, work in results:
        for stage, grad in work.gradients().items():
            if grad is None and schedule is not None:
                continue
            part = stage if schedule is None else schedule.model_stage(stage)
            grads[part] = grad if part not in grads else grads[part] + grad
        losses.update(work.losses)
    return grads, losses
