"""Zero-bubble schedules ZB-H1 and ZB-H2 (Qi et al., "Zero Bubble Pipeline Parallelism",
ICLR 2024), and the list scheduler they and ``zb-v`` are built with.

The backward of a stage is split into ``I`` (input gradient, sent upstream at once) and ``W``
(weight gradient, needed only by the optimizer). Running W's where 1F1B would wait is what
removes the bubble.

How the orders are made
-----------------------
``merge_streams`` plays all ranks together on unit-time slots (t_F = t_I = t_W = 1, no
communication time). Each rank owns a few *streams*, fixed sequences of F's or I's; at every
slot it runs, among the stream heads whose inputs have arrived and its oldest owed W, the one
its schedule prefers, within per-rank caps on what it holds. Here each stage's F's form one
stream and its I's another, both in microbatch order; W's run in the order of their I's. So
each channel carries one kind of message in microbatch order on both ends (the message-order
rule holds), and the lists come from an execution in which every action ran after its inputs
(no deadlock). Preference: F, then I, then W; a rank stops taking F's when a cap is reached.

Memory is counted per microbatch on a rank in two ways: its *full activation* is held from the
end of its F to the end of its I (what 1F1B holds until its B), and what its W still needs
(inputs and output gradients of the linear layers, smaller) from the end of its I to the end of
its W. The project's activation count (``schedules.validate.activation_trace``, the
simulator's ``Timeline.peak_activations``) runs from the end of the F to the end of the W, so
it includes both.

``zb-h1``
    Rank r holds at most ``p - r`` full activations (1F1B's count) and at most ``p``
    microbatches until their W: every rank keeps p in flight, as in the paper ("all workers
    maintain the same number of in-flight microbatches") and sail-sg's zb-h1 patch (rank r
    delays its W's by r). With equal costs and m >= p the makespan is ``3m + p - 1``: each
    rank idles p - 1 slots, a third of 1F1B's 3(p - 1) (t_B = t_I + t_W).
    Counting "F end to W end" against p - r would make this impossible: rank p-1 would have to
    run F, I, W strictly in turn, so its last I ends no earlier than 3m + p - 2 and the chain
    back to rank 0 gives a makespan of at least 3m + 2(p - 1), two thirds of 1F1B's bubble.
``zb-h2``
    Rank r holds at most ``2(p - r) - 1`` full activations (the forwards that fit before its
    first input gradient returns) and at most ``2p - 1`` microbatches until their W. With
    equal costs the makespan is ``3m + p - 1`` for m >= p, and for m >= 2p - 1 every rank is
    busy without a gap from its first action to its last (the paper's parallelogram). No
    schedule does better on one iteration: rank p-1 cannot start before slot p - 1, so p - 1
    idle slots per rank remain in the global window; ZB-H2 moves them out of every rank's own
    window (where ZB-H1 leaves p - 1 - r of them), which is what lets the next iteration start
    early when the optimizer step does not synchronise (the paper's post-validation).

``max_pending_backward`` (both): on every rank at most this many I's whose W has not run yet
(the runtime's deferred weight-gradient queue). The defaults, p for ``zb-h1`` and 2p - 1 for
``zb-h2``, equal the schedules' own bound on microbatches held until their W, so they never
bind; a smaller value flushes weight gradients sooner (less memory held for W's) at the cost of
some bubble. ``max_pending_backward=1`` runs every W before the next I.
"""

from __future__ import annotations

from collections import deque
from typing import Callable, Sequence

from ..ir import Action, Schedule, ScheduleError
from ._common import check_sizes, loop_placement, require

F, I, W = "F", "I", "W"


class StuckError(ScheduleError):
    """The list scheduler reached a state where no rank could run anything (internal)."""


class _ListScheduler:
    """The state of ``merge_streams``'s unit-time simulation: what has run and when, what each
    rank holds and owes, and the messages in flight on each channel."""

    def __init__(self, placement: tuple[int, ...], num_microbatches: int,
                 streams: Sequence[Sequence[Sequence[tuple[int, str]]]],
                 preference: Callable[[int, int, str, int], tuple],
                 live_cap: Sequence[int] | None, grad_cap: Sequence[int] | None,
                 pending_cap: Sequence[int] | None) -> None:
        self.placement, self.streams, self.preference = placement, streams, preference
        self.num_stages = len(placement)
        num_ranks = len(streams)
        unbounded = [self.num_stages * num_microbatches + 1] * num_ranks
        self.live_cap = list(live_cap) if live_cap is not None else unbounded
        self.grad_cap = list(grad_cap) if grad_cap is not None else unbounded
        self.pending_cap = list(pending_cap) if pending_cap is not None else unbounded

        self.finished: dict[tuple, int] = {}  # (stage, kind, microbatch) -> end slot
        self.issued: dict[tuple[int, str], int] = {}  # (stage, kind) -> microbatches run so far
        self.heads = [[0] * len(rank_streams) for rank_streams in streams]
        self.live = [0] * num_ranks
        self.pending: list[deque] = [deque() for _ in range(num_ranks)]  # W's owed, in I order
        self.channels: dict[tuple[int, int], deque] = {}  # (src, dst) -> messages not received
        self.rows: list[list[tuple]] = [[] for _ in range(num_ranks)]
        # every stream entry runs once, and every I owes one W
        self.total = sum(len(stream) for rank_streams in streams for stream in rank_streams)
        self.total += sum(1 for rank_streams in streams for stream in rank_streams
                          for _, kind in stream if kind == I)

    def arrived(self, message: tuple, src: int, dst: int, now: int) -> bool:
        """The message's sender finished before ``now`` and the message heads its channel."""
        if self.finished.get(message, now + 1) > now:
            return False
        if src == dst:
            return True
        queue = self.channels.get((src, dst))
        return bool(queue) and queue[0] == message

    def ready(self, rank: int, stage: int, kind: str, now: int) -> bool:
        """The next (stage, kind) may run on ``rank`` at ``now``: its inputs have arrived and
        running it keeps the rank within its caps."""
        mb = self.issued.get((stage, kind), 0)
        live, pending, placement = self.live, self.pending, self.placement
        if kind == F:
            if (live[rank] >= self.live_cap[rank]
                    or live[rank] - len(pending[rank]) >= self.grad_cap[rank]):
                return False
            return stage == 0 or self.arrived((stage - 1, F, mb), placement[stage - 1], rank, now)
        if (len(pending[rank]) >= self.pending_cap[rank]
                or self.finished.get((stage, F, mb), now + 1) > now):
            return False
        return stage == self.num_stages - 1 or self.arrived(
            (stage + 1, I, mb), placement[stage + 1], rank, now
        )

    def run(self, rank: int, action: tuple, now: int) -> None:
        """Run ``action`` on ``rank`` in slot ``now``: update what the rank holds and owes, take
        its input off its channel and put its output on the next one."""
        stage, kind, mb = action
        placement, num_stages = self.placement, self.num_stages
        if kind == W:
            self.pending[rank].popleft()
            self.live[rank] -= 1
        else:
            self.issued[(stage, kind)] = mb + 1
            if kind == F:
                self.live[rank] += 1
                receive_from, send_to = stage - 1, stage + 1
            else:
                self.pending[rank].append((stage, W, mb))
                receive_from, send_to = stage + 1, stage - 1
            if 0 <= receive_from < num_stages and placement[receive_from] != rank:
                self.channels[(placement[receive_from], rank)].popleft()
            if 0 <= send_to < num_stages and placement[send_to] != rank:
                self.channels.setdefault((rank, placement[send_to]), deque()).append(action)
        self.finished[action] = now + 1
        self.rows[rank].append(action)

    def options(self, rank: int, now: int) -> list[tuple]:
        """(preference, stream index or -1 for the owed W, action) for every action ``rank``
        could run at ``now``."""
        options = []
        for index, stream in enumerate(self.streams[rank]):
            if self.heads[rank][index] < len(stream):
                stage, kind = stream[self.heads[rank][index]]
                if self.ready(rank, stage, kind, now):
                    action = (stage, kind, self.issued.get((stage, kind), 0))
                    options.append((self.preference(rank, *action), index, action))
        pending = self.pending[rank]
        if pending:
            options.append((self.preference(rank, *pending[0]), -1, pending[0]))
        return options

    def play_slot(self, now: int) -> int:
        """Let every rank, in rank order, run its preferred option in slot ``now``; the number
        of actions run. What a rank runs in this slot is seen by the others from the next."""
        ran = 0
        for rank in range(len(self.streams)):
            options = self.options(rank, now)
            if options:
                _, index, action = min(options)
                if index >= 0:
                    self.heads[rank][index] += 1
                self.run(rank, action, now)
                ran += 1
        return ran

    def stuck(self, slot: int, done: int) -> StuckError:
        """The error for a slot in which no rank could run anything."""
        return StuckError(
            f"list scheduler stuck at slot {slot} after {done} of {self.total} actions "
            f"(live {self.live}, caps {self.live_cap}/{self.grad_cap}, "
            f"pending caps {self.pending_cap}); "
            "last actions per rank: "
            + "; ".join(" ".join(f"{s}{k}{j}" for s, k, j in row[-8:]) for row in self.rows)
        )


def merge_streams(
    stage_to_rank: Sequence[int],
    num_microbatches: int,
    streams: Sequence[Sequence[Sequence[tuple[int, str]]]],
    preference: Callable[[int, int, str, int], tuple],
    live_cap: Sequence[int] | None = None,
    grad_cap: Sequence[int] | None = None,
    pending_cap: Sequence[int] | None = None,
) -> list[list[Action]]:
    """Per-rank action lists from a greedy unit-time simulation of all ranks.

    ``streams[r]`` is rank r's list of streams: each a fixed sequence of ``(stage, kind)``
    (kind F or I) whose microbatches are numbered in order per (stage, kind). At every slot a
    rank may run the head of any stream whose inputs have arrived, or its oldest owed W; it
    runs the one with the smallest ``preference(rank, stage, kind, microbatch)``.

    Caps, per rank r, counting microbatch-stages:

    * ``live_cap[r]``: F run, W not yet (everything they hold);
    * ``grad_cap[r]``: F run, I not yet (the full activations an I still needs);
    * ``pending_cap[r]``: I run, W not yet (the deferred weight-gradient queue).

    A receive may only take the message at the head of its channel; streams that put one
    channel's messages in the same order on both of its ends never wait on that.
    Raises ``StuckError`` if every rank is left waiting forever.
    """
    state = _ListScheduler(tuple(stage_to_rank), num_microbatches, streams, preference,
                           live_cap, grad_cap, pending_cap)
    done, slot = 0, 0
    while done < state.total:
        ran = state.play_slot(slot)
        if not ran:  # every earlier action has ended: nothing will ever change
            raise state.stuck(slot, done)
        done += ran
        slot += 1
    return [[Action(*a) for a in row] for row in state.rows]


def kind_first(order: str, later_stage_first: bool = False) -> Callable[..., tuple]:
    """Preference by kind in the given order (e.g. 'FIW'), then by stage (the earlier one, or
    with ``later_stage_first`` the later one), then microbatch."""
    position = {kind: i for i, kind in enumerate(order)}
    sign = -1 if later_stage_first else 1
    return lambda _rank, stage, kind, mb: (position[kind], sign * stage, mb)


def pending_option(name: str, options: dict, default: int) -> int:
    value = options.get("max_pending_backward", None)
    if value is None:
        return default
    require(
        isinstance(value, int) and not isinstance(value, bool) and value >= 1,
        name,
        f"max_pending_backward={value!r} must be an integer >= 1 (it bounds the input-gradient "
        f"backwards whose weight gradient has not run yet); use 1 for the least memory or "
        f"leave it unset for the default {default}",
    )
    return value


def _build_loop(name: str, num_ranks: int, num_microbatches: int, forward_only: bool,
                live_cap: list[int], grad_cap: list[int], pending_cap: list[int],
                options: dict) -> Schedule:
    """One stage per rank; its F's and its I's are two streams, each in microbatch order."""
    placement = loop_placement(num_ranks, 1)
    m = num_microbatches
    if forward_only:  # inference frees each activation at once: no caps
        rows = [[Action(rank, F, mb) for mb in range(m)] for rank in range(num_ranks)]
    else:
        streams = [[[(rank, F)] * m, [(rank, I)] * m] for rank in range(num_ranks)]
        rows = merge_streams(placement, m, streams, kind_first("FIW"),
                             live_cap=live_cap, grad_cap=grad_cap, pending_cap=pending_cap)
    return Schedule(name, m, placement, rows, {**options, "forward_only": forward_only})


def _check_loop_chunks(name: str, chunks) -> None:
    require(chunks == 1, name,
            f"chunks v={chunks!r} is not allowed: {name} places one stage per rank (v = 1); "
            "use 'zb-v' for two chunks per rank")


def build_zb_h1(num_ranks: int, num_microbatches: int, chunks: int = 1,
                forward_only: bool = False, **options) -> Schedule:
    """ZB-H1: rank r holds at most p - r full activations (1F1B's), at most p microbatches
    until their W, at most ``max_pending_backward`` (default p) I's awaiting their W."""
    check_sizes("zb-h1", num_ranks, num_microbatches)
    _check_loop_chunks("zb-h1", chunks)
    p = num_ranks
    limit = pending_option("zb-h1", options, p)
    return _build_loop("zb-h1", p, num_microbatches, forward_only,
                       live_cap=[p] * p, grad_cap=[p - r for r in range(p)],
                       pending_cap=[limit] * p, options={"max_pending_backward": limit})


def build_zb_h2(num_ranks: int, num_microbatches: int, chunks: int = 1,
                forward_only: bool = False, **options) -> Schedule:
    """ZB-H2: rank r holds at most 2(p - r) - 1 full activations, at most 2p - 1 microbatches
    until their W, at most ``max_pending_backward`` (default 2p - 1) I's awaiting their W."""
    check_sizes("zb-h2", num_ranks, num_microbatches)
    _check_loop_chunks("zb-h2", chunks)
    p = num_ranks
    limit = pending_option("zb-h2", options, 2 * p - 1)
    return _build_loop("zb-h2", p, num_microbatches, forward_only,
                       live_cap=[2 * p - 1] * p, grad_cap=[2 * (p - r) - 1 for r in range(p)],
                       pending_cap=[limit] * p, options={"max_pending_backward": limit})
