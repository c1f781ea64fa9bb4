"""V-layout schedules built from a repeated building block (Qi et al., "Pipeline Parallelism
with Controllable Memory", NeurIPS 2024, section 3): when, in unit slots, each rank runs one
microbatch's six actions (the forward of its first chunk F0 and of its second F1, the input
gradients I1 then I0, the weight gradients W1 and W0), repeated every 6 slots, one microbatch
per repetition, cut to the m microbatches that exist, and run eagerly in that order.

A rank's activation memory is the sum of its chunks' lifespans (from F to W) over the 6-slot
period, so the block's shape sets it (``Block``); the hops set what message time it absorbs.
The W's take the block's two free slots, each the first free one after its I. Where the cut
leaves ranks idle (the warm-up and the cool-down) ``compact`` moves each action to the
earliest slot its inputs allow without raising its rank's peak; the steady phase keeps the
block's shape. Then the I's are compacted once more into the W's slots and the W's put back
into the gaps, where the peak allows (the paper's second squeeze, done our way).

Layout: the V (``v_placement``): rank r holds stage r (chunk 0) and stage 2p-1-r (chunk 1).
Pure: no torch, O(p m) slots (p = 32, m = 256 in well under a second).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from ..ir import BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD
from ._common import require
from .timing import peak_memory

Slot = tuple[int, str, int]  # (stage, kind, microbatch): an action, as the searches hold it

PERIOD = 6  # slots per microbatch and rank: six unit actions
F0, F1, I1, I0, W1, W0 = range(6)


@dataclass(frozen=True)
class Block:
    """A V building block by its hops: how many slots each leg of the V advances per rank
    (``f0``: chunk 0's forwards down the ranks, ``f1``: chunk 1's back up, ``i1``: chunk 1's
    input gradients down, ``i0``: chunk 0's back up), and the slots idle at the two turns
    (``turn0`` on rank 0 between its chunk-1 forward and input gradient, ``turn1`` on rank
    p-1 between its two input gradients). A hop of one slot fits only when a message takes
    no time; a message of up to one action's time needs two."""

    f0: int = 1
    f1: int = 1
    i1: int = 1
    i0: int = 1
    turn0: int = 0
    turn1: int = 0

    def rows(self, p: int) -> list[list[int]]:
        """Per rank, the slots of F0, F1, I1, I0 of microbatch 0."""
        down = self.f0 * (p - 1)  # F0 on rank p-1
        f1_top = down + 1 + self.f1 * (p - 1)  # F1 on rank 0
        i1_top = f1_top + 1 + self.turn0  # I1 on rank 0
        i0_bottom = i1_top + self.i1 * (p - 1) + 1 + self.turn1  # I0 on rank p-1
        return [[self.f0 * i, f1_top - self.f1 * i, i1_top + self.i1 * i,
                 i0_bottom + self.i0 * (p - 1 - i)] for i in range(p)]

    def fits(self, p: int) -> bool:
        """Whether every rank's four actions fall in distinct slots of the 6-slot period."""
        return all(len({t % PERIOD for t in row}) == 4 for row in self.rows(p))


def _with_weights(row: list[int]) -> list[int]:
    """The block's row with W1 and W0 in its two free slots (mod 6), each the first free one
    after its own I."""
    taken = {t % PERIOD for t in row}
    out = list(row) + [None, None]
    for w, after in ((W1, row[I1]), (W0, row[I0])):
        for d in range(1, PERIOD):
            if (after + d) % PERIOD not in taken:
                out[w] = after + d
                taken.add((after + d) % PERIOD)
                break
    return out


def block_slots(p: int, m: int, block: list[list[int]]) -> list[dict[Slot, int]]:
    """Every rank's actions with their slots in the block repeated m times."""
    last = 2 * p - 1
    ranks = []
    for i, row in enumerate(block):
        slots = _with_weights(row)
        first, second = i, last - i
        kinds = {F0: (first, FORWARD), F1: (second, FORWARD), I1: (second, BACKWARD_INPUT),
                 I0: (first, BACKWARD_INPUT), W1: (second, BACKWARD_WEIGHT),
                 W0: (first, BACKWARD_WEIGHT)}
        ranks.append({(kinds[a][0], kinds[a][1], k): slots[a] + PERIOD * k
                      for k in range(m) for a in range(PERIOD)})
    return ranks


def _inputs(action: Slot, num_stages: int) -> list[Slot]:
    """What ``action`` waits for: its cross-stage input, its own earlier kinds, and the same
    kind's previous microbatch on its stage (each stage keeps microbatch order)."""
    s, kind, k = action
    out = [(s, kind, k - 1)] if k > 0 else []
    if kind == FORWARD:
        return out + ([(s - 1, FORWARD, k)] if s > 0 else [])
    if kind == BACKWARD_INPUT:
        out.append((s, FORWARD, k))
        return out + ([(s + 1, BACKWARD_INPUT, k)] if s < num_stages - 1 else [])
    return out + [(s, BACKWARD_INPUT, k)]


def compact(slots: list[dict[Slot, int]], num_stages: int,
            kinds: tuple[str, ...] = (FORWARD, BACKWARD_INPUT, BACKWARD_WEIGHT),
            hop: int = 1) -> list[dict[Slot, int]]:
    """Move each action of the warm-up and the cool-down, in slot order, to the earliest free
    slot after its inputs on the unit grid where its rank's peak of live activations does not
    grow (an activation lives from its F's slot to its W's slot); an input from another rank
    needs ``hop`` slots, from the same rank one. The steady phase between
    (from rank 0's first input gradient of stage 0 to its last forward of stage 0) keeps the
    block's shape: moving it greedily makes a worse one."""
    owner = {a: r for r, rank in enumerate(slots) for a in rank}
    end = max(t for rank in slots for t in rank.values()) + 2
    taken = [set(rank.values()) for rank in slots]
    live = []  # per rank, per slot: activations live after that slot's action
    for rank in slots:
        delta = [0] * (end + 1)
        for a, t in rank.items():
            delta[t] += {FORWARD: 1, BACKWARD_WEIGHT: -1}.get(a[1], 0)
        counts, running = [], 0
        for step in delta[:end]:
            running += step
            counts.append(running)
        live.append(counts)
    peaks = [max(c) for c in live]
    where = {a: t for rank in slots for a, t in rank.items()}
    steady_from = where.get((0, BACKWARD_INPUT, 0))
    last = max((a[2] for a in where), default=0)
    steady_to = where.get((0, FORWARD, last))
    for a in sorted(where, key=lambda a: (where[a], owner[a])):
        r, old = owner[a], where[a]
        if a[1] not in kinds or (steady_from is not None and steady_to is not None
                                   and steady_from <= old <= steady_to):
            continue
        earliest = max((where[d] + (1 if owner[d] == r else hop)
                        for d in _inputs(a, num_stages) if d in where), default=0)
        for t in range(earliest, old):
            if t in taken[r]:
                continue
            if a[1] == FORWARD and max(live[r][t:old]) + 1 > peaks[r]:
                continue
            step = {FORWARD: 1, BACKWARD_WEIGHT: -1}.get(a[1], 0)
            for u in range(t, old):
                live[r][u] += step
            taken[r].discard(old)
            taken[r].add(t)
            where[a] = t
            break
    return [{a: where[a] for a in rank} for rank in slots]


def order_with_weights(slots: dict[Slot, int], limit: int) -> list[Slot]:
    """One rank's F's and I's in slot order with its W's put back: each into the first free
    slot after its I (chunk 1's first where two wait), and, before an F that would raise the
    live activations above ``limit``, as many as it takes to keep within it."""
    order, pending, live = [], deque(), 0
    timed = sorted(slots.items(), key=lambda item: item[1])
    t, k = 0, 0
    while k < len(timed):
        action, slot = timed[k]
        if slot > t:  # a free slot: the oldest W waiting fills it
            if pending:
                order.append(pending.popleft())
                live -= 1
            t += 1
            continue
        if action[1] == FORWARD:
            while live + 1 > limit and pending:
                order.append(pending.popleft())
                live -= 1
            live += 1
        order.append(action)
        if action[1] == BACKWARD_INPUT:
            pending.append((action[0], BACKWARD_WEIGHT, action[2]))
        t, k = slot + 1, k + 1
    return order + list(pending)


def block_orders(p: int, m: int, block: Block) -> list[list[Slot]]:
    """Every rank's actions: the repeated block compacted; then its I's compacted once more
    into the slots its W's held and the W's put back where the gaps and the block's peak
    allow (the paper's second squeeze, done our way)."""
    require(block.fits(p), "V block", f"{block} puts two of a rank's actions in one slot of "
            f"the {PERIOD}-slot period at p={p}: change a turn or a hop")
    hop = min(block.f0, block.f1, block.i1, block.i0)
    slots = compact(block_slots(p, m, block.rows(p)), 2 * p, hop=hop)
    first = [sorted(rank, key=rank.get) for rank in slots]
    no_w = [{a: t for a, t in rank.items() if a[1] != BACKWARD_WEIGHT} for rank in slots]
    early = compact(no_w, 2 * p, kinds=(BACKWARD_INPUT,), hop=hop)
    unit = [1.0] * (2 * p)  # chunk-activations: one per F
    rows = []
    for rank, order in zip(early, first):
        limit = peak_memory(order, unit)
        again = order_with_weights(rank, limit)
        rows.append(again if peak_memory(again, unit) <= limit else order)
    return rows
