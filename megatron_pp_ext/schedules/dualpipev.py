"""DualPipeV: DeepSeek's DualPipe "cut in half" (Sea AI Lab's V-shape form), after the order of
``deepseek-ai/DualPipe``'s ``DualPipeV.step``, adapted so that messages match in order.

Layout (``v_placement``): rank r holds stage ``a = r`` (chunk 0, DualPipe's phase 0) and stage
``b = 2p-1-r`` (chunk 1, phase 1); rank 0 holds the first and the last stage. S = 2p stages.

A full backward is ``B``; where DualPipe defers a weight gradient (its "zero bubble" switch) the
backward is ``I`` and the deferred ``W`` runs later, oldest first. Each stage runs its F's and
its backwards in microbatch order. Rank r, with m >= 2p microbatches:

1. ``p-r-1``    x F(a)                                   warm-up, chunk 0 only
2. ``r+1``      x F(a), F(b)
3. ``p-r-1``    x [F(a), I(b)], W (of that I), F(b)      zero bubble
4. ``m-2p+r+1`` x [F(a), B(b)], [F(b), B(a)]             the main step
5. ``p-r-1``    x B(b), [F(b), B(a)]
6. ``r+1``      x backward(b), backward(a)               the later half of these 2(r+1)
   backwards are I's (the split starts before backward(b) of round (r+1)//2 on odd ranks,
   before its backward(a) on even ranks), the earlier half B's
7. ``p-r-1``    x W, I(a)
8. ``r+1``      x W                                      the W queue is empty at the end

The *overlapped F&B pairs* are the bracketed ones, each written as two consecutive actions,
forward first: ``F(a) B(b)`` and ``F(b) B(a)`` in step 4, ``F(b) B(a)`` in step 5, and
``F(a) I(b)`` in step 3 (ours only: see below). DualPipe computes a pair's forward and backward in one
``overlapped_forward_backward`` call (except the first pair of step 4 on rank p-1); our
runtime runs the two actions one after the other, F first.

The one change from DualPipe's order: DualPipe runs ``2(p-r-1)`` chunk-0 forwards in step 1;
here half of them move into step 3, each just before one of its I(b)'s. DualPipe posts the
receive of a chunk-0 activation well before the forward that uses it, so its rank r sends its
neighbour 2p-1-r activations before the first chunk-1 gradient while that neighbour uses only
2p-2-r of them before it; when every action receives its own message (our IR) and messages
between two ranks are matched in order, every rank must interleave its chunk-0 forwards and
chunk-1 backwards the same way. With the move each rank does: p forwards, then forward and
backward alternately, then the last p backwards (the chunk-1 forwards and chunk-0 backwards
already agreed on every rank: p+1 forwards, alternate, p+1 backwards). In the equal-cost model
this costs nothing: rank 0 waits p-1 slots in the warm-up instead of in the main step, and the
makespan, peak memory and per-rank idle time are those of DualPipe's own order.
``match_dualpipe=True`` builds DualPipe's own order: our executor, which receives from each
peer in the order the peer sends, runs it (``validate_schedule``'s default ``channels=
"sender"``), a transport that matches messages in each side's own order does not
(``channels="pair"`` rejects it from p = 3, m = 2p on).

DualPipe requires m >= 2p. For fewer microbatches we build the order for 2p and drop the
actions of microbatches m..2p-1: every remaining action keeps its inputs and each channel's
messages keep their order, so the result stays valid (with its phases shortened).

Cost-model facts (t_F = t_I = t_W = 1, t_B = 2, pairs run one after the other, m >= 2p):
every rank holds up to 2p + 1 = S + 1 chunk activations (end of F to end of B or W), DualPipe's
table's S + 1; the makespan is 6m + p - 1, so each rank idles p - 1, within DualPipe's bubble
formula (S/2 - 1)(F&B + B - 3W) = (p - 1)(3 + 2 - 3) = 2(p - 1).
"""

from __future__ import annotations

from collections import deque

from ..ir import Action, Schedule
from ._common import check_sizes, require, v_placement


class _OrderWriter:
    """One rank's action list being written: the next forward and backward microbatch of each
    of its two stages, and the deferred W's it still owes, oldest first."""

    def __init__(self, a: int, b: int) -> None:
        self.forwards = {a: 0, b: 0}  # next microbatch per stage
        self.backwards = {a: 0, b: 0}
        self.owed_w: deque = deque()
        self.order: list[Action] = []

    def forward(self, stage: int) -> None:
        self.order.append(Action(stage, "F", self.forwards[stage]))
        self.forwards[stage] += 1

    def backward(self, stage: int, split: bool = False) -> None:
        """A full backward ``B``, or with ``split`` an ``I`` whose ``W`` is owed."""
        mb = self.backwards[stage]
        self.backwards[stage] += 1
        if split:
            self.order.append(Action(stage, "I", mb))
            self.owed_w.append(Action(stage, "W", mb))
        else:
            self.order.append(Action(stage, "B", mb))

    def weight(self) -> None:
        """The oldest deferred weight gradient."""
        self.order.append(self.owed_w.popleft())


def _warm_up(out: _OrderWriter, p: int, rank: int, match_dualpipe: bool) -> None:
    """Steps 1-3 (see the module notes): forwards until the first backward, then the
    zero-bubble rounds."""
    a, b = rank, 2 * p - 1 - rank
    # 1. warm-up of chunk 0 (DualPipe: twice as many; here the other half runs in step 3)
    for _ in range((2 if match_dualpipe else 1) * (p - rank - 1)):
        out.forward(a)
    # 2. both chunks
    for _ in range(rank + 1):
        out.forward(a)
        out.forward(b)
    # 3. a pair (chunk-0 forward, chunk-1 input gradient), that I's W, a chunk-1 forward
    for _ in range(p - rank - 1):
        if not match_dualpipe:
            out.forward(a)
        out.backward(b, split=True)
        out.weight()
        out.forward(b)


def _steady(out: _OrderWriter, p: int, m: int, rank: int) -> None:
    """Steps 4-5: the overlapped F&B pairs, until the last forward."""
    a, b = rank, 2 * p - 1 - rank
    # 4. main step: two overlapped F&B pairs per round
    for _ in range(m - 2 * p + rank + 1):
        out.forward(a)
        out.backward(b)
        out.forward(b)
        out.backward(a)
    # 5. a chunk-1 backward, then one overlapped pair
    for _ in range(p - rank - 1):
        out.backward(b)
        out.forward(b)
        out.backward(a)


def _cool_down(out: _OrderWriter, p: int, rank: int) -> None:
    """Steps 6-8: the backwards left, the later ones split, and the W's they defer."""
    a, b = rank, 2 * p - 1 - rank
    # 6. backwards of both chunks; the later half defer their weight gradients
    split = False
    for i in range(rank + 1):
        if i == (rank + 1) // 2 and rank % 2 == 1:
            split = True
        out.backward(b, split)
        if i == (rank + 1) // 2 and rank % 2 == 0:
            split = True
        out.backward(a, split)
    # 7. a deferred weight gradient, then a chunk-0 input gradient
    for _ in range(p - rank - 1):
        out.weight()
        out.backward(a, split=True)
    # 8. the deferred weight gradients left
    for _ in range(rank + 1):
        out.weight()


def _rank_order(p: int, m: int, rank: int, match_dualpipe: bool = False) -> list[Action]:
    """DualPipeV's action order on one rank (needs m >= 2p)."""
    a, b = rank, 2 * p - 1 - rank
    out = _OrderWriter(a, b)
    _warm_up(out, p, rank, match_dualpipe)
    _steady(out, p, m, rank)
    _cool_down(out, p, rank)
    assert not out.owed_w and out.forwards == {a: m, b: m} and out.backwards == {a: m, b: m}
    return out.order


def build_dualpipev(num_ranks: int, num_microbatches: int, chunks: int = 2,
                    forward_only: bool = False, match_dualpipe: bool = False,
                    **_options) -> Schedule:
    """DualPipeV; ``match_dualpipe=True`` gives DualPipe's own order (see the module notes)."""
    check_sizes("dualpipev", num_ranks, num_microbatches)
    require(chunks == 2, "dualpipev",
            f"chunks v={chunks!r} is not allowed: dualpipev is the V layout with exactly 2 "
            "chunks per rank (rank r holds stages r and 2p-1-r); pass chunks=2 or leave it unset")
    p, m = num_ranks, num_microbatches
    built = max(m, 2 * p)  # DualPipe's own minimum; extra microbatches are dropped below
    rows = []
    for rank in range(p):
        order = [x for x in _rank_order(p, built, rank, bool(match_dualpipe))
                 if x.microbatch < m]
        if forward_only:
            order = [x for x in order if x.kind == "F"]
        rows.append(order)
    options = {"chunks": 2, "forward_only": forward_only, "match_dualpipe": bool(match_dualpipe),
               # consecutive F, B/I of the two chunks may run as one overlapped call
               "overlapped_pairs": not forward_only}
    if built != m:
        options["built_for_microbatches"] = built
    return Schedule("dualpipev", m, v_placement(p), rows, options)
