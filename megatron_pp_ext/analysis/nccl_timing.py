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

import re

from ..ir import Action, Schedule, ScheduleError
from ..timeline import COMM_WAIT, COMPUTE, P2P, Event, Timeline
from ..program import Batch, Compute, Program, Wait
from .gc_pause import gc_paused
from .nccl_rules import RulesPlay

_DIGITS = "0123456789"
_MESSAGE = re.compile(r"(forward|backward) (\d+)[FB]\d+$")


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
    compute and wait events. Checks NCCL's rules in the same play (``check=False`` for a
    program already checked); a program that cannot finish raises ``ScheduleError``."""
    clock = _Clock(len(program.steps), duration, t_comm)
    play_with_clocks(program, [clock], check=check)
    return Timeline.of_schedule(schedule, clock.events, peak_activations, "predicted", "t")


@gc_paused
def unit_cost_makespans(program: Program, schedule: Schedule, t_comms: tuple[float, ...],
                        feeds: list | None = None, check: bool = False) -> list[float]:
    """The step time of ``program`` with every F, I and W costing 1 (B 2), for each message
    time in ``t_comms``, all from one play (how the lowering compares two postings of one
    schedule). ``check``: NCCL's rules checked in that play (``feeds``: lowered as it goes, as
    ``check_nccl_rules`` takes them), raising ``ScheduleError`` as it does."""
    stages = schedule.num_stages
    duration = {"F": [1.0] * stages, "B": [2.0] * stages, "I": [1.0] * stages,
                "W": [1.0] * stages}
    clocks = [_Clock(len(program.steps), duration, [t] * stages, keep_events=False)
              for t in t_comms]
    play_with_clocks(program, clocks, feeds, check)
    return [clock.makespan() for clock in clocks]


_HOOKS = ("on_post", "on_start", "on_transfer", "on_complete", "on_compute", "on_wait")


def play_with_clocks(program: Program, clocks: list["_Clock"], feeds: list | None = None,
                     check: bool = True) -> None:
    """One play of ``program`` under NCCL's rules driving every clock in ``clocks`` (the play,
    most of the work, is shared: the clocks only add). ``check``: explain a hang as
    ``check_nccl_rules`` does and check the messages' pairing."""
    play = RulesPlay(program, feeds)
    for hook in _HOOKS:  # the play calls self.on_post(...): an instance attribute wins
        bound = [getattr(clock, hook) for clock in clocks]
        setattr(play, hook, bound[0] if len(bound) == 1 else _fan_out(bound))
    if check:
        play.check()
    elif play.play():
        raise ScheduleError(f"{program.name}: cannot finish under NCCL's rules "
                            "(check_nccl_rules names the cycle)")


def _fan_out(hooks: list):
    def call(*args):
        for hook in hooks:
            hook(*args)
    return call


class _Clock:
    """The hooks of ``nccl_play`` with clocks: each rank's host clock, each batch's start on
    its rank's stream and its end, each transfer's end; the events of the timeline.

    A rank's batches start in posting order and one runs at a time, so the clock keeps, per
    rank, the posting times not yet started and the running batch's start and latest
    transfer end: lists indexed by rank, no lookups by batch."""

    def __init__(self, ranks: int, duration: dict[str, list[float]], t_comm: list[float],
                 keep_events: bool = True):
        self.keep_events = keep_events  # False: the step time only (``makespan``)
        self.duration, self.t_comm = duration, t_comm
        self.now = [0.0] * ranks  # each rank's host clock
        self.posted_at: list[list[float]] = [[] for _ in range(ranks)]  # in posting order
        self.started = [0] * ranks  # how many of the rank's batches have started
        self.running_start = [0.0] * ranks  # the running batch's start on the stream
        self.running_end = [_NEVER] * ranks  # its latest transfer's end so far
        self.end: list[dict[int, float]] = [{} for _ in range(ranks)]  # batch index -> its end
        self.events: list[Event] = []
        # an action's cost and a message's time by their text less the microbatch ("12F",
        # "forward 3F"): a few hundred keys, where a program has 10^5 actions and messages
        self._cost: dict[str, float] = {}
        self._comm: dict[str, float] = {}

    def _cost_of(self, text: str) -> float:
        key = text.rstrip(_DIGITS)
        cost = self._cost.get(key)
        if cost is None:
            action = Action.parse(text)
            cost = self._cost[key] = self.duration[action.kind][action.stage]
        return cost

    def _comm_of(self, label: str) -> float:
        key = label.rstrip(_DIGITS)
        t = self._comm.get(key)
        if t is None:
            t = self._comm[key] = self.t_comm[_sending_stage(label)]
        return t

    def makespan(self) -> float:
        """When the last host or stream is done."""
        return max([*self.now, *(end for ends in self.end for end in ends.values())],
                   default=0.0)

    def on_wait(self, rank: int, step: Wait) -> None:
        end = self.end[rank][step.batch]
        if end > self.now[rank]:
            if self.keep_events:
                self.events.append(Event(rank, f"wait batch #{step.batch}"
                                         + (f" ({step.why})" if step.why else ""),
                                         self.now[rank], end, COMM_WAIT))
            self.now[rank] = end

    def on_compute(self, rank: int, step: Compute) -> None:
        end = self.now[rank] + self._cost_of(step.action)
        if self.keep_events:
            self.events.append(Event(rank, step.action, self.now[rank], end, COMPUTE))
        self.now[rank] = end

    def on_post(self, rank: int, batch: Batch) -> None:
        self.posted_at[rank].append(self.now[rank])

    def on_start(self, rank: int, batch: Batch, previous: Batch | None) -> None:
        """A batch starts at the later of its posting and the end of the one before it."""
        posted = self.posted_at[rank][self.started[rank]]
        self.started[rank] += 1
        previous_end = 0.0 if previous is None else self.end[rank][previous.index]
        self.running_start[rank] = posted if posted > previous_end else previous_end
        self.running_end[rank] = _NEVER

    def on_transfer(self, send: tuple, recv: tuple) -> None:
        (batch, op), sender, receiver = send, send[0].rank, recv[0].rank
        start = self.running_start  # both batches run: each its rank's running one
        a, b = start[sender], start[receiver]
        done = (a if a > b else b) + self._comm_of(batch.ops[op].label)
        ends = self.running_end
        if done > ends[sender]:
            ends[sender] = done
        if done > ends[receiver]:
            ends[receiver] = done

    def on_complete(self, rank: int, batch: Batch) -> None:
        """A batch ends when its last op does (one with no ops, when it starts)."""
        start, last = self.running_start[rank], self.running_end[rank]
        end = self.end[rank][batch.index] = start if last == _NEVER else last
        if batch.ops and self.keep_events:
            self.events.append(Event(rank, f"#{batch.index} {batch.call or 'p2p'}",
                                     start, end, P2P))


_NEVER = float("-inf")  # no transfer of the running batch has ended yet


__all__ = ["play_with_clocks", "time_program", "unit_cost_makespans"]
