"""DualPipe, DeepSeek's bidirectional pipeline, after the order of ``deepseek-ai/DualPipe``'s
``DualPipe.step``.

Microbatches enter from both ends. With p ranks (p even) the model has p parts and each
rank holds two of them: rank r holds part r for the *first direction* (microbatches
0..m0-1, m0 = ceil(m/2), from rank 0 to rank p-1) and part p-1-r for the *second direction*
(microbatches m0..m-1, from rank p-1 to rank 0). In the IR that is 2p stages in the V
placement (``v_placement``): stage k (k < p) is part k on rank k, stage p + k is part k again
(its copy) on rank p-1-k; ``Schedule.path`` says which stages each microbatch crosses and
``options["second_direction_from"] = m0`` where the second direction starts. Every part's
parameters are held twice, so its two copies' gradients are summed once per step (the drop-in
does it, ``integration/stage_copies.py``).

The order. DualPipe's step is written for a rank's two *phases*: on ranks 0..p/2-1 phase 0 is
the first direction, on ranks p/2..p-1 the second. Its eight steps are those of DualPipeV
(``dualpipev.py``: the same code in DeepSeek's repository, with p/2 for p and the half rank
h = min(r, p-1-r) for r, and m/2 microbatches per phase), so rank r's order is DualPipeV's
own order (``match_dualpipe=True``) of rank h in a pipeline of p/2 ranks and m/2 microbatches,
its chunk 0 read as phase 0 and its chunk 1 as phase 1. ``tests/test_dualpipe.py`` compares it
with orders recorded from DeepSeek's implementation (``scripts/dualpipe_reference_order.py``).

DualPipe requires an even p and m >= 2p; for fewer microbatches (or an odd m) each direction
is built for max(m0, p) microbatches and the actions of the ones that do not exist are
dropped, as dualpipev does: the actions left keep their inputs and each channel its order.

Cost-model facts (t_F = t_I = t_W = 1, t_B = 2, pairs one after the other, m >= 2p): every
rank holds up to p + 1 part-activations at once (DualPipe's table: PP + 1), and idles
p/2 - 1 slots of 1 in... see ``tests/test_dualpipe.py`` for the figures it holds.
"""

from __future__ import annotations

from ..ir import Action, Schedule
from ._common import check_sizes, require, v_placement
from .dualpipev import _rank_order as dualpipev_rank_order


def dualpipe_microbatches(m: int) -> tuple[int, int]:
    """How many microbatches each direction takes: (ceil(m/2), floor(m/2))."""
    return (m + 1) // 2, m // 2


def _rank_order(p: int, m: int, rank: int) -> list[Action]:
    first, second = dualpipe_microbatches(m)
    half_p, half = p // 2, max(first, p)  # DualPipe's minimum: m >= 2p
    h = min(rank, p - 1 - rank)
    second_half = rank >= half_p
    stage_of = (rank, 2 * p - 1 - rank)  # by direction
    mb_base = (0, first)
    count = (first, second)
    out = []
    for action in dualpipev_rank_order(half_p, half, h, match_dualpipe=True):
        phase = 0 if action.stage == h else 1
        direction = phase ^ second_half
        if action.microbatch >= count[direction]:
            continue
        out.append(Action(stage_of[direction], action.kind,
                          mb_base[direction] + action.microbatch))
    return out


def build_dualpipe(num_ranks: int, num_microbatches: int, chunks: int = 2,
                   forward_only: bool = False, **_options) -> Schedule:
    """DualPipe (bidirectional): see the module notes."""
    check_sizes("dualpipe", num_ranks, num_microbatches)
    p, m = num_ranks, num_microbatches
    require(p % 2 == 0, "dualpipe",
            f"p={p} pipeline ranks: DualPipe pairs rank r with rank p-1-r (each holds the "
            "other's model part for the second direction), so p must be even; use an even "
            "pipeline size, or dualpipev (its V-shape variant, any p)")
    require(chunks == 2, "dualpipe",
            f"chunks v={chunks!r} is not allowed: dualpipe runs exactly 2 model chunks per rank "
            "(rank r holds parts r and p-1-r of the model); pass chunks=2 or leave it unset")
    rows = []
    for rank in range(p):
        order = _rank_order(p, m, rank)
        if forward_only:
            order = [x for x in order if x.kind == "F"]
        rows.append(order)
    first, _ = dualpipe_microbatches(m)
    options = {"chunks": 2, "forward_only": forward_only, "second_direction_from": first,
               "overlapped_pairs": not forward_only}
    if max(first, p) != first:
        options["built_for_microbatches"] = 2 * p
    return Schedule("dualpipe", m, v_placement(p), rows, options)
