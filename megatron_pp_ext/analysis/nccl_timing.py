"""Time a lowered P2P program under NCCL's rules: the simulator's communication model on NCCL.

``check_nccl_rules`` plays a program to prove it cannot hang; this plays the same program
with clocks, under the same rules, to say how long it takes:

* a rank's host runs its steps in order: a compute step takes its cost, posting a batch takes
  no time, a ``Wait`` blocks the host until that batch has completed (the gap is a COMM_WAIT);
* a rank's batches run one after another on its communication stream: a batch starts at the
  later of its posting and the end of the rank's previous batch;
* rendezvous: a send and its matching receive (the k-th of each, per ordered pair) transfer
  together once both their batches run, and take the sending stage's ``t_comm``; a batch ends
  when its last op does (its ops run concurrently, as in one NCCL group).

The buffered model in ``simulate`` lets a message leave the moment its producer ends; here it
leaves only once both sides have posted and their streams are free, which is what makes a
fused ``send_forward_recv_backward`` hold the next forward's data, or a lockstep round wait
for its slowest member. Pure: no torch, no communication.
"""

from __future__ import annotations

import functools
import re
from collections import defaultdict

from ..ir import Action, Schedule, ScheduleError
from ..timeline import COMM_WAIT, COMPUTE, P2P, Event, Timeline
from ..program import SEND, Batch, Compute, Post, Program, Wait
from .gc_pause import gc_paused
from .nccl_rules import check_nccl_rules

_MESSAGE = re.compile(r"(forward|backward) (\d+)[FB]\d+$")


@functools.lru_cache(maxsize=1 << 16)  # the labels of a few programs timed in a row
def _sending_stage(label: str) -> int:
    """The stage that sends the message ``label`` names ("forward 3F2": stage 2 sends it)."""
    match = _MESSAGE.search(label)
    if match is None:
        raise ScheduleError(f"cannot tell which stage sends the P2P message {label!r}")
    receiver = int(match.group(2))
    return receiver - 1 if match.group(1) == "forward" else receiver + 1


@gc_paused
def time_program(program: Program, schedule: Schedule, duration: dict[str, list[float]],
                 t_comm: list[float], peak_activations: list[int],
                 check: bool = True) -> Timeline:
    """The predicted timeline of ``program`` (lowered from ``schedule``): ``duration`` maps an
    action kind to its per-stage time, ``t_comm`` is each sending stage's message time.

    Adds P2P events (a batch in flight on the rank's stream, beside its compute) to the
    compute and wait events. Checks NCCL's rules first (``check=False`` to skip a program
    already checked); a program that cannot finish raises ``ScheduleError``."""
    if check:
        check_nccl_rules(program)
    clock = _Clock(program, duration, t_comm)
    clock.run()
    return Timeline.of_schedule(schedule, clock.events, peak_activations, "predicted", "t")


@gc_paused
def unit_cost_makespan(program: Program, schedule: Schedule, t_comm: float) -> float:
    """The step time of a checked ``program`` with every F, I and W costing 1 (B 2) and
    every message ``t_comm``: how the lowering compares two postings of one schedule."""
    stages = schedule.num_stages
    duration = {"F": [1.0] * stages, "B": [2.0] * stages, "I": [1.0] * stages,
                "W": [1.0] * stages}
    clock = _Clock(program, duration, [t_comm] * stages)
    clock.run()
    return max((e.end for e in clock.events), default=0.0)


@functools.lru_cache(maxsize=1 << 16)  # the actions of a few programs timed in a row
def _parsed(text: str) -> Action:
    return Action.parse(text)


class _Clock:
    def __init__(self, program: Program, duration: dict[str, list[float]],
                 t_comm: list[float]):
        self.program, self.duration, self.t_comm = program, duration, t_comm
        n = len(program.steps)
        self.host = [0] * n  # next step of each rank's host
        self.now = [0.0] * n  # each rank's host clock
        self.posted: list[list[tuple[Batch, float]]] = [[] for _ in range(n)]
        self.started = [0] * n  # how many of each rank's posted batches have started
        self.start: dict[tuple[int, int], float] = {}  # (rank, batch) -> start on its stream
        self.end: dict[tuple[int, int], float] = {}  # (rank, batch) -> completion
        self.op_end: dict[tuple[int, int, int], float] = {}
        self.sends, self.recvs = defaultdict(list), defaultdict(list)  # pair -> [(batch, op)]
        self.matched: dict[tuple[int, int], int] = defaultdict(int)
        self.events: list[Event] = []

    def run(self) -> None:
        moved = True
        while moved:
            moved = any([self._advance_host(r) for r in range(len(self.host))])
            moved |= self._start_batches()
            moved |= self._transfer()
            moved |= self._complete_batches()
        if any(h < len(s) for h, s in zip(self.host, self.program.steps)):
            raise ScheduleError(f"{self.program.name}: cannot finish under NCCL's rules "
                                "(check_nccl_rules names the cycle)")

    def _advance_host(self, rank: int) -> bool:
        steps, moved = self.program.steps[rank], False
        while self.host[rank] < len(steps):
            step = steps[self.host[rank]]
            if isinstance(step, Wait):
                end = self.end.get((rank, step.batch))
                if end is None:
                    break
                if end > self.now[rank]:
                    self.events.append(Event(rank, f"wait batch #{step.batch}"
                                             + (f" ({step.why})" if step.why else ""),
                                             self.now[rank], end, COMM_WAIT))
                    self.now[rank] = end
            elif isinstance(step, Post):
                self._post(rank, step.batch)
            elif isinstance(step, Compute):
                action = _parsed(step.action)
                end = self.now[rank] + self.duration[action.kind][action.stage]
                self.events.append(Event(rank, step.action, self.now[rank], end, COMPUTE))
                self.now[rank] = end
            self.host[rank] += 1
            moved = True
        return moved

    def _post(self, rank: int, batch: Batch) -> None:
        self.posted[rank].append((batch, self.now[rank]))
        for i, op in enumerate(batch.ops):
            pair = (rank, op.peer) if op.kind == SEND else (op.peer, rank)
            (self.sends if op.kind == SEND else self.recvs)[pair].append((batch, i))

    def _start_batches(self) -> bool:
        """A posted batch starts once the rank's previous batch has ended (so each rank's
        started batches are a prefix of its posted ones: ``started[rank]`` of them)."""
        moved = False
        for rank, posted in enumerate(self.posted):
            while self.started[rank] < len(posted):
                batch, posted_at = posted[self.started[rank]]
                key = (rank, batch.index)
                previous = self.end.get((rank, batch.index - 1), 0.0) if batch.index else 0.0
                if batch.index and (rank, batch.index - 1) not in self.end:
                    break
                self.start[key] = max(posted_at, previous)
                self.started[rank] += 1
                moved = True
                if not batch.ops:
                    self.end[key] = self.start[key]
        return moved

    def _transfer(self) -> bool:
        moved = False
        for pair, sends in self.sends.items():
            recvs, k = self.recvs.get(pair, []), self.matched[pair]
            while k < len(sends) and k < len(recvs):
                (sb, si), (rb, ri) = sends[k], recvs[k]
                send_start = self.start.get((sb.rank, sb.index))
                recv_start = self.start.get((rb.rank, rb.index))
                if send_start is None or recv_start is None:
                    break
                done = max(send_start, recv_start) + self.t_comm[
                    _sending_stage(sb.ops[si].label)]
                self.op_end[(sb.rank, sb.index, si)] = done
                self.op_end[(rb.rank, rb.index, ri)] = done
                k += 1
                moved = True
            self.matched[pair] = k
        return moved

    def _complete_batches(self) -> bool:
        """Only a rank's last started batch can be running: each starts after the one before
        it has ended."""
        moved = False
        for rank, posted in enumerate(self.posted):
            if not self.started[rank]:
                continue
            batch, _ = posted[self.started[rank] - 1]
            key = (rank, batch.index)
            if key in self.end:
                continue
            ends = [self.op_end.get((rank, batch.index, i)) for i in range(len(batch.ops))]
            if any(e is None for e in ends):
                continue
            self.end[key] = max(ends)
            self.events.append(Event(rank, f"#{batch.index} {batch.call or 'p2p'}",
                                     self.start[key], self.end[key], P2P))
            moved = True
        return moved


__all__ = ["time_program", "unit_cost_makespan"]
