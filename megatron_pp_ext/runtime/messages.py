"""The messages an action list implies, and the inbox that receives them in each sender's
order.

Communication is derived from the action list (the same rule the validator checks): an F on
stage s receives from the rank of stage s-1 and sends to the rank of stage s+1; a B or I
receives from the rank of stage s+1 and sends to the rank of stage s-1; W moves nothing.
Stages on the same rank hand tensors over locally (no message).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

import torch

from ..ir import BACKWARD_WEIGHT, FORWARD, Schedule

ACTIVATION, GRADIENT = "forward", "backward"  # what a message carries, in Megatron's words


@dataclass(frozen=True)
class Message:
    peer: int
    carries: str  # ACTIVATION or GRADIENT
    stage: int  # the stage that consumes it
    microbatch: int


@dataclass
class CommPlan:
    recv: Message | None  # what this action needs from another rank first
    send: Message | None  # what it produces for another rank


def comm_plan(schedule: Schedule, rank: int) -> list[CommPlan]:
    last = schedule.num_stages - 1
    plans = []
    for action in schedule.actions[rank]:
        s, mb = action.stage, action.microbatch
        recv = send = None
        if action.kind == FORWARD:
            if s > 0 and schedule.rank_of(s - 1) != rank:
                recv = Message(schedule.rank_of(s - 1), ACTIVATION, s, mb)
            if s < last and schedule.rank_of(s + 1) != rank:
                send = Message(schedule.rank_of(s + 1), ACTIVATION, s + 1, mb)
        elif action.kind != BACKWARD_WEIGHT:
            if s < last and schedule.rank_of(s + 1) != rank:
                recv = Message(schedule.rank_of(s + 1), GRADIENT, s, mb)
            if s > 0 and schedule.rank_of(s - 1) != rank:
                send = Message(schedule.rank_of(s - 1), GRADIENT, s - 1, mb)
        plans.append(CommPlan(recv, send))
    return plans


#: Megatron's P2PCommunicator timer for each of its calls (config.timers, log_level 2)
MEGATRON_TIMERS = {
    "send_forward": "forward-send", "recv_forward": "forward-recv",
    "send_backward": "backward-send", "recv_backward": "backward-recv",
    "send_forward_recv_backward": "forward-send-backward-recv",
    "send_backward_recv_forward": "backward-send-forward-recv",
    "send_forward_recv_forward": "forward-send-forward-recv",
    "send_backward_recv_backward": "backward-send-backward-recv",
}


def call_name(send: Message | None, recv: Message | None) -> str:
    """Megatron's name for a send and/or receive issued together."""
    parts = []
    if send is not None:
        parts.append(f"send_{send.carries}")
    if recv is not None:
        parts.append(f"recv_{recv.carries}")
    return "_".join(parts)


def incoming_messages(schedule: Schedule, rank: int) -> dict[int, list[Message]]:
    """Per peer, the messages it sends to ``rank``, in the order it sends them."""
    incoming: dict[int, list[Message]] = collections.defaultdict(list)
    for peer in range(schedule.num_ranks):
        if peer == rank:
            continue
        for plan in comm_plan(schedule, peer):
            if plan.send is not None and plan.send.peer == rank:
                incoming[peer].append(Message(peer, plan.send.carries, plan.send.stage,
                                              plan.send.microbatch))
    return dict(incoming)


class Inbox:
    """Receives from each peer in the order that peer sends (every rank knows every action
    list), so two ranks never have to agree on one order; what arrives before it is
    needed waits in ``stash``. At most one receive per peer is in flight."""

    def __init__(self, incoming: dict[int, list[Message]]):
        self.queues = {peer: collections.deque(msgs) for peer, msgs in incoming.items()}
        self.in_flight: dict[int, tuple[Message, object]] = {}
        self.stash: dict[Message, torch.Tensor] = {}

    def next_from(self, peer: int) -> Message:
        if not self.queues.get(peer):
            raise RuntimeError(
                f"a message from rank {peer} is needed, but its action list sends no further "
                "one: the ranks run inconsistent schedules (validate_schedule rejects this)")
        return self.queues[peer][0]

    def to_post(self, needed: Message) -> Message | None:
        """What to receive now so that ``needed`` comes next (None: nothing to post)."""
        if needed in self.stash or needed.peer in self.in_flight:
            return None
        return self.next_from(needed.peer)

    def posted(self, message: Message, handle) -> None:
        self.queues[message.peer].popleft()
        self.in_flight[message.peer] = (message, handle)
