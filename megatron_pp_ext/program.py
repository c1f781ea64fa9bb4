"""The P2P program: per rank, its compute actions, the batches of point-to-point ops it posts
(each one ``batch_isend_irecv``, one NCCL group) and where it waits on them; with its text,
CSV and JSON forms (torch.distributed.pipelining's lowered-schedule cells). No torch: the
lowering writes it, ``analysis.nccl_rules`` checks it, ``analysis.nccl_timing`` times it.

A schedule CSV may bring its own program (``load``): cells in the form ``Program.to_csv``
writes: compute actions (``2F0``), batches ``(2SEND_F2;3RECV_B0)BATCH#5`` (ops posted together,
one NCCL group), ``WAIT#5``, and torch.distributed.pipelining's lone ops (``2SEND_F2``,
``3RECV_B0``: a batch of one). ``analysis.user_program`` turns it into the executor's posting.
"""

from __future__ import annotations

import csv
import io
import json
import re
from dataclasses import dataclass, field
from typing import NamedTuple

from .ir import Schedule, ScheduleError, parse_cell

SEND, RECV = "send", "recv"


class P2POp(NamedTuple):
    """One side of a message. This and the steps below are tuples: a program at p=64 holds
    some 10^6 of them, built, compared and read at C speed."""

    kind: str  # SEND or RECV
    peer: int  # the other rank
    label: str  # what it carries, the same text on both sides, e.g. "forward 3F2"
    name: str = ""  # this side in torch.distributed.pipelining's words, e.g. "2SEND_F2"


@dataclass
class Batch:
    rank: int
    index: int  # position in the rank's posting order (its stream order)
    ops: list[P2POp]
    call: str = ""  # the call that posted it (Megatron's name), for messages

    def __str__(self) -> str:
        ops = ", ".join(f"{op.kind} {op.label} {'to' if op.kind == SEND else 'from'} "
                        f"rank {op.peer}" for op in self.ops)
        return f"rank {self.rank} batch #{self.index} ({self.call or 'p2p'}: {ops})"


class Post(NamedTuple):
    batch: Batch


class Wait(NamedTuple):
    batch: int  # index of the rank's batch waited on
    why: str = ""
    op: int | None = None  # which of its ops (None: all of them; NCCL completes them at once)


@dataclass(frozen=True)
class Collective:
    """A collective an action issues inside its compute, on a group other than the
    pipeline's: e.g. an MoE layer's all-to-all on the expert group. Its ranks must issue the
    group's collectives in one order (``analysis.collectives``)."""

    group: str  # e.g. "expert"
    op: str  # e.g. "all_to_all"
    what: str = ""  # which one, e.g. "layer 2 dispatch"

    def __str__(self) -> str:
        return f"{self.op} on the {self.group} group" + (f" ({self.what})" if self.what else "")


class Compute(NamedTuple):
    action: str
    paired: bool = False  # computed in one call with the next Compute (DualPipe's F&B pair)
    collectives: tuple[Collective, ...] = ()  # issued inside, in order (the model's layers)


@dataclass
class Program:
    """Per rank, its steps in order."""

    name: str
    steps: list[list] = field(default_factory=list)
    # per rank, where each action's steps begin (its hooks run there, before its receives);
    # empty for a program read from a file
    action_starts: list[list[int]] = field(default_factory=list)

    def batches(self, rank: int) -> list[Batch]:
        return [step.batch for step in self.steps[rank] if isinstance(step, Post)]

    def cells(self) -> list[list[str]]:
        """Per rank, its steps in the text form of torch.distributed.pipelining's lowered
        schedules: compute actions as they are ("2F0"), a batch of P2P ops as
        ``(2SEND_F2;3RECV_B0)BATCH#5`` (its ops posted together, in one NCCL group; a lone
        op is a batch of one), and ``WAIT#5`` where the host waits on batch 5."""
        rows = []
        for steps in self.steps:
            cells = []
            for step in steps:
                if isinstance(step, Compute):
                    cells.append(step.action)
                elif isinstance(step, Post):
                    names = ";".join(op.name or f"{op.kind}:{op.label}" for op in step.batch.ops)
                    cells.append(f"({names})BATCH#{step.batch.index}")
                else:
                    cells.append(f"WAIT#{step.batch}")
            rows.append(cells)
        return rows

    def to_csv(self) -> str:
        """One row per rank of ``cells``."""
        return "\n".join(",".join(row) for row in self.cells()) + "\n"

    def to_json(self) -> str:
        """``{"name": ..., "ranks": [[cell, ...], ...]}`` with the cells of ``cells``."""
        return json.dumps({"name": self.name, "ranks": self.cells()}, indent=1)

    def text(self, rank: int) -> str:
        """One line per step, e.g. ``post #3 [send forward 1F2 -> 1, recv backward 0B0 <- 1]``."""
        lines = []
        for step in self.steps[rank]:
            if isinstance(step, Compute):
                lines.append(step.action + (" (in one call with the next)" if step.paired
                                            else "") + _collectives_text(step.collectives))
            elif isinstance(step, Post):
                ops = ", ".join(f"{op.kind} {op.label} {'->' if op.kind == SEND else '<-'} "
                                f"{op.peer}" for op in step.batch.ops)
                lines.append(f"post #{step.batch.index} [{ops}]")
            else:
                lines.append(f"wait #{step.batch}")
        return "\n".join(lines)


def _collectives_text(collectives: tuple[Collective, ...]) -> str:
    """`` {12 all_to_all on the expert group}``: what a compute step issues, counted by kind."""
    if not collectives:
        return ""
    counts: dict[tuple[str, str], int] = {}
    for c in collectives:
        counts[c.op, c.group] = counts.get((c.op, c.group), 0) + 1
    return " {" + ", ".join(f"{n} {op} on the {group} group"
                            for (op, group), n in counts.items()) + "}"


# --------------------------------------------------------------------------------------------
# A schedule file's own program
# --------------------------------------------------------------------------------------------

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
    exists, downstream = 0 <= stage < schedule.num_stages, (kind == "SEND") == forward
    other = None
    if exists:
        other = schedule.downstream(stage) if downstream else schedule.upstream(stage)
    if other is None or schedule.rank_of(stage) != rank:
        raise ScheduleError(f"rank {rank}: P2P op {text!r} names stage {stage}, which is "
                            f"{'not on this rank' if exists else 'out of range'}"
                            f" or has no neighbour stage {stage + (1 if downstream else -1)} "
                            "to talk to")
    consumer = other if kind == "SEND" else stage
    label = f"{'forward' if forward else 'backward'} {consumer}{'F' if forward else 'B'}{mb}"
    return P2POp(SEND if kind == "SEND" else RECV, schedule.rank_of(other),
                 ("shape of " if header else "") + label, text)
