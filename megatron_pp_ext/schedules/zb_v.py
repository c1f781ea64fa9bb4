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
               forward_only: bool = False, **_options) -> Schedule:
    check_sizes("zb-v", num_ranks, num_microbatches)
    require(chunks == 2, "zb-v",
            f"chunks v={chunks!r} is not allowed: zb-v is the V layout with exactly 2 chunks "
            "per rank (rank r holds stages r and 2p-1-r); pass chunks=2 or leave it unset")
    p, m = num_ranks, num_microbatches
    placement = v_placement(p)
    last = 2 * p - 1
    if forward_only:
        streams = [[[(r, F)] * m, [(last - r, F)] * m] for r in range(p)]
        rows = merge_streams(placement, m, streams, kind_first("F", later_stage_first=True))
    else:
        streams = [
            [_stream((r, F), (last - r, I), p, m), _stream((last - r, F), (r, I), p, m)]
            for r in range(p)
        ]
        rows = merge_streams(placement, m, streams, kind_first("IFW", later_stage_first=True),
                             live_cap=[2 * p] * p)
    return Schedule("zb-v", m, placement, rows, {"chunks": 2, "forward_only": forward_only})
