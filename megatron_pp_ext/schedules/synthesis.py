"""Synthesize a split-backward schedule from per-stage costs and a per-rank memory cap.

A list scheduler (the Zero Bubble paper's approach, Qi et al. 2024, section 4: build the order
by simulating it), written for any placement of stages on ranks (the loop layout, v = 1, and
the V layout). It plays the pipeline forward in time. Whenever a rank is free it picks its
next action among those whose input has arrived:

* each stage runs its forwards (F) and its input gradients (I) in microbatch order, and its
  weight gradients (W) in the order its I's ran (a W is always ready: its I ran here);
* an I before an F (``Policy.backward_first``), else the other way round; an F is admitted only
  while the rank's live activations plus the F's own stay within its cap, and, on a rank whose
  microbatches come back to it (the V layout's second chunk), with room kept for every
  microbatch that has still to come back: so the cap can never deadlock the pipeline;
* with nothing else ready, a W fills the gap; ``Policy.w_lookahead`` waits instead when an I
  or F arrives so soon that the W would delay it by more than the wait costs;
* with nothing at all ready, the rank waits for the earliest known arrival.

An action's input made on another rank arrives ``t_comm`` (of the producing stage) after the
producer ends; a handoff on the same rank is free: the simulator's buffered model
(``analysis.simulate``), so the makespan found here is the one ``simulate`` predicts.

Activation memory follows the validator's rule (``validate.activation_trace``): an F's
activation lives until its W ends. Costs: one float per stage per kind (the time of one action
of that stage); memory: per-stage units per F and a per-rank cap, in any unit (bytes, or
counts).

Cost: every decision looks at a rank's stages' next F and I and its W queue, O(1); each
scheduled action re-decides at most two ranks (its own and its message's receiver) through a
heap, so one synthesis is O(A log p) for A actions: p = 32, m = 256 on the V layout (49 152
actions) takes well under a second. Pure Python, no torch, deterministic.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass
from typing import Sequence

from ..ir import BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, Action

_EPS = 1e-9


@dataclass(frozen=True)
class Policy:
    """The knobs the synthesis searches over (``POLICIES``)."""

    backward_first: bool = True  # a ready I before a ready F
    w_lookahead: bool = False  # wait for an arrival rather than let a W delay it more
    deep_forward_first: bool = True  # of two ready F's, the later stage's first
    alternate: bool = False  # after an I an F first, after an F an I first (1F1B's rhythm)
    taper: bool = False  # rank r admits at most p - r microbatches past F and short of I
    hoard: bool = False  # rank r keeps its spare memory's worth of W's for the cooldown
    drain: bool = False  # once a rank's forwards are done, no W may delay an input gradient
    free_first: bool = False  # a W first while an arrived forward waits for its memory

    def label(self) -> str:
        return ("I>F" if self.backward_first else "F>I") + \
               (",wait" if self.w_lookahead else "") + \
               ("" if self.deep_forward_first else ",shallow-F") + \
               (",alternate" if self.alternate else "") + (",taper" if self.taper else "") + \
               (",hoard" if self.hoard else "") + (",drain" if self.drain else "") + \
               (",free-first" if self.free_first else "")


#: The policies the synthesis tries, in this order: the eight that, over 96 cases (p = 4, 8;
#: m = 2p, 4p; messages of 0, 0.3 and 1 forward; equal stages and a last stage 1.5x heavier;
#: budgets of 1F1B's memory and 0.6 of it; both layouts), came within 2.5% of the best of all
#: 256 settings of the knobs (each added where it lowered the worst case most).
POLICIES = (
    Policy(backward_first=False, deep_forward_first=False, alternate=True, drain=True),
    Policy(w_lookahead=True, drain=True),
    Policy(backward_first=False, w_lookahead=True, deep_forward_first=False, alternate=True,
           hoard=True, free_first=True),
    Policy(deep_forward_first=False, hoard=True),
    Policy(hoard=True, drain=True),
    Policy(backward_first=False, deep_forward_first=False, taper=True, hoard=True),
    Policy(w_lookahead=True, free_first=True),
    Policy(deep_forward_first=False, taper=True, free_first=True),
)


@dataclass
class Synthesized:
    orders: list[list[tuple[int, str, int]]]  # per rank, (stage, kind, microbatch)
    makespan: float
    policy: Policy
    cap: tuple[float, ...]

    @property
    def actions(self) -> list[list[Action]]:
        return [[Action(*a) for a in row] for row in self.orders]


def synthesize(stage_to_rank: Sequence[int], num_microbatches: int,
               durations: dict[str, Sequence[float]], t_comm: Sequence[float],
               stage_memory: Sequence[float], cap: Sequence[float],
               policy: Policy = Policy()) -> Synthesized | None:
    """Every rank's action list under ``policy``, or None when the cap admits no schedule
    (a rank cannot hold what one microbatch needs there). ``durations``: ``F``, ``I``, ``W``
    each one float per stage; ``t_comm``, ``stage_memory``: one float per stage; ``cap``: one
    float per rank."""
    return _Synthesis(stage_to_rank, num_microbatches, durations, t_comm, stage_memory, cap,
                      policy).run()


class _Synthesis:
    def __init__(self, owner, m, durations, t_comm, stage_memory, cap, policy):
        self.owner, self.m, self.policy = tuple(owner), m, policy
        self.num_stages = len(self.owner)
        ranks = max(self.owner) + 1
        self.stages_of = [[s for s in range(self.num_stages) if self.owner[s] == r]
                          for r in range(ranks)]
        self.dur = {k: list(durations[k]) for k in (FORWARD, BACKWARD_INPUT, BACKWARD_WEIGHT)}
        self.comm, self.mem, self.cap = list(t_comm), list(stage_memory), list(cap)
        # arrival time of each (stage, microbatch)'s input, None until its producer is placed
        self.f_arrival = [[None] * m for _ in range(self.num_stages)]
        self.f_arrival[0] = [0.0] * m
        self.i_arrival = [[None] * m for _ in range(self.num_stages)]
        self.next_f = [0] * self.num_stages
        self.next_i = [0] * self.num_stages
        self.pending_w = [deque() for _ in range(ranks)]
        self.live = [0.0] * ranks
        self.free_at = [0.0] * ranks
        self.rows = [[] for _ in range(ranks)]
        # On a rank holding stages a < b where a microbatch passes a before b (V: r and
        # 2p-1-r), each microbatch between its F(a) and its F(b) needs room for F(b) kept.
        self.returning = [None] * ranks  # (first stage, later stage) or None
        for r, stages in enumerate(self.stages_of):
            if len(stages) == 2:
                self.returning[r] = (stages[0], stages[1])
        self.version = [0] * ranks
        self.last_kind = [None] * ranks  # the kind of F/I the rank ran last (for alternate)
        # taper: 1F1B's window, rank r holds at most p - r microbatches between F and I
        self.window = [ranks - r for r in range(ranks)]
        # hoard: the W's rank r may keep, what its cap holds beyond that window
        per_microbatch = [sum(self.mem[s] for s in stages) or 1.0 for stages in self.stages_of]
        self.hoard = [max(0, min(m, self.cap[r] / per_microbatch[r] + _EPS) - self.window[r])
                      for r in range(ranks)]  # min(m, ...): no budget (inf) holds all m
        self.heap: list = []

    # ---- one rank's next decision ------------------------------------------------------
    def _admits(self, rank: int, stage: int) -> bool:
        if self.policy.taper and self.next_f[stage] - self.next_i[stage] >= self.window[rank]:
            return False
        need = self.live[rank] + self.mem[stage]
        pair = self.returning[rank]
        if pair is not None:  # room kept for the microbatches still to come back
            first, later = pair
            coming_back = self.next_f[first] - self.next_f[later]
            need += self.mem[later] * (coming_back + 1 if stage == first else coming_back - 1)
        return need <= self.cap[rank] + _EPS

    def _decide(self, rank: int):
        """(start, action kind, stage) of the rank's next action, or None (blocked)."""
        t, policy = self.free_at[rank], self.policy
        backward_first = policy.backward_first
        if policy.alternate and self.last_kind[rank] is not None:
            backward_first = self.last_kind[rank] == FORWARD
        inputs = []  # (arrival, order, kind, stage)
        for stage in self.stages_of[rank]:
            k = self.next_i[stage]
            if k < self.m and self.i_arrival[stage][k] is not None:
                order = (0 if backward_first else 1, k, -stage)
                inputs.append((self.i_arrival[stage][k], order, BACKWARD_INPUT, stage))
            k = self.next_f[stage]
            if k < self.m and self.f_arrival[stage][k] is not None and self._admits(rank, stage):
                depth = -stage if policy.deep_forward_first else stage
                order = (1 if backward_first else 0, depth, k)
                inputs.append((self.f_arrival[stage][k], order, FORWARD, stage))
        ready = [x for x in inputs if x[0] <= t + _EPS]
        if policy.free_first and self.pending_w[rank] and self._memory_bound(rank):
            return t, BACKWARD_WEIGHT, self.pending_w[rank][0][0]
        if ready:
            _, _, kind, stage = min(ready, key=lambda x: x[1])
            return t, kind, stage
        waiting_w = self.pending_w[rank]
        if waiting_w and policy.hoard and len(waiting_w) <= int(self.hoard[rank]) \
                and not self._memory_bound(rank) and not self._only_w_left(rank):
            waiting_w = ()  # kept: the cooldown's gaps need them more than this one
        if inputs:
            arrival, _, kind, stage = min(inputs, key=lambda x: (x[0], x[1]))
        if waiting_w and policy.drain and self._forwards_done(rank) \
                and not self._only_w_left(rank):
            w_end = t + self.dur[BACKWARD_WEIGHT][waiting_w[0][0]]
            if not inputs or arrival < w_end - _EPS:  # unknown or too soon: wait for it
                return (arrival, kind, stage) if inputs else None
        if waiting_w:
            if inputs and policy.w_lookahead:
                w_end = t + self.dur[BACKWARD_WEIGHT][waiting_w[0][0]]
                if arrival - t < w_end - arrival:  # idling costs less than the delay
                    return arrival, kind, stage
            return t, BACKWARD_WEIGHT, waiting_w[0][0]
        if inputs:
            return arrival, kind, stage
        return None

    def _memory_bound(self, rank: int) -> bool:
        """Whether a forward has arrived that the cap does not admit yet."""
        return any(self.next_f[s] < self.m and self.f_arrival[s][self.next_f[s]] is not None
                   and not self._admits(rank, s) for s in self.stages_of[rank])

    def _forwards_done(self, rank: int) -> bool:
        return all(self.next_f[s] == self.m for s in self.stages_of[rank])

    def _only_w_left(self, rank: int) -> bool:
        return all(self.next_i[s] == self.m for s in self.stages_of[rank])

    def _push(self, rank: int) -> None:
        self.version[rank] += 1
        decision = self._decide(rank)
        if decision is not None:
            heapq.heappush(self.heap, (decision[0], rank, self.version[rank], decision))

    # ---- placing an action -------------------------------------------------------------
    def _place(self, rank: int, start: float, kind: str, stage: int) -> int | None:
        """Run the action; return the rank its output goes to (to re-decide), if another."""
        if kind == BACKWARD_WEIGHT:
            _, mb = self.pending_w[rank].popleft()
        elif kind == FORWARD:
            mb = self.next_f[stage]
            self.next_f[stage] += 1
        else:
            mb = self.next_i[stage]
            self.next_i[stage] += 1
        end = start + self.dur[kind][stage]
        self.free_at[rank] = end
        self.rows[rank].append((stage, kind, mb))
        if kind != BACKWARD_WEIGHT:
            self.last_kind[rank] = kind
        if kind == BACKWARD_WEIGHT:
            self.live[rank] -= self.mem[stage]
            return None
        if kind == FORWARD:
            self.live[rank] += self.mem[stage]
            if stage == self.num_stages - 1:  # the loss: its gradient starts here
                self.i_arrival[stage][mb] = end
                return None
            target, arrivals = stage + 1, self.f_arrival
        else:
            self.pending_w[rank].append((stage, mb))
            if stage == 0:
                return None
            target, arrivals = stage - 1, self.i_arrival
        receiver = self.owner[target]
        arrivals[target][mb] = end if receiver == rank else end + self.comm[stage]
        return receiver if receiver != rank else None

    def run(self) -> Synthesized | None:
        for rank in range(len(self.rows)):
            self._push(rank)
        while self.heap:
            start, rank, version, (_, kind, stage) = heapq.heappop(self.heap)
            if version != self.version[rank]:
                continue  # superseded by a later decision
            receiver = self._place(rank, start, kind, stage)
            self._push(rank)
            if receiver is not None:
                self._push(receiver)
        expected = 3 * self.m * self.num_stages
        if sum(len(row) for row in self.rows) != expected:
            return None  # the cap left some rank unable to go on
        return Synthesized(self.rows, max(self.free_at), self.policy, tuple(self.cap))
