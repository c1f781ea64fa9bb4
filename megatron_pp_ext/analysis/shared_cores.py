"""Ranks that share a machine's cores: what a measured action would have cost alone, and the
prediction when the ranks compute on fewer cores than there are ranks. No torch.

On a machine with C cores and R > C ranks (the CPU job: 4 ranks on 2 cores), k ranks that
compute at once each progress at min(1, C / k) of their own speed (the operating system shares
the cores; a rank that waits for a message sleeps and takes none). A measured action's
duration is then stretched by whatever else ran beside it, and a prediction that prices each
action at its measured mean and lets every rank run at full speed is wrong twice: it counts
the contention in every action, also in the ones that in the real step ran alone, and it
misses that a rank computes faster while its neighbours wait.

:func:`alone_on_a_core` takes the contention out of a measured timeline (each compute
event's work: the integral of min(1, C / k(t)) over it, k counting the compute and the host's
time between actions) and gives that host time per action, and
:func:`simulate_shared_cores` predicts the step under those costs with the cores shared
(processor sharing, event by event, the dependencies and messages as in ``simulate``'s
buffered rule; the host's part of an action before its compute, outside the compute event,
as a measured step shows it).
"""

from __future__ import annotations

import os
from dataclasses import replace

from ..ir import BACKWARD_WEIGHT, Action, Schedule
from ..schedules.validate import (completion_key, dependencies, explain_blocked,
                                  peak_activations)
from ..timeline import COMM_WAIT, COMPUTE, Event, Timeline
from .simulate import CostModel, action_durations

_EPS = 1e-12


def core_share(busy: int, cores: float) -> float:
    """The speed of each of ``busy`` ranks computing at once on ``cores`` cores."""
    return 1.0 if busy <= cores else cores / busy


def _busy(measured: Timeline) -> list[tuple[float, float, int, Event | None]]:
    """What took a core on each rank: its compute events, and the host's time from the step's
    start (0) to its first event and between two of its events (posting messages, Python
    between actions: ``None``)."""
    busy = []
    for rank in range(measured.num_ranks):
        mine = sorted((e for e in measured.events if e.rank == rank), key=lambda e: e.start)
        busy += [(e.start, e.end, rank, e) for e in mine if e.category == COMPUTE]
        ends = [0.0] + [e.end for e in mine]
        busy += [(end, e.start, rank, None) for end, e in zip(ends, mine) if e.start > end]
    return busy


def _work(busy: list, cores: float) -> list[float]:
    """Each busy interval's work: its length times the core share over it."""
    edges = sorted({t for lo, hi, _, _ in busy for t in (lo, hi)})
    order = sorted(range(len(busy)), key=lambda i: busy[i][0])
    work = [0.0] * len(busy)
    active: list[int] = []
    nxt = 0
    for left, right in zip(edges, edges[1:]):
        while nxt < len(order) and busy[order[nxt]][0] <= left:
            active.append(order[nxt])
            nxt += 1
        active = [i for i in active if busy[i][1] > left]
        share = core_share(len(active), cores)
        for i in active:
            work[i] += (right - left) * share
    return work


def _check(cores: float) -> None:
    if cores <= 0:
        raise ValueError(f"cores={cores}: the ranks need a share of at least one core")


def alone_on_a_core(measured: Timeline, cores: float) -> tuple[Timeline, list[float]]:
    """What ``measured`` would have cost alone on a core: the timeline with every compute
    event shortened to the work it did (its duration times the mean speed the cores gave it:
    ``core_share`` of what ran beside it, compute and the host's time between actions, itself
    included), whose means are the actions' costs; and per rank the host's work between
    actions per F, B or I action (``CostModel.t_overhead``, which the simulator adds to those
    kinds)."""
    _check(cores)
    busy = _busy(measured)
    work = _work(busy, cores)
    done = {id(event): w for (_, _, _, event), w in zip(busy, work) if event is not None}
    events = [replace(e, end=e.start + done[id(e)]) if e.category == COMPUTE else e
              for e in measured.events]
    host, actions = [0.0] * measured.num_ranks, [0] * measured.num_ranks
    for (_, _, rank, event), w in zip(busy, work):
        if event is None:
            host[rank] += w
        elif Action.parse(event.label).kind != BACKWARD_WEIGHT:
            actions[rank] += 1
    return (replace(measured, events=events),
            [h / n if n else 0.0 for h, n in zip(host, actions)])


def wake_delay(cpus: int | None = None) -> float:
    """How long a rank woken while every core is taken waits, on average, before it runs:
    half of Linux's base slice, the time a running task keeps its core before a woken one
    may take it (EEVDF, Linux 6.6 and later: 0.75 ms x (1 + log2 of the machine's CPUs, at
    most 8); 1.5 ms on 2 CPUs, so 0.75 ms). ``cpus``: this machine's by default."""
    cpus = max(1, min(8, int(cpus or os.cpu_count() or 1)))
    return 0.5 * 0.00075 * cpus.bit_length()


def simulate_shared_cores(schedule: Schedule, costs: CostModel, cores: float,
                          woken_wait: float = 0.0) -> Timeline:
    """The predicted timeline of ``schedule`` when its ranks share ``cores`` cores: each
    action's cost (``costs``, alone on a core) is worked off at ``core_share`` of the ranks
    computing at that moment; a message arrives ``t_comm`` after its producer ends.
    ``woken_wait`` (``wake_delay``): a rank that becomes ready while ``cores`` ranks already
    compute waits that long (idle, as a measured step shows it: its action starts only once
    it runs) before it takes its share, unless a core frees first."""
    _check(cores)
    cost = costs.per_stage(schedule)
    duration, t_comm, overhead = action_durations(cost), cost["t_comm"], cost["t_overhead"]
    owner, rows = schedule.stage_to_rank, schedule.actions
    position = [0] * len(rows)
    free_at = [0.0] * len(rows)  # when each idle rank finished its last action
    done_at: dict = {}
    # rank -> [action, start of its compute, the host's work left, work left in all, when it
    # takes its share]: the host's part (t_overhead) first, then the compute, which alone is
    # a compute event
    running: dict[int, list] = {}
    events: list[Event] = []
    now = 0.0
    dependency = dependencies(schedule)
    while True:
        next_ready = None
        for rank, row in enumerate(rows):
            if rank in running or position[rank] >= len(row):
                continue
            action = row[position[rank]]
            dep = dependency(action)
            ready = free_at[rank]
            if dep is not None:
                if dep not in done_at:
                    continue  # woken when its producer completes
                producer = owner[dep[1]]
                arrival = done_at[dep] + (t_comm[dep[1]] if producer != rank else 0.0)
                ready = max(ready, arrival)
            if ready <= now + _EPS:
                if dep is not None and ready > free_at[rank] + _EPS:
                    events.append(Event(rank, f"wait {action}<-rank {owner[dep[1]]}",
                                        free_at[rank], ready, COMM_WAIT))
                host = overhead[action.stage] if action.kind != BACKWARD_WEIGHT else 0.0
                sharing = sum(1 for entry in running.values() if entry[4] <= now + _EPS)
                joins = now + woken_wait if sharing >= cores else now
                running[rank] = [action, None, host, duration[action.kind][action.stage],
                                 joins]
            else:
                next_ready = ready if next_ready is None else min(next_ready, ready)
        if not running and next_ready is None:
            break
        active = [entry for entry in running.values() if entry[4] <= now + _EPS]
        if len(active) < cores:  # a free core: the woken ones waiting take it now
            for entry in running.values():
                entry[4] = min(entry[4], now)
            active = list(running.values())
        for entry in active:
            if entry[1] is None and entry[2] <= _EPS:
                entry[1] = now  # no host part (left): the compute starts
        share = core_share(len(active), cores)
        # the next end of a host part or of an action, at this share, or a woken one's turn
        step = min([*((host if host > _EPS else left) / share
                      for _, _, host, left, _ in active),
                    *(entry[4] - now for entry in running.values() if entry[4] > now + _EPS)],
                   default=None)
        until = now + step if step is not None else next_ready
        if next_ready is not None and next_ready < until:
            until = next_ready
        for entry in active:
            entry[2] -= (until - now) * share
            entry[3] -= (until - now) * share
        now = until
        for entry in active:
            if entry[1] is None and entry[2] <= _EPS:
                entry[1] = now  # the host's part done: the compute starts
        done = [r for r, entry in running.items() if entry[3] <= _EPS and entry[1] is not None]
        for rank in done:
            action, start, _, _, _ = running.pop(rank)
            events.append(Event(rank, str(action), start, now, COMPUTE))
            done_at[completion_key(action)] = now
            position[rank] += 1
            free_at[rank] = now
    explain_blocked(schedule, position)  # raises if some rank could not finish
    return Timeline.of_schedule(schedule, events, peak_activations(schedule), "predicted", "s")


__all__ = ["alone_on_a_core", "core_share", "simulate_shared_cores", "wake_delay"]
