"""A schedule CSV that brings its own communication: read it, check it, and run it as written.

Cells are the text form ``Program.to_csv`` writes: compute actions (``2F0``), batches
``(2SEND_F2;3RECV_B0)BATCH#5`` (ops posted together, one NCCL group), ``WAIT#5``, and
torch.distributed.pipelining's lone ops (``2SEND_F2``, ``3RECV_B0``: a batch of one).

The executor runs such a program through its lockstep seam (``LockstepPosting``): a batch
that holds a send must come right after the action that produced it (with any receives it
fuses), a receive-only batch goes before the next action. Where the host waits is the
executor's (before data is read, before a sent output is freed), so ``WAIT`` cells are read
and not followed. What the executor will post is lowered and compared batch by batch with the
user's program, and checked against NCCL's rules, before any byte moves; a program it cannot
post as written is refused, naming the rank and the first batch that differs.
"""

from __future__ import annotations

import csv
import io
import json
import re

from ..analysis.nccl_rules import RECV, SEND, Batch, Compute, P2POp, Post, Program, Wait
from ..ir import Action, Schedule, ScheduleError, parse_cell
from .messages import ACTIVATION, GRADIENT, LockstepPosting, Message, comm_plan

_OP = re.compile(r"^(HEADER_)?(\d+)(SEND|RECV)_([FB])(\d+)$")
_BATCH = re.compile(r"^\((.*)\)BATCH#(\d+)$")
_WAIT = re.compile(r"^WAIT#(\d+)$")


def is_communication_cell(cell: str) -> bool:
    cell = cell.strip()
    return bool(_OP.match(cell) or _BATCH.match(cell) or _WAIT.match(cell))


def has_communication(text: str) -> bool:
    return any(is_communication_cell(cell) for row in _rows(text) for cell in row)


def _rows(text: str) -> list[list[str]]:
    if text.lstrip().startswith("{"):
        return json.loads(text)["ranks"]
    return [row for row in csv.reader(io.StringIO(text))]


def load(text: str, name: str = "csv", stage_to_rank=None) -> tuple[Schedule, Program | None]:
    """The compute schedule of a CSV (or of ``Program.to_json``'s JSON) and, if it has
    communication cells, its program."""
    rows = _rows(text)
    compute_rows = [[c for c in row if not is_communication_cell(c)] for row in rows]
    compute_csv = "\n".join(",".join(row) for row in compute_rows) + "\n"
    schedule = Schedule.from_csv(compute_csv, name=name, stage_to_rank=stage_to_rank)
    if not has_communication(text):
        return schedule, None
    program = _program(rows, schedule, name)
    # the schedule carries its program (as cells: JSON-able), for the lowering to run it
    schedule.options["communication"] = program.cells()
    return schedule, program


def program_of(schedule: Schedule) -> Program | None:
    """The program a schedule brought from its file (``load``), or None: derive one."""
    cells = schedule.options.get("communication")
    return _program(cells, schedule, schedule.name) if cells else None


def _program(rows: list[list[str]], schedule: Schedule, name: str) -> Program:
    program = Program(f"{name} (its own communication)")
    for rank, row in enumerate(rows[:schedule.num_ranks]):
        steps, index = [], 0
        for cell in (c.strip() for c in row):
            if not cell:
                continue
            batch, wait = _BATCH.match(cell), _WAIT.match(cell)
            if batch:
                ops = [_op(part.strip(), schedule, rank) for part in batch.group(1).split(";")
                       if part.strip()]
                steps.append(Post(Batch(rank, index, ops, "csv")))
                index += 1
            elif wait:
                steps.append(Wait(int(wait.group(1))))
            elif _OP.match(cell):
                steps.append(Post(Batch(rank, index, [_op(cell, schedule, rank)], "csv")))
                index += 1
            else:
                steps.extend(Compute(str(a)) for a in parse_cell(cell))
        program.steps.append(steps)
    return program


def _op(text: str, schedule: Schedule, rank: int) -> P2POp:
    match = _OP.match(text)
    if match is None:
        raise ScheduleError(f"rank {rank}: cannot read P2P op {text!r}: expected e.g. "
                            "'2SEND_F3' or '1RECV_B0' (stage, SEND|RECV, F|B, microbatch)")
    header, stage, kind, carries, mb = match.groups()
    stage, mb = int(stage), int(mb)
    forward = carries == "F"
    # the other stage of the message, and the stage that consumes it
    other = stage + (1 if forward else -1) if kind == "SEND" else stage + (-1 if forward else 1)
    if not 0 <= other < schedule.num_stages or schedule.rank_of(stage) != rank:
        raise ScheduleError(f"rank {rank}: P2P op {text!r} names stage {stage}, which is "
                            f"{'not on this rank' if 0 <= stage < schedule.num_stages else 'out of range'}"
                            f" or has no neighbour stage {other} to talk to")
    consumer = other if kind == "SEND" else stage
    label = f"{'forward' if forward else 'backward'} {consumer}{'F' if forward else 'B'}{mb}"
    return P2POp(SEND if kind == "SEND" else RECV, schedule.rank_of(other),
                 ("shape of " if header else "") + label, text)


def _message(op: P2POp) -> Message:
    carries, action = op.label.split()[-2:]
    parsed = Action.parse(action)
    return Message(op.peer, ACTIVATION if carries == "forward" else GRADIENT, parsed.stage,
                   parsed.microbatch)


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
            recvs = [_message(op) for op in batch.ops if op.kind == RECV]
            if sends:
                produced = plans[done - 1].send if done else None
                if len(sends) > 1 or produced is None or _message(sends[0]) != produced \
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
