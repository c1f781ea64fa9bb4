"""``zb-auto``: a schedule synthesized for given per-rank costs and a per-rank memory budget.

The Zero Bubble paper's answer to uneven stages and message time (Qi et al., ICLR 2024,
section 4: build the order from profiled F, B, W, message times and a memory limit), done
our way. The candidates, for each layout asked (``chunks``: 1 the loop layout, 2 the V
layout, None both):

1. the fixed builders of that layout (loop: 1f1b, zb-h1, zb-h2; V: zb-v, dualpipev, v-half,
   v-min), so zb-auto is never predicted slower than the best of them that fits;
2. the list scheduler of ``synthesis`` under each of its ``POLICIES``, capped by the budget;
3. on the V layout, building blocks (``v_blocks``) whose legs advance as many slots per rank
   as a message needs (two slots for a message of up to one action's time, ...).

Every candidate is played under the costs (``timing.play``, the simulator's buffered model)
and kept if every rank's activation peak fits its budget; each layout's three fastest are
refined by ``refine`` (gaps filled, a bounded number of plays), and the fastest of all wins (ties: the
smaller peak, then the candidates' order above). Deterministic: the same inputs give the same
schedule on every rank, which builds it locally.

Costs are a rank's share of one microbatch (``t_f``, ``t_i``, ``t_w``: one number or one per
rank; a V rank's share splits evenly over its two chunks), ``t_comm`` a message's time,
``t_overhead`` what the runtime adds to every F and I (per action, whatever v: the V layout's
twice as many actions pay it twice as often), as ``analysis.simulate.CostModel`` has them.
Memory: ``activation`` is what one microbatch's F leaves alive on a rank's whole layers (one
number or one per rank: bytes, or 1 to count microbatches), ``memory_budget`` what a rank may
hold (one number or one per rank, same unit); by default 1F1B's peak: p activations of rank 0.

Cost of the search, per layout of A actions: the fixed builders, the 8 policies and up to 3
blocks, each O(A log p), one play each, then at most ``effort`` action-plays of refinement
for each of the 2 fastest; above ``LARGE`` actions, 2 policies, 1 block and no refinement.
p = 32, m = 256 with both layouts: docs/choosing-a-schedule.md has the measured time.
"""

from __future__ import annotations

import math
from typing import Sequence

from ..ir import Schedule, ScheduleError
from ._common import check_sizes, forwards_only, loop_placement, require, v_placement
from .controllable_memory import build_v_half, build_v_min
from .dualpipev import build_dualpipev
from .one_f_one_b import build_1f1b
from .refine import refine
from .synthesis import POLICIES, synthesize
from .timing import as_actions, as_orders, peak_memory, play
from .v_blocks import Block, block_orders
from .zb_v import build_zb_v, published_zb_v_orders
from .zero_bubble import build_zb_h1, build_zb_h2

NAME = "zb-auto"
FIXED = {"loop": (("1f1b", build_1f1b), ("zb-h1", build_zb_h1), ("zb-h2", build_zb_h2)),
         "v": (("zb-v", build_zb_v), ("dualpipev", build_dualpipev),
               ("v-half", build_v_half), ("v-min", build_v_min))}
#: action-plays the refinement may spend on each refined candidate (a play of A actions
#: costs A; about a microsecond each)
DEFAULT_EFFORT = 500_000
#: the builder options that shape zb-auto (and only zb-auto)
ZB_AUTO_OPTIONS = ("t_f", "t_i", "t_w", "t_comm", "t_overhead", "memory_budget", "activation",
                   "effort")
REFINED = 2  # how many of each layout's fastest candidates are refined
#: above this many actions per layout the search narrows: the first 2 policies, one block,
#: no refinement (the fill and the drain it improves are a small part of a long step)
LARGE = 20_000


def _per_rank(name: str, value, p: int, unbounded: bool = False) -> list[float]:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        values = [float(value)] * p
    else:
        try:
            values = [float(x) for x in value]
        except TypeError:
            values = []
        require(len(values) == p, NAME, f"{name}={value!r}: give one number or one per rank "
                f"({p})")
    require(all(x >= 0 and (unbounded or math.isfinite(x)) for x in values), NAME,
            f"{name}={value!r}: every value must be a {'' if unbounded else 'finite '}number "
            ">= 0")
    return values


class _Layout:
    """One layout's per-stage costs and memory."""

    def __init__(self, layout: str, p: int, shares: dict, comm: list, activation: list,
                 overhead: list):
        self.name = layout
        self.owner = loop_placement(p, 1) if layout == "loop" else v_placement(p)
        v = len(self.owner) // p
        # a rank's share splits over its chunks; the runtime's overhead is paid per F and I
        # (posting their messages), whatever v: the simulator's rule (CostModel.t_overhead)
        self.durations = {kind: [shares[kind][r] / v + (overhead[r] if kind != "W" else 0.0)
                                 for r in self.owner] for kind in "FIW"}
        self.durations["B"] = [i + w for i, w in zip(self.durations["I"], self.durations["W"])]
        self.comm = [comm[r] for r in self.owner]
        self.memory = [activation[r] / v for r in self.owner]

    def large(self, m: int) -> bool:
        return 3 * m * len(self.owner) > LARGE

    def hops(self) -> int:
        """Slots a block's leg must advance per rank for a message to arrive in time."""
        chunk = min(min(self.durations[k]) for k in "FIW")
        if chunk <= 0:
            return 1
        return 1 + min(3, math.ceil(max(self.comm) / chunk - 1e-9))


def build_zb_auto(num_ranks: int, num_microbatches: int, chunks: int | None = None,
                  t_f=1.0, t_i=1.0, t_w=1.0, t_comm=0.0, memory_budget=None, activation=1.0,
                  effort: int = DEFAULT_EFFORT, forward_only: bool = False,
                  t_overhead=0.0) -> Schedule:
    """The fastest schedule found for these costs that fits ``memory_budget`` (see the
    module docstring). Raises ``ScheduleError`` when no candidate fits, naming the least
    memory any of them needs."""
    check_sizes(NAME, num_ranks, num_microbatches)
    require(chunks in (None, 1, 2), NAME, f"chunks v={chunks!r}: zb-auto builds for the loop "
            "layout (v = 1), the V layout (v = 2), or both (leave chunks out)")
    p, m = num_ranks, num_microbatches
    shares = {"F": _per_rank("t_f", t_f, p), "I": _per_rank("t_i", t_i, p),
              "W": _per_rank("t_w", t_w, p)}
    comm = _per_rank("t_comm", t_comm, p)
    overhead = _per_rank("t_overhead", t_overhead, p)
    activation = _per_rank("activation", activation, p)
    if memory_budget is None:
        cap = [p * activation[0]] * p  # 1F1B's peak, on rank 0
    else:
        cap = _per_rank("memory_budget", memory_budget, p, unbounded=True)  # inf: no budget
    layouts = [name for name, v in (("loop", 1), ("v", 2)) if chunks in (None, v)]
    found, needs = [], []
    for layout in (_Layout(name, p, shares, comm, activation, overhead) for name in layouts):
        for label, orders, makespan in _candidates(layout, p, m, cap):
            if makespan is None:  # the list scheduler knows its own; the others are played
                result = play(layout.owner, orders, layout.durations, layout.comm)
                if result is None:
                    continue
                makespan = result[0]
            peaks = [peak_memory(row, layout.memory) for row in orders]
            if any(peak > c * (1 + 1e-9) for peak, c in zip(peaks, cap)):
                worst = max(range(p), key=lambda r: peaks[r] / cap[r] if cap[r] else math.inf)
                needs.append((peaks[worst] / cap[worst] if cap[worst] else math.inf,
                              peaks[worst], label))
                continue
            found.append((makespan, max(peaks), len(found), label, layout, orders))
    if not found:
        ratio, need, label = min(needs) if needs else (math.inf, math.inf, "none")
        given = activation[0] if len(set(activation)) == 1 else activation
        amount = f"{need:.0f}" if need >= 1024 else f"{need:g}"  # bytes, or a count
        raise ScheduleError(
            f"{NAME}: no schedule fits memory_budget={memory_budget!r} (per rank, in the unit "
            f"of activation={given!r}) at p={p}, m={m}: the least any candidate needs is "
            f"{amount} ({label}), {ratio:.3g}x the budget; raise the budget, lower the "
            "micro-batch size, or recompute activations")
    found.sort(key=lambda c: (round(c[0], 9), c[1], c[2]))
    best = found[0]
    for name in layouts:  # each layout's fastest, refined (unless the layout is large)
        for makespan, peak, order, label, layout, orders in [
                c for c in found if c[4].name == name and not c[4].large(m)][:REFINED]:
            refined, span = refine(layout.owner, orders, layout.durations, layout.comm,
                                   layout.memory, cap, effort)
            if span < best[0] - 1e-9:
                best = (span, peak, order, f"{label}, refined", layout, refined)
    makespan, _, _, label, layout, orders = best
    schedule = Schedule(NAME, m, layout.owner, as_actions(orders),
                        {"synthesized_from": label, "predicted_makespan": round(makespan, 9)})
    return forwards_only(schedule) if forward_only else schedule


def _candidates(layout: _Layout, p: int, m: int, cap: Sequence[float]):
    """(label, orders, makespan or None) of every candidate of one layout, in a fixed
    order."""
    for name, builder in FIXED[layout.name]:
        try:
            yield name, as_orders(builder(p, m, chunks=1 if layout.name == "loop" else 2)
                                  .actions), None
        except ScheduleError:
            continue  # e.g. a builder's own size rule
    if layout.name == "v":
        yield "the published ZB-V", published_zb_v_orders(p, m), None
    large = layout.large(m)
    for policy in POLICIES[:2] if large else POLICIES:
        result = synthesize(layout.owner, m, layout.durations, layout.comm, layout.memory,
                            cap, policy)
        if result is not None:  # its makespan is play's: the same timing rule
            yield f"list scheduler ({policy.label()})", result.orders, result.makespan
    if layout.name == "v" and p > 1:
        hop = layout.hops()
        if hop > 1:
            for block in _blocks(p, hop, limit=1 if large else 3):
                yield f"V block {block}", block_orders(p, m, block), None


def _blocks(p: int, hop: int, limit: int = 3) -> list[Block]:
    """Up to ``limit`` blocks whose four legs all advance ``hop`` slots per rank, the turns
    as short as the 6-slot period allows."""
    out = []
    for total in range(0, 11):
        for turn0 in range(0, total + 1):
            block = Block(hop, hop, hop, hop, turn0=turn0, turn1=total - turn0)
            if block.fits(p):
                out.append(block)
                if len(out) == limit:
                    return out
    return out
