"""One rank's part of a ``Program`` as the executor runs it (``runtime/executor.py``): its
steps as flat tuples, each op's message read once, each action's hooks placed where the
program says the action begins, and for each call whether Megatron's timer runs until its
receive is waited on. No torch: the drop-in compiles once per schedule and rank, and the
start-up bench times it without loading torch."""

from __future__ import annotations

import collections

from ..ir import Schedule
from ..program import Compute, Post, Program, Wait
from .gc_pause import gc_paused
from .messages import MEGATRON_TIMERS, message_of

# The compiled steps: (STEP_BEGIN, i), (STEP_COMPUTE, i, paired), (STEP_WAIT, batch, op),
# (STEP_POST, batch, [send messages], [receive messages], call name, timed until its wait)
STEP_BEGIN, STEP_COMPUTE, STEP_WAIT, STEP_POST = range(4)


@gc_paused
def compile_steps(program: Program, rank: int, schedule: Schedule,
                  timed: bool = False) -> list[tuple]:
    """Rank ``rank``'s part of ``program`` as the executor runs it; ValueError where its
    compute steps are not the rank's action list. ``timed``: decide for each call whether
    Megatron's timer runs until its receive is waited on (the rank waits for it before it
    computes anything else and before it posts another call of the timer: as Megatron's
    blocking calls) or covers the post only."""
    actions = [str(a) for a in schedule.actions[rank]]
    starts = None  # step -> the actions that begin there (a pair's two may share one)
    if program.action_starts:
        starts = collections.defaultdict(list)
        for i, k in enumerate(program.action_starts[rank]):
            starts[k].append(i)
    out: list[tuple] = []
    done = 0
    steps = program.steps[rank]
    for k, step in enumerate(steps):
        if starts is not None:
            out.extend((STEP_BEGIN, i) for i in starts.get(k, ()))
        if isinstance(step, Compute):
            if done >= len(actions) or actions[done] != step.action:
                raise ValueError(
                    f"{program.name}: rank {rank}'s compute step #{done} is {step.action}, but "
                    f"its action list has {actions[done] if done < len(actions) else 'no more'} "
                    "there: the program was lowered from another schedule")
            if starts is None:
                out.append((STEP_BEGIN, done))
            out.append((STEP_COMPUTE, done, step.paired))
            done += 1
        elif isinstance(step, Wait):
            out.append((STEP_WAIT, step.batch, step.op))
        elif isinstance(step, Post):
            messages = [message_of(op) for op in step.batch.ops]
            sends = [m for op, m in zip(step.batch.ops, messages) if op.kind == "send"]
            recvs = [m for op, m in zip(step.batch.ops, messages) if op.kind == "recv"]
            if any(op.kind == "send" for op in step.batch.ops[len(sends):]):
                raise ValueError(f"{program.name}: {step.batch}: the executor posts a batch's "
                                 "sends first, then its receives")
            until_wait = timed and len(recvs) == 1 and _waited_before_compute(
                steps, k, step.batch)
            out.append((STEP_POST, step.batch.index, sends, recvs, step.batch.call,
                        until_wait))
    if done != len(actions):
        raise ValueError(f"{program.name}: rank {rank}'s program computes {done} of its "
                         f"{len(actions)} actions")
    return out


def _waited_before_compute(steps: list, k: int, batch) -> bool:
    timer = MEGATRON_TIMERS.get(batch.call)
    for step in steps[k + 1:]:
        if isinstance(step, Compute):
            return False
        if isinstance(step, Wait) and step.batch == batch.index:
            return True
        if isinstance(step, Post) and MEGATRON_TIMERS.get(step.batch.call) == timer:
            return False
    return False



__all__ = ["STEP_BEGIN", "STEP_COMPUTE", "STEP_POST", "STEP_WAIT", "compile_steps"]
