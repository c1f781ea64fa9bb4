"""The inbox that receives the messages an action list implies (``analysis.messages``) in
each sender's order."""

from __future__ import annotations

import collections

import torch

from ..analysis.messages import (  # the message vocabulary, read from here too
    ACTIVATION,
    GRADIENT,
    MEGATRON_TIMERS,
    CommPlan,
    LockstepPosting,
    Message,
    call_name,
    comm_plan,
    incoming_messages,
    lockstep_posting,
    lockstep_postings,
    lockstep_rounds,
    sent_to_each_rank,
)

__all__ = ["ACTIVATION", "GRADIENT", "MEGATRON_TIMERS", "CommPlan", "Inbox", "LockstepPosting",
           "Message", "call_name", "comm_plan", "incoming_messages", "lockstep_posting",
           "lockstep_postings", "lockstep_rounds", "sent_to_each_rank"]


class Inbox:
    """Receives from each peer in the order that peer sends (every rank knows every action
    list), so two ranks never have to agree on one order; what arrives before it is
    needed waits in ``stash``. Receives in flight are kept per peer in posting order (one
    at a time, except where a lockstep program posts several ahead)."""

    def __init__(self, incoming: dict[int, list[Message]]):
        self.queues = {peer: collections.deque(msgs) for peer, msgs in incoming.items()}
        self.in_flight: dict[int, collections.deque] = collections.defaultdict(
            collections.deque)  # peer -> (message, handle), oldest first
        self.stash: dict[Message, torch.Tensor] = {}

    def next_from(self, peer: int) -> Message:
        if not self.queues.get(peer):
            raise RuntimeError(
                f"a message from rank {peer} is needed, but its action list sends no further "
                "one: the ranks run inconsistent schedules (validate_schedule rejects this)")
        return self.queues[peer][0]

    def to_post(self, needed: Message) -> Message | None:
        """What to receive now so that ``needed`` comes next (None: nothing to post)."""
        if needed in self.stash or self.in_flight[needed.peer]:
            return None
        return self.next_from(needed.peer)

    def posted(self, message: Message, handle) -> None:
        if self.next_from(message.peer) != message:
            raise RuntimeError(f"receive of {message} posted out of rank {message.peer}'s "
                               "sending order")
        self.queues[message.peer].popleft()
        self.in_flight[message.peer].append((message, handle))

    def oldest_in_flight(self, peer: int):
        """(message, handle) of the oldest receive posted from ``peer`` (None: none)."""
        return self.in_flight[peer].popleft() if self.in_flight[peer] else None

    def stash_tensors(self) -> list:
        """The tensors that arrived early and wait in the stash (activation memory)."""
        return list(self.stash.values())

    def stash_bytes(self) -> int:
        """Bytes of the stash's unique storages (``runtime.memory``)."""
        from .memory import unique_bytes

        return unique_bytes(self.stash.values())
