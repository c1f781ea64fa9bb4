"""What the executor really posts and waits on, recorded: each rank's executor runs a given
program against a recording transport, with work that computes nothing, so the record can be
held to the program (``tests/test_lowering_pass.py``). The recorder takes the transport's
side of each call as ``runtime/transport.py`` does on NCCL: with variable shapes, the shape
headers in a batch of their own, waited on, before the payload's batch."""

from __future__ import annotations

import torch

from megatron_pp_ext.analysis.program_pass import op_label, torch_op_name
from megatron_pp_ext.ir import Schedule
from megatron_pp_ext.program import RECV, SEND, Batch, Compute, P2POp, Post, Program, Wait
from megatron_pp_ext.analysis.messages import message_of
from megatron_pp_ext.runtime.executor import Executor

_TOKEN = torch.zeros(1)


class _Handle:
    def __init__(self, recorder: "_Recorder", batch: int, op: int, tensor=None):
        self.recorder, self.batch, self.op, self.tensor = recorder, batch, op, tensor

    def done(self) -> bool:  # never "already done": the executor then waits where it says
        return False

    def wait(self, timeout_s: float, poll: bool = False):
        self.recorder.steps.append(Wait(self.batch, op=self.op))
        return self.tensor


class _Recorder:
    """A transport on NCCL's code path that records instead of communicating; it learns what
    each op carries from the program's own batches (``expect``), in posting order."""

    poll = True
    prefetch_receives = False
    batched = True
    device = torch.device("cpu")

    def __init__(self, rank: int, program: Program):
        self.rank, self.steps, self.batches = rank, [], 0
        self.expected = [b for b in program.batches(rank)]

    def exchange(self, send, recv, variable_shapes: bool):
        send_handles, recv_handles = self.exchange_many(
            [send] if send is not None else [], [recv] if recv is not None else [],
            variable_shapes)
        return (send_handles[0] if send_handles else None,
                recv_handles[0] if recv_handles else None)

    def exchange_many(self, sends, recvs, variable_shapes: bool):
        batch = self.expected.pop(0)  # what the executor was told to post here
        messages = [message_of(op) for op in batch.ops]
        sent = [m for op, m in zip(batch.ops, messages) if op.kind == SEND]
        received = [m for op, m in zip(batch.ops, messages) if op.kind == RECV]
        assert len(sends) == len(sent), (batch, sends)
        assert [r.peer for r in recvs] == [m.peer for m in received], (batch, recvs)
        if variable_shapes:
            header = self._post(self._ops(sent, received, "shape of "), f"{batch.call} (shapes)")
            self.steps.append(Wait(header, "the shape headers"))
        index = self._post(self._ops(sent, received), batch.call)
        return ([_Handle(self, index, k) for k in range(len(sends))],
                [_Handle(self, index, len(sends) + k, _TOKEN.clone())
                 for k in range(len(recvs))])

    @staticmethod
    def _ops(sent, received, what: str = "") -> list[P2POp]:
        prefix = "HEADER_" if what else ""
        return ([P2POp(SEND, m.peer, what + op_label(m), prefix + torch_op_name(m, SEND))
                 for m in sent]
                + [P2POp(RECV, m.peer, what + op_label(m), prefix + torch_op_name(m, RECV))
                   for m in received])

    def _post(self, ops: list[P2POp], call: str) -> int:
        index = self.batches
        self.batches += 1
        self.steps.append(Post(Batch(self.rank, index, ops, call)))
        return index


class _NoWork:
    def __init__(self, recorder: _Recorder):
        self.recorder = recorder

    def forward(self, action, input_tensor):
        self.recorder.steps.append(Compute(str(action)))
        return _TOKEN.clone()

    def backward(self, action, output_grad):
        self.recorder.steps.append(Compute(str(action)))
        return _TOKEN.clone()

    def weight(self, action):
        self.recorder.steps.append(Compute(str(action)))
        return None

    def deallocate(self, output) -> None:
        return None


class _PairingWork(_NoWork):
    def overlapped_forward_backward(self, f_action, f_input, b_action, b_grad):
        self.recorder.steps.append(Compute(str(f_action), paired=True))
        out = _TOKEN.clone()
        return out, self.backward(b_action, b_grad)


def executed_program(schedule: Schedule, program: Program, variable_shapes: bool = False,
                     pairs: bool = False) -> Program:
    """What each rank's executor posts, waits on and computes when it runs ``program`` (lowered
    without shape headers; ``variable_shapes``: the recorder adds them as the transport does;
    ``pairs``: the work computes an F&B pair in one call)."""
    record = Program(f"the executor running {program.name}")
    for rank in range(schedule.num_ranks):
        recorder = _Recorder(rank, program)
        work = (_PairingWork if pairs else _NoWork)(recorder)
        Executor(schedule, rank, recorder, work, recv_shape=None, dtype=torch.float32,
                 device=torch.device("cpu"), variable_shapes=variable_shapes,
                 program=program).run()
        record.steps.append(recorder.steps)
    return record


__all__ = ["executed_program"]
