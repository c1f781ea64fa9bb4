"""A schedule CSV that brings its own communication (read by ``program.load``): run it as
written.

Such a program is lowered through the pass's lockstep rule (``LockstepPosting``): a batch
that holds a send must come right after the action that produced it (with any receives it
fuses), a receive-only batch goes before the next action. Where the host waits is the
lowering's (before data is read, before a sent output is freed), so ``WAIT`` cells are read
and not followed. The lowered program, which the executor runs, is compared batch by batch
with the user's and checked against NCCL's rules before any byte moves; a program that
cannot be posted as written is refused, naming the rank and the first batch that differs.
"""

from __future__ import annotations

from ..ir import Schedule, ScheduleError
from ..program import (  # the file format; read from here too
    RECV,
    SEND,
    Compute,
    Post,
    Program,
    has_communication,
    is_communication_cell,
    load,
    program_of,
)
from .messages import LockstepPosting, Message, comm_plan, message_of


def postings(schedule: Schedule, program: Program) -> list[LockstepPosting]:
    """Per rank, the executor's posting that reproduces ``program``'s batches; ScheduleError
    where the executor cannot post a batch as written."""
    out = []
    for rank, steps in enumerate(program.steps):
        plans = comm_plan(schedule, rank)
        after: dict[int, list[Message]] = {}
        before: dict[int, list[list[Message]]] = {}
        done = 0  # compute actions so far
        for step in steps:
            if isinstance(step, Compute):
                done += 1
                continue
            if not isinstance(step, Post):
                continue
            batch = step.batch
            sends = [op for op in batch.ops if op.kind == SEND]
            recvs = [message_of(op) for op in batch.ops if op.kind == RECV]
            if sends:
                produced = plans[done - 1].send if done else None
                if len(sends) > 1 or produced is None or message_of(sends[0]) != produced \
                        or done - 1 in after:
                    raise ScheduleError(
                        f"rank {rank}: the executor cannot post batch #{batch.index} ({batch}) "
                        "as written: a batch with a send must come right after the action "
                        "that produced it, with one send; fix the CSV or drop its "
                        "communication to have it derived")
                after[done - 1] = recvs
            else:
                before.setdefault(done, []).append(recvs)
        out.append(LockstepPosting(after, before))
    return out


__all__ = ["has_communication", "is_communication_cell", "load", "postings", "program_of"]
