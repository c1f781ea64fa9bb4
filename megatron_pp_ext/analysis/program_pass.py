"""One pass ``Schedule -> Program``: the P2P program the executor posts on NCCL, derived from
the action lists alone (no executor, no torch), in time linear in the number of actions.

Per rank it walks the action list as the executor does on its NCCL path (every call one batch,
no receive posted ahead unless ``post_ahead``), with the same inbox rule (a peer's messages are
received in the order that peer sends them):

- before action i: with a lockstep posting, its receive-only batches for the rounds the rank
  sits idle (``LockstepPosting.before[i]``);
- the action's input: posted now if no receive from that peer is in flight, then waited on
  (earlier messages from the same peer are waited on first and held);
- a B or I waits first for the send of the activation it consumes the gradient of
  (Megatron's ``deallocate_output_tensor`` frees it only once sent);
- ``post_ahead``: the next action's receive, when it will not go fused with this action's
  send, is posted before this action computes;
- the action computes;
- its send goes in one batch with the next action's receive when they go opposite ways
  (Megatron's ``send_forward_recv_backward`` / ``send_backward_recv_forward``), or, with a
  lockstep posting, with the receives of its round (``LockstepPosting.after[i]``);
- at the end of the step, every send not yet waited on is waited on.

``variable_shapes``: each call first exchanges its shape headers in a batch of its own and
waits on it (the transport's NCCL path). ``tests/test_lowering_pass.py`` holds this pass to
the executor's own postings, batch for batch, over every schedule and size of the fabric tests.
"""

from __future__ import annotations

from ..ir import FORWARD, Schedule
from ..program import RECV, SEND, Batch, Compute, P2POp, Post, Program, Wait
from .messages import (ACTIVATION, CommPlan, Inbox, LockstepPosting, Message, call_name,
                       comm_plan, sent_to_each_rank)


def op_label(message: Message) -> str:
    """What an op carries, the same text on both sides, e.g. ``forward 3F2``."""
    kind = "F" if message.carries == ACTIVATION else "B"
    return f"{message.carries} {message.stage}{kind}{message.microbatch}"


def torch_op_name(message: Message, kind: str) -> str:
    """torch.distributed.pipelining's name of one side: SEND_F/SEND_B name the sending
    stage, RECV_F/RECV_B the receiving one (``message.stage`` is the receiving stage)."""
    forward = message.carries == ACTIVATION
    stage = message.stage
    if kind == SEND:
        stage += -1 if forward else 1
    return f"{stage}{kind.upper()}_{'F' if forward else 'B'}{message.microbatch}"


class _RankPass:
    """One rank's walk; ``steps`` is its part of the program."""

    def __init__(self, schedule: Schedule, rank: int, plans: list[CommPlan],
                 incoming: dict[int, list[Message]], lockstep: LockstepPosting | None,
                 post_ahead: bool, variable_shapes: bool):
        self.rank = rank
        self.actions = schedule.actions[rank]
        self.plans = plans
        self.lockstep = lockstep
        self.post_ahead = post_ahead and lockstep is None
        self.variable_shapes = variable_shapes
        self.inbox = Inbox(incoming)  # the executor's: a receive in flight is its batch
        self.unsent: dict[int, Message] = {}  # batch of an unwaited send -> its message
        self.unsent_activation: dict[tuple[int, int], int] = {}  # (stage, mb) -> batch
        self.steps: list = []
        self.batches = 0

    # ---------------------------------------------------------------- posting and waiting
    def _batch(self, ops: list[P2POp], call: str) -> int:
        index = self.batches
        self.batches += 1
        self.steps.append(Post(Batch(self.rank, index, ops, call)))
        return index

    def _ops(self, send: Message | None, recvs: list[Message], header: bool) -> list[P2POp]:
        what, prefix = ("shape of ", "HEADER_") if header else ("", "")
        ops = []
        if send is not None:
            ops.append(P2POp(SEND, send.peer, what + op_label(send),
                             prefix + torch_op_name(send, SEND)))
        ops.extend(P2POp(RECV, m.peer, what + op_label(m), prefix + torch_op_name(m, RECV))
                   for m in recvs)
        return ops

    def _post(self, send: Message | None, recvs: list[Message]) -> None:
        if send is None and not recvs:
            return
        name = call_name(send, *recvs)
        if self.variable_shapes:
            header = self._batch(self._ops(send, recvs, True), f"{name} (shapes)")
            self.steps.append(Wait(header, "the shape headers"))
        index = self._batch(self._ops(send, recvs, False), name)
        for message in recvs:
            self.inbox.posted(message, index)
        if send is not None:
            self.unsent[index] = send
            if send.carries == ACTIVATION:
                self.unsent_activation[(send.stage, send.microbatch)] = index

    def _take(self, needed: Message) -> None:
        inbox = self.inbox
        while needed not in inbox.stash:
            if not inbox.in_flight[needed.peer]:
                self._post(None, [inbox.next_from(needed.peer)])
            message, index = inbox.oldest_in_flight(needed.peer)
            self.steps.append(Wait(index))
            inbox.stash[message] = None
        del inbox.stash[needed]

    def _finish_send(self, index: int) -> None:
        message = self.unsent.pop(index)
        if message.carries == ACTIVATION:
            self.unsent_activation.pop((message.stage, message.microbatch), None)
        self.steps.append(Wait(index))

    # ---------------------------------------------------------------- the walk
    def run(self) -> list:
        n = len(self.actions)
        for i, action in enumerate(self.actions):
            if self.lockstep is not None:
                for messages in self.lockstep.before.get(i, ()):
                    self._post(None, list(messages))
            plan = self.plans[i]
            if plan.recv is not None:
                self._take(plan.recv)
            if action.kind != FORWARD:  # its activation's send, before that output is freed
                index = self.unsent_activation.get((action.stage + 1, action.microbatch))
                if index is not None:
                    self._finish_send(index)
            if self.post_ahead and i + 1 < n:
                needed = self.plans[i + 1].recv
                if needed is not None and (plan.send is None
                                           or plan.send.carries == needed.carries):
                    early = self.inbox.to_post(needed)
                    if early is not None:
                        self._post(None, [early])
            self.steps.append(Compute(str(action)))
            if self.lockstep is not None:
                self._post(plan.send, list(self.lockstep.after.get(i, [])))
                continue
            next_recv = self.plans[i + 1].recv if i + 1 < n else None
            fused = None
            if plan.send is not None and next_recv is not None \
                    and next_recv.carries != plan.send.carries:
                fused = self.inbox.to_post(next_recv)
            self._post(plan.send, [fused] if fused is not None else [])
        for index in list(self.unsent):
            self._finish_send(index)
        if self.inbox.stash:
            raise RuntimeError(
                f"rank {self.rank}: messages were left unconsumed at the end of the step: "
                f"{sorted(map(str, self.inbox.stash))} (the schedule lacks their consumers)")
        return self.steps


def lower_program(schedule: Schedule, name: str, postings: list | None = None,
                  post_ahead: bool = False, variable_shapes: bool = False) -> Program:
    """The program (see the module docstring); ``postings``: each rank's lockstep posting, or
    None for Megatron's fused calls."""
    plans = [comm_plan(schedule, rank) for rank in range(schedule.num_ranks)]
    incoming = sent_to_each_rank(schedule, plans=plans)
    program = Program(name)
    for rank in range(schedule.num_ranks):
        program.steps.append(_RankPass(
            schedule, rank, plans[rank], incoming[rank], postings[rank] if postings else None,
            post_ahead, variable_shapes).run())
    return program
