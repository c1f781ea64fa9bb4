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
    placement = tuple(stage_to_rank)
    num_stages, m = len(placement), num_microbatches
    num_ranks = len(streams)
    unbounded = [num_stages * m + 1] * num_ranks
    live_cap = list(live_cap) if live_cap is not None else unbounded
    grad_cap = list(grad_cap) if grad_cap is not None else unbounded
    pending_cap = list(pending_cap) if pending_cap is not None else unbounded

    finished: dict[tuple, int] = {}  # (stage, kind, microbatch) -> end slot
    issued: dict[tuple[int, str], int] = {}  # (stage, kind) -> microbatches run so far
    heads = [[0] * len(rank_streams) for rank_streams in streams]
    live = [0] * num_ranks
    pending: list[deque] = [deque() for _ in range(num_ranks)]  # W's owed, in I order
    channels: dict[tuple[int, int], deque] = {}  # (src, dst) -> messages not yet received
    rows: list[list[tuple]] = [[] for _ in range(num_ranks)]
    total = sum(len(stream) for rank_streams in streams for stream in rank_streams)
    total += sum(1 for rank_streams in streams for stream in rank_streams
                 for _, kind in stream if kind == I)

    def arrived(message: tuple, src: int, dst: int, now: int) -> bool:
        """The message's sender finished before ``now`` and the message heads its channel."""
        if finished.get(message, now + 1) > now:
            return False
        if src == dst:
            return True
        queue = channels.get((src, dst))
        return bool(queue) and queue[0] == message

    def ready(rank: int, stage: int, kind: str, now: int) -> bool:
        mb = issued.get((stage, kind), 0)
        if kind == F:
            if live[rank] >= live_cap[rank] or live[rank] - len(pending[rank]) >= grad_cap[rank]:
                return False
            return stage == 0 or arrived((stage - 1, F, mb), placement[stage - 1], rank, now)
        if len(pending[rank]) >= pending_cap[rank] or finished.get((stage, F, mb), now + 1) > now:
            return False
        return stage == num_stages - 1 or arrived(
            (stage + 1, I, mb), placement[stage + 1], rank, now
        )

    def run(rank: int, action: tuple, now: int) -> None:
        stage, kind, mb = action
        if kind == W:
            pending[rank].popleft()
            live[rank] -= 1
        else:
            issued[(stage, kind)] = mb + 1
            if kind == F:
                live[rank] += 1
                receive_from, send_to = stage - 1, stage + 1
            else:
                pending[rank].append((stage, W, mb))
                receive_from, send_to = stage + 1, stage - 1
            if 0 <= receive_from < num_stages and placement[receive_from] != rank:
                channels[(placement[receive_from], rank)].popleft()
            if 0 <= send_to < num_stages and placement[send_to] != rank:
                channels.setdefault((rank, placement[send_to]), deque()).append(action)
        finished[action] = now + 1
        rows[rank].append(action)

    done, slot = 0, 0
    while done < total:
        progressed = False
        for rank in range(num_ranks):  # what a rank runs in this slot is seen from the next
            options = []
            for index, stream in enumerate(streams[rank]):
                if heads[rank][index] < len(stream):
                    stage, kind = stream[heads[rank][index]]
                    if ready(rank, stage, kind, slot):
                        action = (stage, kind, issued.get((stage, kind), 0))
                        options.append((preference(rank, *action), index, action))
            if pending[rank]:
                options.append((preference(rank, *pending[rank][0]), -1, pending[rank][0]))
            if options:
                _, index, action = min(options)
                if index >= 0:
                    heads[rank][index] += 1
                run(rank, action, slot)
                done += 1
                progressed = True
        if not progressed:  # every earlier action has ended: nothing will ever change
            raise StuckError(
                f"list scheduler stuck at slot {slot} after {done} of {total} actions "
                f"(live {live}, caps {live_cap}/{grad_cap}, pending caps {pending_cap}); "
                "last actions per rank: "
                + "; ".join(" ".join(f"{s}{k}{j}" for s, k, j in row[-8:]) for row in rows)
            )
        slot += 1
    return [[Action(*a) for a in row] for row in rows]


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
