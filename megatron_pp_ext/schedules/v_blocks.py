"""V-layout schedules built from a repeated building block (Qi et al., "Pipeline Parallelism
with Controllable Memory", NeurIPS 2024, section 3): when, in unit slots, each rank runs one
microbatch's four F and I actions (the forward of its first chunk F0 and of its second F1,
the input gradients I1 then I0), repeated every 6 slots, one microbatch per repetition, cut
to the m microbatches that exist; the weight gradients W take the free slots.

A rank's activation memory is the sum of its chunks' lifespans (from F to W) over the 6-slot
period, so the block's shape sets it (``Block``); the hops set what message time it absorbs.

Where the cut leaves ranks idle (the warm-up and the cool-down) the block is squeezed, in the
authors' two passes (their ``zbv_greedy.py``, zero-bubble-pipeline-parallelism; the same
orders at p = 4..16, m = 4p, written here our way):

1. with the W's in the free slots (each free slot takes the oldest waiting W), every action
   outside the steady phase (from rank 0's first input gradient of stage 0 to its last
   forward of stage 0), in slot order, moves to the earliest free slot after its inputs where
   its rank's live activations stay within its cap; then every rank runs its slots' order
   eagerly (each action at the earliest slot its rank and its inputs allow);
2. with the W's dropped (each one taken as run in the first free slot after its I), every
   action after the steady phase moves the same way; the eager run again, then the W's go
   back into the free slots, chunk 1's first where both wait.

A rank's cap is its own peak in the block, or the busiest rank's (the authors' reading); with
a short m (rank 0's last forward before its first turn) the steady phase is empty, or (the
authors' reading) runs from that turn to the end. ``block_orders`` keeps the fastest reading
at unit actions (ties: the least memory summed over the ranks, then the fastest with
messages), so the busiest rank's peak is the block's whatever the reading.

An input made on another rank needs ``hop`` slots (one for the paper's blocks: messages free),
one made on the same rank one slot. Layout: the V (``v_placement``): rank r holds stage r
(chunk 0) and stage 2p-1-r (chunk 1). Pure: no torch, O(p m) slots, plus the cool-down's
O(p^2) trial slots per rank, for each of two or four readings (p = 16, m = 64 in about a
tenth of a second).
"""

from __future__ import annotations

import math
from bisect import bisect_left, insort
from collections import deque
from dataclasses import dataclass

from ..ir import BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD
from ._common import require
from .timing import peak_memory, play

Slot = tuple[int, str, int]  # (stage, kind, microbatch): an action, as the searches hold it

PERIOD = 6  # slots per microbatch and rank: six unit actions
F0, F1, I1, I0 = range(4)


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


def block_slots(p: int, m: int, block: Block) -> list[dict[Slot, int]]:
    """Every rank's F's and I's with their slots in the block repeated m times."""
    last = 2 * p - 1
    ranks = []
    for i, row in enumerate(block.rows(p)):
        actions = ((i, FORWARD), (last - i, FORWARD), (last - i, BACKWARD_INPUT),
                   (i, BACKWARD_INPUT))  # F0, F1, I1, I0
        ranks.append({(stage, kind, k): t + PERIOD * k
                      for (stage, kind), t in zip(actions, row) for k in range(m)})
    return ranks


def _weight_slots(rank: dict[Slot, int]) -> list[int]:
    """The slots of a rank's W's, in their order: each free slot up to the rank's last F or I
    takes the oldest waiting W, the rest follow the last one."""
    kinds = {t: a[1] for a, t in rank.items()}
    end = max(kinds)
    out, waiting = [], 0
    for t in range(end + 1):
        kind = kinds.get(t)
        if kind is None:
            if waiting:
                out.append(t)
                waiting -= 1
        elif kind == BACKWARD_INPUT:
            waiting += 1
    return out + list(range(end + 1, end + 1 + waiting))


class _Squeeze:
    """One block's slots on every rank, and the two passes that squeeze them (module
    docstring). A rank's W's are held by slot alone (the k-th follows the k-th I, in slot
    order): which I's activation each frees matters only to the order they are put back in."""

    def __init__(self, p: int, m: int, block: Block, hop: int, open_ended: bool = False,
                 shared_cap: bool = False):
        self.p, self.m, self.hop = p, m, hop
        self.open_ended, self.shared_cap = open_ended, shared_cap
        self.owner = list(range(p)) + list(reversed(range(p)))
        self.slots = block_slots(p, m, block)

    def steady(self) -> tuple[int, float]:
        """The steady phase's first and last slot, on rank 0. Where the last forward comes
        first (a short m) it is empty, or with ``open_ended`` runs to the end."""
        rank = self.slots[0]
        first, last = rank[(0, BACKWARD_INPUT, 0)], rank[(0, FORWARD, self.m - 1)]
        if self.open_ended and last < first:
            last = math.inf
        return first, last

    def _earliest(self, action: Slot, rank: int) -> int:
        """The first slot ``action``'s inputs allow on ``rank`` (a W's excepted)."""
        out = 0
        for d in _inputs(action, 2 * self.p):
            r = self.owner[d[0]]
            out = max(out, self.slots[r][d] + (1 if r == rank else self.hop))
        return out

    def _caps(self, peaks: list[int]) -> list[int]:
        """Each rank's cap: its own peak, or with ``shared_cap`` the busiest rank's."""
        return [max(peaks)] * len(peaks) if self.shared_cap else peaks

    def _in_order(self, weights=None):
        """Every (slot, rank, action or W index) in slot order, ties by rank."""
        items = [(t, r, a) for r, rank in enumerate(self.slots) for a, t in rank.items()]
        if weights is not None:
            items += [(t, r, k) for r, row in enumerate(weights) for k, t in enumerate(row)]
        return sorted(items, key=lambda item: (item[0], item[1]))

    def with_weights(self) -> None:
        """Pass 1: the W's in the free slots, the warm-up and the cool-down squeezed, under
        each rank's cap of live activations (an F's from its slot to its W's)."""
        weights = [_weight_slots(rank) for rank in self.slots]
        end = max(max(row[-1] for row in weights), *(max(r.values()) for r in self.slots)) + 1
        live = []
        for rank, row in zip(self.slots, weights):
            delta = [0] * (end + 1)
            for a, t in rank.items():
                delta[t] += a[1] == FORWARD
            for t in row:
                delta[t] -= 1
            counts, running = [], 0
            for step in delta:
                running += step
                counts.append(running)
            live.append(counts)
        cap = self._caps([max(counts) for counts in live])
        first, last = self.steady()
        taken = [set(rank.values()) | set(row) for rank, row in zip(self.slots, weights)]
        inputs = [sorted(t for a, t in rank.items() if a[1] == BACKWARD_INPUT)
                  for rank in self.slots]
        for old, r, a in self._in_order(weights):
            if (first, 0) <= (old, r) <= (last, 0):
                continue  # the steady phase keeps the block's shape
            weight = isinstance(a, int)
            if weight:  # after the k-th I and the previous W
                earliest = max(inputs[r][a] + 1, weights[r][a - 1] + 1 if a else 0)
            else:
                earliest = self._earliest(a, r)
            forward = not weight and a[1] == FORWARD
            for t in range(earliest, old):
                if t in taken[r] or (forward and max(live[r][t:old]) + 1 > cap[r]):
                    continue
                if forward or weight:
                    step = 1 if forward else -1
                    for u in range(t, old):
                        live[r][u] += step
                taken[r].discard(old)
                taken[r].add(t)
                if weight:
                    weights[r][a] = t
                else:
                    self.slots[r][a] = t
                    if a[1] == BACKWARD_INPUT:
                        inputs[r].pop(bisect_left(inputs[r], old))
                        insort(inputs[r], t)
                break
        self._eager(weights)

    def without_weights(self) -> None:
        """Pass 2: the W's dropped (each taken as run in the first free slot after its I, the
        oldest first), the cool-down squeezed again under each rank's cap."""
        kinds = [{t: a[1] for a, t in rank.items()} for rank in self.slots]
        states = [_implicit(k, 0, (0, 0, 0), keep=True) for k in kinds]
        cap = self._caps([s[-1][2] for s in states])
        _, last = self.steady()
        for old, r, a in self._in_order():
            if (old, r) <= (last, 0):
                continue  # only the cool-down moves
            row = kinds[r]
            for t in range(self._earliest(a, r), old):
                if t in row:
                    continue
                del row[old]
                row[t] = a[1]
                state = states[r][t - 1] if t else (0, 0, 0)
                if _implicit(row, t, state) <= cap[r]:
                    self.slots[r][a] = t
                    states[r][t:] = _implicit(row, t, state, keep=True)
                    break
                del row[t]
                row[old] = a[1]
        self._eager([_weight_slots(rank) for rank in self.slots])

    def _eager(self, weights) -> None:
        """Every rank runs its slots' order at the earliest slot its inputs allow."""
        free = [0] * self.p
        slots = [dict() for _ in range(self.p)]
        for _, r, a in self._in_order(weights):
            t = free[r]
            if not isinstance(a, int):  # a W waits for nothing its rank has not run
                for d in _inputs(a, 2 * self.p):
                    producer = self.owner[d[0]]
                    t = max(t, slots[producer][d] + (1 if producer == r else self.hop))
                slots[r][a] = t
            free[r] = t + 1
        self.slots = slots

    def orders(self) -> list[list[Slot]]:
        """Every rank's order: its slots', the W's in the free slots (chunk 1's first where
        both wait, each chunk's oldest), the rest at the end, chunk 1's first."""
        out = []
        for r, rank in enumerate(self.slots):
            chunks = (2 * self.p - 1 - r, r)
            waiting = {stage: deque() for stage in chunks}
            at = {t: a for a, t in rank.items()}
            order = []
            for t in range(max(at) + 1):
                a = at.get(t)
                if a is not None:
                    order.append(a)
                    if a[1] == BACKWARD_INPUT:
                        waiting[a[0]].append(a[2])
                    continue
                for stage in chunks:
                    if waiting[stage]:
                        order.append((stage, BACKWARD_WEIGHT, waiting[stage].popleft()))
                        break
            for stage in chunks:
                order += [(stage, BACKWARD_WEIGHT, k) for k in waiting[stage]]
            out.append(order)
        return out


def _implicit(kinds: dict[int, str], t0: int, state: tuple[int, int, int], keep=False):
    """A rank's live activations from slot ``t0`` on, its W's each run in the first free slot
    after its I: ``state`` is (live, W's waiting, peak so far) before ``t0``; the peak, or
    with ``keep`` the state after every slot."""
    live, waiting, peak = state
    out = []
    for t in range(t0, max(kinds) + 1):
        kind = kinds.get(t)
        if kind is None:
            if waiting:
                live -= 1
                waiting -= 1
        elif kind == FORWARD:
            live += 1
            peak = max(peak, live)
        else:
            waiting += 1
        if keep:
            out.append((live, waiting, peak))
    return out if keep else peak


def _unit_makespans(p: int, orders: list[list[Slot]], hop: int) -> tuple[float, float]:
    """The orders' makespans at unit actions, messages taking ``hop - 1`` and 0.2 more."""
    owner = list(range(p)) + list(reversed(range(p)))
    unit = {kind: [1.0] * (2 * p) for kind in "FIW"}
    out = []
    for extra in (0.0, 0.2):
        played = play(owner, orders, unit, [hop - 1.0 + extra] * (2 * p))
        out.append(math.inf if played is None else played[0])
    return out[0], out[1]


def block_orders(p: int, m: int, block: Block) -> list[list[Slot]]:
    """Every rank's actions: the repeated block squeezed in two passes (module docstring);
    an input from another rank needs as many slots as the block's shortest leg. Of the
    readings (each rank capped at its own peak or at the busiest rank's; with a short m,
    the steady phase empty or from the first turn to the end) the fastest at unit actions,
    then the one with the least memory summed over the ranks, then the fastest with messages
    of 0.2 of an action."""
    require(block.fits(p), "V block", f"{block} puts two of a rank's actions in one slot of "
            f"the {PERIOD}-slot period at p={p}: change a turn or a hop")
    hop = min(block.f0, block.f1, block.i1, block.i0)
    found = []
    for open_ended in (False, True):
        for shared_cap in (False, True):
            squeeze = _Squeeze(p, m, block, hop, open_ended, shared_cap)
            if open_ended and squeeze.steady()[1] != math.inf:
                continue  # a steady phase: one reading of it
            squeeze.with_weights()
            squeeze.without_weights()
            orders = squeeze.orders()
            unit, slow = _unit_makespans(p, orders, hop)
            found.append((unit, sum(peak_memory(row, [1.0] * (2 * p)) for row in orders),
                          slow, len(found), orders))
    return min(found)[-1]
