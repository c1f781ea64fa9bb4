"""The executor's own P2P program, recorded: each rank's executor runs once against a
recording transport on its NCCL code path, with work that computes nothing. This was the
lowering until ``analysis.program_pass`` derived the program from the action lists; it stays
here as the oracle that holds the pass to what the executor does
(``tests/test_lowering_pass.py``)."""

from __future__ import annotations

import torch

from megatron_pp_ext.analysis.messages import Message, call_name, sent_to_each_rank
from megatron_pp_ext.analysis.program_pass import op_label as _label
from megatron_pp_ext.analysis.program_pass import torch_op_name as _torch_name
from megatron_pp_ext.ir import Schedule
from megatron_pp_ext.program import RECV, SEND, Batch, Compute, P2POp, Post, Program, Wait
from megatron_pp_ext.runtime.executor import Executor

_TOKEN = torch.zeros(1)


class _Handle:
    def __init__(self, recorder: "_Recorder", batch: int, tensor=None):
        self.recorder, self.batch, self.tensor = recorder, batch, tensor

    def done(self) -> bool:  # never "already done": the executor then waits where it must
        return False

    def wait(self, timeout_s: float, poll: bool = False):
        self.recorder.steps.append(Wait(self.batch))
        return self.tensor


class _Recorder:
    """A transport on its NCCL code path that records instead of communicating."""

    poll = True  # NCCL: waits are polled, nothing is posted ahead
    prefetch_receives = False
    device = torch.device("cpu")

    def __init__(self, rank: int):
        self.rank, self.steps, self.batches = rank, [], 0
        self.labels: tuple = (None, None)  # (send message, receive message) of the next call

    def exchange(self, send, recv, variable_shapes: bool):
        send_handle, recv_handles = self.exchange_many(
            send, [recv] if recv is not None else [], variable_shapes)
        return send_handle, (recv_handles[0] if recv_handles else None)

    def exchange_many(self, send, recvs, variable_shapes: bool):
        send_message, recv_messages = self.labels
        name = call_name(send_message if send is not None else None, *recv_messages)
        if variable_shapes:
            # The transport's NCCL path: the shape headers in a batch of their own, waited
            # on (inside the call) before the payload batch is posted.
            header = self._post(self._ops(send, recvs, "shape of "), f"{name} (shapes)")
            self.steps.append(Wait(header, "the shape headers"))
        index = self._post(self._ops(send, recvs), name)
        return (_Handle(self, index) if send is not None else None,
                [_Handle(self, index, _TOKEN.clone()) for _ in recvs])

    def _ops(self, send, recvs, what: str = "") -> list[P2POp]:
        send_message, recv_messages = self.labels
        ops = []
        if send is not None:
            ops.append(P2POp(SEND, send[1], what + _label(send_message),
                             ("HEADER_" if what else "") + _torch_name(send_message, SEND)))
        ops.extend(P2POp(RECV, request.peer, what + _label(message),
                         ("HEADER_" if what else "") + _torch_name(message, RECV))
                   for request, message in zip(recvs, recv_messages))
        return ops

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


class _LabellingExecutor(Executor):
    def _post(self, send, send_message, recvs, time_post_only: bool = False):
        self.transport.labels = (send_message, list(recvs))
        return super()._post(send, send_message, recvs, time_post_only)




def executor_program(schedule: Schedule, postings: list | None = None, post_ahead: bool = False,
                     variable_shapes: bool = False) -> Program:
    """What each rank's executor posts and waits on for ``schedule`` on NCCL (``postings``:
    each rank's lockstep posting, or None for Megatron's fused calls)."""
    program = Program(f"the executor's postings of {schedule.name}")
    incoming = sent_to_each_rank(schedule)
    for rank in range(schedule.num_ranks):
        recorder = _Recorder(rank)
        _LabellingExecutor(schedule, rank, recorder, _NoWork(recorder), recv_shape=None,
                           dtype=torch.float32, device=torch.device("cpu"),
                           variable_shapes=variable_shapes, incoming=incoming[rank],
                           lockstep=postings[rank] if postings else None,
                           post_ahead=post_ahead).run()
        program.steps.append(recorder.steps)
    return program


__all__ = ["executor_program", "Message"]
