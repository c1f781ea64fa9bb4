"""Refine a schedule by filling its gaps: a local search over its per-rank orders.

Played under the costs (``timing.play``), a rank that waits before an action leaves a gap.
A move takes one of the next ``window`` actions of that rank and runs it in the gap, i.e.
just before the action that waited; or, where an action's input was there but a W held the
rank, runs that W just after the action instead. A move is kept when the makespan drops (or
stays and the sum of all end times drops, which frees the way for a later move), the rank's
activation peak stays within its cap, and each stage's forwards, input gradients and weight
gradients keep their microbatch order and an F its I and its W. Every kept move is a schedule
that runs: ``play`` refuses one where some rank can never go on. The search stops after a
cycle over the ranks without a kept move, or when ``budget`` action-plays are spent (a play of
A actions costs A): deterministic, and bounded whatever the size.
"""

from __future__ import annotations

from typing import Sequence

from ..ir import BACKWARD_WEIGHT, FORWARD
from .timing import Order, compile_row, live_after, play

_EPS = 1e-9


def refine(owner: Sequence[int], orders: Sequence[Order], durations: dict,
           t_comm: Sequence[float], stage_memory: Sequence[float], cap: Sequence[float],
           budget: int, window: int = 16) -> tuple[list[Order], float]:
    """The refined orders and their makespan (``orders`` unchanged when nothing helps)."""
    orders = [list(row) for row in orders]
    compiled = [compile_row(r, row, owner, durations, t_comm) for r, row in enumerate(orders)]
    result = play(owner, orders, durations, t_comm, compiled)
    if result is None:
        return orders, float("inf")
    size = max(1, sum(len(row) for row in orders))
    spent = size
    best, start, end = result
    score = sum(end.values())
    rank, idle_ranks = 0, 0  # ranks in a row without a kept move: a full cycle ends it
    while idle_ranks < len(orders) and spent + size <= budget:
        moved = _fill_a_gap(owner, orders, compiled, rank, start, end, durations, t_comm,
                            stage_memory, cap[rank], best, score, window, budget - spent, size)
        spent += moved[0]
        if moved[1] is None:
            idle_ranks += 1
            rank = (rank + 1) % len(orders)
        else:  # stay on this rank: its next gap may take a move too
            candidate, (best, start, end), score = moved[1]
            orders[rank] = candidate
            compiled[rank] = compile_row(rank, candidate, owner, durations, t_comm)
            idle_ranks = 0
    return orders, best


def _may_move_before(row: Order, i: int, j: int) -> bool:
    """Whether ``row[j]`` may run before ``row[i:j]``: none of them is an earlier microbatch
    of its stage and kind, or its own F or I."""
    stage, kind, mb = row[j]
    for other_stage, other_kind, other_mb in row[i:j]:
        if other_stage == stage and (other_kind == kind or other_mb == mb):
            return False
    return True


def _fill_a_gap(owner, orders, compiled, rank, start, end, durations, t_comm, stage_memory,
                cap, best, score, window, allowance, size):
    """(plays spent, None or the accepted (the rank's new order, play result, score))."""
    spent, free = 0, 0.0
    live = None
    row = orders[rank]

    def trial(candidate):
        rows = compiled[:rank] + [compile_row(rank, candidate, owner, durations, t_comm)] + \
            compiled[rank + 1:]
        result = play(owner, None, durations, t_comm, rows)
        if result is None:
            return None
        trial_score = sum(result[2].values())
        if result[0] < best - _EPS or (result[0] <= best + _EPS and trial_score < score - _EPS):
            return candidate, result, trial_score
        return None

    for i, action in enumerate(row):
        key, dep, comm, _ = compiled[rank][i]
        if start[key] > free + _EPS:
            for j in range(i + 1, min(len(row), i + window)):
                if not _may_move_before(row, i, j):
                    continue
                moved = row[j]
                if moved[1] == FORWARD:  # held from here on: every slot it passes holds more
                    live = live or live_after(row, stage_memory)
                    before = live[i - 1] if i else 0.0
                    if max([before] + live[i:j]) + stage_memory[moved[0]] > cap + _EPS:
                        continue
                if spent + size > allowance:
                    return spent, None
                spent += size
                kept = trial(row[:i] + [moved] + row[i:j] + row[j + 1:])
                if kept is not None:
                    return spent, kept
        elif i and row[i - 1][1] == BACKWARD_WEIGHT and dep is not None and \
                end[dep] + comm < start[key] - _EPS:
            # the input was there and a W held the rank: run the W after this action instead
            w = row[i - 1]
            live = live or live_after(row, stage_memory)
            held = live[i - 1] + stage_memory[w[0]]  # the W's memory, kept one action longer
            if action[1] == FORWARD:
                held += stage_memory[action[0]]
            if held <= cap + _EPS and spent + size <= allowance:
                spent += size
                kept = trial(row[:i - 1] + [action, w] + row[i + 1:])
                if kept is not None:
                    return spent, kept
        free = end[key]
    return spent, None
