"""ZB-V (Qi et al., "Zero Bubble Pipeline Parallelism", the V-shape schedule): two chunks per
rank in a V, split backward, about 1F1B's memory and (close to) no bubble.

Layout (``v_placement``): rank r holds stage ``a = r`` (chunk 0) and stage ``b = 2p-1-r``
(chunk 1), so rank 0 holds the first and the last stage and a microbatch's forward runs down
the ranks and back up, its backward down and back up again.

Message order forces one shape on every rank
--------------------------------------------
The channel from rank r to rank r+1 carries chunk 0's activations (F of stage a) *and* chunk
1's input gradients (I of stage b); the channel back carries chunk 1's activations (F of b)
and chunk 0's input gradients (I of a). Messages on a channel are matched in order, so every
rank must interleave its F(a)'s with its I(b)'s the same way, and its F(b)'s with its I(a)'s
the same way. We use, on every rank, two fixed streams:

* down stream: ``p`` F(a)'s, then I(b), F(a) alternately, then the I(b)'s left;
* up stream:   ``p`` F(b)'s, then I(a), F(b) alternately, then the I(a)'s left;

and merge them (plus the W's) with the list scheduler of ``zero_bubble.merge_streams``:
prefer I, then F, then W, the later stage first, and let a rank hold at most ``2p``
microbatch-chunks from the end of their F to the end of their W (``p`` microbatches of a whole
rank's layers: 1F1B's peak on rank 0, here on every rank).

With t_F = t_I = t_W per chunk and m >= p the makespan is ``6m + p - 1`` chunk-slots, the least
any schedule can have (rank p-1 cannot start before slot p-1 and has 6m of work): p - 1 idle
slots per rank, a bubble fraction of (p-1)/(6m+p-1) -- 5.9% at p=4, m=8 and 3.0% at m=16.
Rank r's p - 1 - r of them fall at its start. The published ZB-V fills rank 0's start with
2p - 1 chunk-0 forwards instead, but then ranks interleave differently (rank r runs 2p-1-r
chunk-0 forwards before its first chunk-1 input gradient) and its orders break the in-order
matching of messages; with matching in order, filling the start costs about 4p activations.
"""

from __future__ import annotations

from ..ir import Schedule
from ._common import check_sizes, require, v_placement
from .zero_bubble import F, I, kind_first, merge_streams


def _stream(first: tuple[int, str], second: tuple[int, str], lead: int, m: int) -> list:
    """``lead`` of ``first``, then ``second`` and ``first`` alternately, then ``second``'s left."""
    lead = min(lead, m)
    stream = [first] * lead
    for k in range(m):
        stream.append(second)
        if lead + k < m:
            stream.append(first)
    return stream


def build_zb_v(num_ranks: int, num_microbatches: int, chunks: int = 2,
               forward_only: bool = False, warmup_forwards: int | None = None,
               **_options) -> Schedule:
    """``warmup_forwards`` (p to 2p-1, default p): the chunk-0 forwards every rank runs before
    its first chunk-1 input gradient (the streams' lead), and so the memory: a rank holds at
    most 2 x warmup_forwards microbatch-chunks. p is 1F1B's peak and the least makespan of one
    step; 2p-1 is ZB-H2's peak and fills rank 0's wait for its first chunk-1 forward, so that
    consecutive steps overlap back to back (run ahead, ``integration.run_ahead_step``) as
    ZB-H2's do: with t_F = t_I = t_W the simulated back-to-back step is 6m + p - 1 - (w - p)
    chunk-slots for w = warmup_forwards (p=4, m=8: 51 at w=p, 48 = 6m at 2p-1, the least: 6m
    of work per rank, zb-h2's figure at the same memory)."""
    check_sizes("zb-v", num_ranks, num_microbatches)
    require(chunks == 2, "zb-v",
            f"chunks v={chunks!r} is not allowed: zb-v is the V layout with exactly 2 chunks "
            "per rank (rank r holds stages r and 2p-1-r); pass chunks=2 or leave it unset")
    p, m = num_ranks, num_microbatches
    lead = p if warmup_forwards is None else warmup_forwards
    require(isinstance(lead, int) and p <= lead <= max(p, 2 * p - 1), "zb-v",
            f"warmup_forwards={warmup_forwards!r} is not allowed: each rank runs p to 2p-1 "
            f"chunk-0 forwards before its first chunk-1 input gradient (p={p}: {p} to "
            f"{max(p, 2 * p - 1)}); more holds more memory (2 x warmup_forwards "
            "microbatch-chunks per rank) and lets consecutive steps overlap")
    placement = v_placement(p)
    last = 2 * p - 1
    if forward_only:
        streams = [[[(r, F)] * m, [(last - r, F)] * m] for r in range(p)]
        rows = merge_streams(placement, m, streams, kind_first("F", later_stage_first=True))
    else:
        # the same lead on every rank: a channel's F's and I's interleave alike at both ends
        streams = [
            [_stream((r, F), (last - r, I), lead, m), _stream((last - r, F), (r, I), lead, m)]
            for r in range(p)
        ]
        rows = merge_streams(placement, m, streams, kind_first("IFW", later_stage_first=True),
                             live_cap=[2 * lead] * p)
    options = {"chunks": 2, "forward_only": forward_only}
    if lead != p:
        options["warmup_forwards"] = lead
    return Schedule("zb-v", m, placement, rows, options)


def published_zb_v_orders(num_ranks: int, num_microbatches: int) -> list[list[tuple]]:
    """The ZB-V order as the paper draws it (Qi et al. 2024, figure 4; torch.pipelining's
    ZBVZeroBubble writes the same), per rank as ``(stage, kind, microbatch)``: rank r runs
    2(p-r)-1 chunk-0 forwards, r pairs (chunk-1 F, chunk-0 F), p-r chunk-1 (F, I, W), then
    (chunk-0 F, I, W; chunk-1 F, I, W) until its forwards are done, then r pairs of the two
    I's, p-r chunk-0 (I, W), and the W's left. Built for at least 2p-1 microbatches and cut
    to m. zb-auto's candidate (it keeps 1F1B's peak on every rank and fills rank 0's wait for
    its first chunk-1 forward with chunk-0 forwards: where messages take time it can beat
    ``zb-v``'s interleaving, which the executor needs no in-order matching for)."""
    p, m = num_ranks, num_microbatches
    n = max(2 * p - 1, m)
    rows = []
    for r in range(p):
        a, b = r, 2 * p - 1 - r
        count = {key: 0 for key in ("f0", "f1", "i0", "i1", "w0", "w1")}
        row = []

        def emit(key, stage, kind):
            row.append((stage, kind, count[key]))
            count[key] += 1

        for _ in range(2 * (p - r) - 1):
            emit("f0", a, F)
        for _ in range(r):
            emit("f1", b, F)
            emit("f0", a, F)
        for _ in range(p - r):
            emit("f1", b, F)
            emit("i1", b, I)
            emit("w1", b, "W")
        while count["f1"] < count["f0"] or count["f0"] < n:
            if count["f0"] < n:
                emit("f0", a, F)
            emit("i0", a, I)
            emit("w0", a, "W")
            emit("f1", b, F)
            emit("i1", b, I)
            emit("w1", b, "W")
        for _ in range(r):
            emit("i0", a, I)
            emit("i1", b, I)
        for _ in range(p - r):
            emit("i0", a, I)
            emit("w0", a, "W")
        while count["w1"] < count["i1"]:
            emit("w1", b, "W")
        while count["w0"] < count["i0"]:
            emit("w0", a, "W")
        rows.append([action for action in row if action[2] < m])
    return rows
