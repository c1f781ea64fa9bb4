"""The messages an action list implies: what each action receives and sends, Megatron's name
for each call, what every rank receives from each peer in its sending order, the lockstep
rounds, and the inbox that receives them in each sender's order. No torch: the lowering pass
(``analysis.program_pass``) and the executor both use them.

Communication is derived from the action list (the same rule the validator checks): an F on
stage s receives from the rank of stage s-1 and sends to the rank of stage s+1; a B or I
receives from the rank of stage s+1 and sends to the rank of stage s-1; W moves nothing.
Stages on the same rank hand tensors over locally (no message).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import NamedTuple

from ..ir import BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, Action, Schedule
from ..schedules.validate import execute_in_order

ACTIVATION, GRADIENT = "forward", "backward"  # what a message carries, in Megatron's words


class Message(NamedTuple):
    """One message, as the receiving side names it. A tuple: a program at p=64 hashes and
    compares some 10^6 of them (the lowering's inbox and ops), at C speed."""

    peer: int
    carries: str  # ACTIVATION or GRADIENT
    stage: int  # the stage that consumes it
    microbatch: int


@dataclass
class CommPlan:
    recv: Message | None  # what this action needs from another rank first
    send: Message | None  # what it produces for another rank


def comm_plan(schedule: Schedule, rank: int) -> list[CommPlan]:
    neighbours = schedule.neighbours()
    to_rank = schedule.stage_to_rank
    plans = []
    for action in schedule.actions[rank]:
        s, mb = action.stage, action.microbatch
        before, after = neighbours[s]
        remote_before = before is not None and to_rank[before] != rank
        remote_after = after is not None and to_rank[after] != rank
        recv = send = None
        if action.kind == FORWARD:
            if remote_before:
                recv = Message(to_rank[before], ACTIVATION, s, mb)
            if remote_after:
                send = Message(to_rank[after], ACTIVATION, after, mb)
        elif action.kind != BACKWARD_WEIGHT:
            if remote_after:
                recv = Message(to_rank[after], GRADIENT, s, mb)
            if remote_before:
                send = Message(to_rank[before], GRADIENT, before, mb)
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


def message_of(op) -> Message:
    """The message a program's op carries (``program.P2POp``: its label, ``forward 3F2``, is
    the activation for stage 3, microbatch 2; its peer is the other rank)."""
    carries, action = op.label.split()[-2:]
    parsed = Action.parse(action)
    return Message(op.peer, ACTIVATION if carries == ACTIVATION else GRADIENT, parsed.stage,
                   parsed.microbatch)


def call_name(sends: list[Message], recvs: list[Message]) -> str:
    """Megatron's name for sends and/or receives issued together (one batch)."""
    return "_".join([*(f"send_{m.carries}" for m in sends),
                     *(f"recv_{m.carries}" for m in recvs)])


def may_pair(first: Action, second: Action) -> bool:
    """Whether two actions in a row can run as DualPipe's overlapped F&B pair (one call): an
    F, then a B or I of another stage (another model chunk)."""
    return first.kind == FORWARD and second.kind in (BACKWARD, BACKWARD_INPUT) \
        and first.stage != second.stage


def incoming_messages(schedule: Schedule, rank: int) -> dict[int, list[Message]]:
    """Per peer, the messages it sends to ``rank``, in the order it sends them."""
    return sent_to_each_rank(schedule)[rank]


def sent_to_each_rank(schedule: Schedule, rounds: list[list[int]] | None = None,
                      plans: list[list[CommPlan]] | None = None) -> list[dict[int, list]]:
    """For every rank, per peer, the messages that peer sends it in sending order (one pass
    over every rank's plan); with ``rounds``, each as (round of its producer, message).
    ``plans``: every rank's ``comm_plan``, when the caller has them."""
    incoming: list[dict[int, list]] = [collections.defaultdict(list)
                                       for _ in range(schedule.num_ranks)]
    for peer in range(schedule.num_ranks):
        for i, plan in enumerate(plans[peer] if plans else comm_plan(schedule, peer)):
            if plan.send is not None:
                message = Message(peer, plan.send.carries, plan.send.stage, plan.send.microbatch)
                item = message if rounds is None else (rounds[peer][i], message)
                incoming[plan.send.peer][peer].append(item)
    return [dict(per_peer) for per_peer in incoming]


class Inbox:
    """Receives from each peer in the order that peer sends (every rank knows every action
    list), so two ranks never have to agree on one order; what arrives before it is
    needed waits in ``stash``. Receives in flight are kept per peer in posting order (one
    at a time, except where a lockstep program posts several ahead). The lowering pass walks
    a rank's program with it; the executor only runs the result."""

    def __init__(self, incoming: dict[int, list[Message]]):
        self.queues = {peer: collections.deque(msgs) for peer, msgs in incoming.items()}
        self.in_flight: dict[int, collections.deque] = collections.defaultdict(
            collections.deque)  # peer -> (message, where it was posted), oldest first
        self.stash: set[Message] = set()  # waited on before its action needs it

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
        """(message, where it was posted) of the oldest receive posted from ``peer``."""
        return self.in_flight[peer].popleft() if self.in_flight[peer] else None


@dataclass
class LockstepPosting:
    """When one rank posts which receives in a lockstep program (see ``lockstep_posting``):
    ``after[i]``: the receives posted in one batch with action i's send; ``before[i]``:
    receive-only batches posted before action i, one per round the rank sits idle;
    ``pairs``: the i whose action runs with action i + 1 as one F&B pair in one round (both
    sends then go in one batch, with ``after[i + 1]``)."""

    after: dict[int, list[Message]]
    before: dict[int, list[list[Message]]]
    pairs: frozenset[int] = frozenset()


def lockstep_rounds(schedule: Schedule, pairs: bool = False) -> list[list[int]]:
    """Per rank, the round of each action: its start when every action takes one round and
    a message arrives for the next round (a unit-cost run). A rank's rounds increase along
    its list, and a message's consumer runs in a later round than its producer. ``pairs``:
    an F and the B or I after it (``may_pair``) share a round where the B's input was
    produced before the F's round (DualPipe's overlapped pair: both inputs are received
    before it computes); ``paired_in`` tells which did."""
    free = [0] * schedule.num_ranks
    rounds: list[list[int]] = [[] for _ in range(schedule.num_ranks)]
    actions, paired = schedule.actions, [set() for _ in range(schedule.num_ranks)]

    def run(rank, action, dependency, ready_at):
        mine, i = rounds[rank], len(rounds[rank])
        start = max(free[rank], ready_at or 0)
        if pairs and i and (i - 2) not in paired[rank] and (ready_at or 0) <= mine[i - 1] \
                and may_pair(actions[rank][i - 1], action):
            start = mine[i - 1]
            paired[rank].add(i - 1)
        mine.append(start)
        free[rank] = start + 1
        return start + 1

    execute_in_order(schedule, run)
    return rounds


def paired_in(rounds: list[int]) -> frozenset[int]:
    """The i whose action shares its round with action i + 1 (``lockstep_rounds``' pairs)."""
    return frozenset(i for i in range(len(rounds) - 1) if rounds[i] == rounds[i + 1])


def lockstep_posting(schedule: Schedule, rank: int,
                     rounds: list[list[int]] | None = None) -> LockstepPosting:
    """Every message is sent and received in the batches of the round its producer ran in,
    and every rank posts its batches in round order: round t's batches only hold ops whose
    partners sit in the partners' round-t batches, so under NCCL's rules (rendezvous, one
    stream of batches per rank) round t completes once every rank has reached it, and no
    rank needs anything of round t or later to get there. Deadlock-free by induction. An F&B
    pair's round is one batch too: both sends and the round's receives, after the pair (its
    two inputs come from earlier rounds)."""
    return lockstep_postings(schedule, rounds)[rank]


def lockstep_postings(schedule: Schedule, rounds: list[list[int]] | None = None,
                      plans: list[list[CommPlan]] | None = None,
                      pairs: bool = False) -> list[LockstepPosting]:
    """``lockstep_posting`` of every rank, from one pass over the plans (``plans``: every
    rank's ``comm_plan``, when the caller has them; ``pairs``: ``lockstep_rounds``')."""
    rounds = rounds or lockstep_rounds(schedule, pairs)
    return [_posting(rounds[rank], per_peer)
            for rank, per_peer in enumerate(sent_to_each_rank(schedule, rounds, plans))]


def _posting(mine: list[int], per_peer: dict[int, list]) -> LockstepPosting:
    by_round: dict[int, list[Message]] = collections.defaultdict(list)
    for items in per_peer.values():
        for produced_in, message in items:
            by_round[produced_in].append(message)
    after, before, pairs = {}, {}, paired_in(mine)
    for i, t in enumerate(mine):
        earlier = mine[i - 1] if i else -1
        idle = [by_round[r] for r in range(earlier + 1, t) if by_round.get(r)]
        if idle:
            before[i] = idle
        if by_round.get(t) and i not in pairs:  # a pair's round: after its second action
            after[i] = by_round[t]
    return LockstepPosting(after, before, pairs)
