"""When each action of a schedule runs, under per-stage action times and message times: the
simulator's buffered model (``analysis.simulate``) in its leanest form, for the searches that
play thousands of candidate orders (``zb_auto``, ``refine``).

Each rank runs its list in order; an action starts when the rank is free and its input is
ready; an input made on another rank arrives ``t_comm`` (of the producing stage) after its
producer ends, one made on the same rank at once. Orders are lists of ``(stage, kind,
microbatch)`` tuples (hashing them is what the searches spend their time on).
"""

from __future__ import annotations

from typing import Sequence

from ..ir import BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, Action

Order = list[tuple[int, str, int]]

_GRAD = "G"  # what a B or an I hands on: the input gradient


def as_orders(actions: Sequence[Sequence[Action]]) -> list[Order]:
    return [[(a.stage, a.kind, a.microbatch) for a in row] for row in actions]


def as_actions(orders: Sequence[Order]) -> list[list[Action]]:
    return [[Action(s, k, mb) for s, k, mb in row] for row in orders]


def compile_row(rank: int, row: Order, owner: Sequence[int],
                durations: dict[str, Sequence[float]], t_comm: Sequence[float]) -> list:
    """One rank's order as ``(key, input key or None, message time, duration)`` per action:
    what ``play`` reads (keys: ``(kind, stage, microbatch)``, B and I under ``"G"``)."""
    last = len(owner) - 1
    out = []
    for stage, kind, mb in row:
        if kind == FORWARD:
            dep = (FORWARD, stage - 1, mb) if stage > 0 else None
        elif kind == BACKWARD_WEIGHT or stage == last:
            dep = None  # its I (or, at the loss, its F) ran earlier on this rank
        else:
            dep = (_GRAD, stage + 1, mb)
        comm = t_comm[dep[1]] if dep is not None and owner[dep[1]] != rank else 0.0
        key = (_GRAD if kind in (BACKWARD, BACKWARD_INPUT) else kind, stage, mb)
        out.append((key, dep, comm, durations[kind][stage]))
    return out


def play(owner: Sequence[int], orders: Sequence[Order], durations: dict[str, Sequence[float]],
         t_comm: Sequence[float], compiled: Sequence[list] | None = None):
    """``(makespan, start, end)`` (start and end keyed by ``(kind, stage, microbatch)``,
    B and I under ``"G"``), or None when some rank can never go on. ``compiled``: the rows
    as ``compile_row`` gives them, when the caller has them."""
    rows = compiled if compiled is not None else [
        compile_row(rank, row, owner, durations, t_comm) for rank, row in enumerate(orders)]
    end: dict = {}
    start: dict = {}
    position = [0] * len(rows)
    free = [0.0] * len(rows)
    left = sum(len(row) for row in rows)
    progress = True
    while progress:
        progress = False
        for rank, row in enumerate(rows):
            at = first = position[rank]
            t_free = free[rank]
            for key, dep, comm, duration in row[first:] if first else row:
                t = t_free
                if dep is not None:
                    ready = end.get(dep)
                    if ready is None:
                        break
                    ready += comm
                    if ready > t:
                        t = ready
                start[key] = t
                t_free = t + duration
                end[key] = t_free
                at += 1
            if at != first:
                left -= at - first
                position[rank], free[rank] = at, t_free
                progress = True
    if left:
        return None
    return max(free, default=0.0), start, end


def live_after(order: Order, stage_memory: Sequence[float]) -> list[float]:
    """The activation memory a rank holds after each action of ``order``: an F's activation
    lives until its W (or its B) ends (``validate.activation_trace``'s rule, weighted)."""
    freed = {(s, mb) for s, k, mb in order if k in (BACKWARD, BACKWARD_WEIGHT)}
    out, live = [], 0.0
    for stage, kind, mb in order:
        if kind == FORWARD and (stage, mb) in freed:
            live += stage_memory[stage]
        elif kind in (BACKWARD, BACKWARD_WEIGHT):
            live -= stage_memory[stage]
        out.append(live)
    return out


def peak_memory(order: Order, stage_memory: Sequence[float]) -> float:
    """The most activation memory ``order`` holds at once on its rank (``live_after``)."""
    return max(live_after(order, stage_memory), default=0.0)
