"""Lower a schedule into the P2P program the executor runs on NCCL: per rank, the batches it
posts (each of Megatron's fused calls is one ``batch_isend_irecv``) and where it waits on them.

The program is read off the executor itself: each rank's executor runs once against a
recording transport on its NCCL code path (batched, no receive posted ahead), with work that
computes nothing. What the executor posts and waits on depends only on the action lists (the
inbox follows each sender's order; no decision reads a clock or a message's arrival), so this
dry run is exactly what the real run will post, and ``analysis.nccl_rules`` can check it
before any rank sends a byte.
"""

from __future__ import annotations

import torch

from ..analysis.nccl_rules import (
    RECV,
    SEND,
    Batch,
    Compute,
    P2POp,
    Post,
    Program,
    Wait,
    check_nccl_rules,
)
from ..ir import Schedule, ScheduleError
from .executor import Executor
from .messages import Message, call_name, lockstep_postings, sent_to_each_rank

_TOKEN = torch.zeros(1)


def _label(message: Message) -> str:
    kind = "F" if message.carries == "forward" else "B"
    return f"{message.carries} {message.stage}{kind}{message.microbatch}"


def _torch_name(message: Message, kind: str) -> str:
    """torch.distributed.pipelining's name of one side: SEND_F/SEND_B name the sending
    stage, RECV_F/RECV_B the receiving one (``message.stage`` is the receiving stage)."""
    forward = message.carries == "forward"
    stage = message.stage
    if kind == SEND:
        stage += -1 if forward else 1
    return f"{stage}{kind.upper()}_{'F' if forward else 'B'}{message.microbatch}"


class _Handle:
    def __init__(self, recorder: "_Recorder", batch: int, tensor=None):
        self.recorder, self.batch, self.tensor = recorder, batch, tensor

    def done(self) -> bool:  # never "already done": the executor then waits where it must
        return False

    def wait(self, timeout_s: float, poll: bool = False):
        self.recorder.steps.append(Wait(self.batch))
        return self.tensor


class _Recorder:
    """A transport on its NCCL code path that records instead of communicating."""

    poll = True  # NCCL: waits are polled, nothing is posted ahead
    prefetch_receives = False
    device = torch.device("cpu")

    def __init__(self, rank: int):
        self.rank, self.steps, self.batches = rank, [], 0
        self.labels: tuple = (None, None)  # (send message, receive message) of the next call

    def exchange(self, send, recv, variable_shapes: bool):
        send_handle, recv_handles = self.exchange_many(
            send, [recv] if recv is not None else [], variable_shapes)
        return send_handle, (recv_handles[0] if recv_handles else None)

    def exchange_many(self, send, recvs, variable_shapes: bool):
        send_message, recv_messages = self.labels
        name = call_name(send_message if send is not None else None, *recv_messages)
        if variable_shapes:
            # The transport's NCCL path: the shape headers in a batch of their own, waited
            # on (inside the call) before the payload batch is posted.
            header = self._post(self._ops(send, recvs, "shape of "), f"{name} (shapes)")
            self.steps.append(Wait(header, "the shape headers"))
        index = self._post(self._ops(send, recvs), name)
        return (_Handle(self, index) if send is not None else None,
                [_Handle(self, index, _TOKEN.clone()) for _ in recvs])

    def _ops(self, send, recvs, what: str = "") -> list[P2POp]:
        send_message, recv_messages = self.labels
        ops = []
        if send is not None:
            ops.append(P2POp(SEND, send[1], what + _label(send_message),
                             ("HEADER_" if what else "") + _torch_name(send_message, SEND)))
        ops.extend(P2POp(RECV, request.peer, what + _label(message),
                         ("HEADER_" if what else "") + _torch_name(message, RECV))
                   for request, message in zip(recvs, recv_messages))
        return ops

    def _post(self, ops: list[P2POp], call: str) -> int:
        index = self.batches
        self.batches += 1
        self.steps.append(Post(Batch(self.rank, index, ops, call)))
        return index


class _NoWork:
    def __init__(self, recorder: _Recorder):
        self.recorder = recorder

    def forward(self, action, input_tensor):
        self.recorder.steps.append(Compute(str(action)))
        return _TOKEN.clone()

    def backward(self, action, output_grad):
        self.recorder.steps.append(Compute(str(action)))
        return _TOKEN.clone()

    def weight(self, action):
        self.recorder.steps.append(Compute(str(action)))
        return None

    def deallocate(self, output) -> None:
        return None


class _LabellingExecutor(Executor):
    def _post(self, send, send_message, recvs, time_post_only: bool = False):
        self.transport.labels = (send_message, list(recvs))
        return super()._post(send, send_message, recvs, time_post_only)


MEGATRON, LOCKSTEP = "megatron", "lockstep"  # the executor's two ways of posting on NCCL


def lower(schedule: Schedule, posting: str = MEGATRON,
          variable_shapes: bool = False, post_ahead: bool = False,
          postings: list | None = None) -> Program:
    """The executor's P2P program for ``schedule`` on NCCL (see the module docstring):
    ``megatron`` posting fuses a send with the next receive going the other way, as
    Megatron's 1F1B does; ``lockstep`` posts one batch per round (``lockstep_posting``).
    ``variable_shapes``: every call first exchanges its shape headers in a batch of its own
    and waits on it, as the transport does on NCCL. ``postings``: each rank's lockstep-seam
    posting given explicitly (a user's program, ``user_program.postings``)."""
    program = Program(f"schedule {schedule.name} (p={schedule.num_ranks}, "
                      f"m={schedule.num_microbatches}, v={schedule.chunks}, {posting} "
                      f"posting{', variable shapes' if variable_shapes else ''})")
    if postings is None and posting == LOCKSTEP:
        postings = lockstep_postings(schedule)
    incoming = sent_to_each_rank(schedule)
    for rank in range(schedule.num_ranks):
        recorder = _Recorder(rank)
        _LabellingExecutor(schedule, rank, recorder, _NoWork(recorder), recv_shape=None,
                           dtype=torch.float32, device=torch.device("cpu"),
                           variable_shapes=variable_shapes, incoming=incoming[rank],
                           lockstep=postings[rank] if postings else None,
                           post_ahead=post_ahead).run()
        program.steps.append(recorder.steps)
    return program


USER = "user"  # a schedule file's own communication (runtime.user_program)


def _checked_program(schedule: Schedule, variable_shapes: bool) -> tuple[str, Program, list]:
    """(how, the program, each rank's lockstep-seam posting or None for Megatron's fused
    calls): the file's own program, else Megatron's fused calls, else lockstep rounds; the
    first whose program passes ``check_nccl_rules``."""
    from .user_program import program_of

    program = program_of(schedule)
    if program is not None:
        postings = user_postings(schedule, program, variable_shapes)
        return USER, lower(schedule, variable_shapes=variable_shapes, postings=postings), postings
    try:
        program = lower(schedule, MEGATRON, variable_shapes)
        check_nccl_rules(program)
        return MEGATRON, program, None
    except ScheduleError:
        pass
    postings = lockstep_postings(schedule)
    program = lower(schedule, variable_shapes=variable_shapes, postings=postings)
    check_nccl_rules(program)
    return LOCKSTEP, program, postings


def nccl_posting(schedule: Schedule, variable_shapes: bool = False) -> dict[int, object] | None:
    """How the executor posts ``schedule`` on NCCL: the program a schedule file brought,
    else None for Megatron's fused calls where NCCL's rules allow them (1F1B, GPipe, ZB-H1:
    every call and timer as Megatron's), else each rank's lockstep posting. Raises
    ``ScheduleError`` (naming the ranks, the ops and the cycle) if no program passes
    ``check_nccl_rules``: before any byte moves."""
    _, _, postings = _checked_program(schedule, variable_shapes)
    return None if postings is None else dict(enumerate(postings))


def user_postings(schedule: Schedule, program: Program,
                  variable_shapes: bool = False) -> list:
    """The executor's postings for a user's own ``program`` (a CSV with communication):
    lowered with them, every rank's batches must be the user's, op for op, and the result
    must pass ``check_nccl_rules``; otherwise ``ScheduleError`` before any byte moves."""
    from .user_program import postings as derive

    postings = derive(schedule, program)
    try:
        lowered = lower(schedule, variable_shapes=variable_shapes, postings=postings)
    except RuntimeError as exc:  # e.g. receives posted out of a peer's sending order
        raise ScheduleError(f"{program.name}: the executor cannot run it: {exc}") from None
    for rank in range(schedule.num_ranks):
        # shape headers are the transport's own batches: compared without them
        theirs, ours = ([ops for ops in ([(op.kind, op.peer, op.label) for op in b.ops
                                          if not op.label.startswith("shape of ")]
                                         for b in p.batches(rank)) if ops]
                        for p in (program, lowered))
        if theirs != ours:
            k = next((k for k, (a, b) in enumerate(zip(theirs, ours)) if a != b),
                     min(len(theirs), len(ours)))
            raise ScheduleError(
                f"{program.name}: rank {rank}'s batch #{k} as written is "
                f"{theirs[k] if k < len(theirs) else 'missing'}, but the executor would post "
                f"{ours[k] if k < len(ours) else 'nothing'} there (every message needs a "
                "batch; a send goes right after its action): fix the CSV, or leave its "
                "communication out to have it derived")
    check_nccl_rules(lowered)
    return postings


# Unit costs with messages of half and one forward: where posting ahead must not lose.
_AHEAD_PROBES = (0.5, 1.0)


def nccl_post_ahead(schedule: Schedule, variable_shapes: bool = False) -> bool:
    """Whether the executor posts receives ahead on NCCL (``Executor(post_ahead=True)``): only
    with Megatron's fused calls, where the program with receives posted ahead passes
    ``check_nccl_rules`` and, timed under NCCL's rules at unit costs with messages of half
    and one forward, is never slower and somewhere faster (GPipe: its receives then overlap
    the forwards; 1F1B's are all fused already)."""
    return _ahead_program(schedule, variable_shapes) is not None


def _ahead_program(schedule: Schedule, variable_shapes: bool) -> Program | None:
    """The program with receives posted ahead where ``nccl_post_ahead`` allows it, else None."""
    posting, program, _ = _checked_program(schedule, variable_shapes)
    if posting != MEGATRON:
        return None
    ahead = lower(schedule, MEGATRON, variable_shapes, post_ahead=True)
    try:
        check_nccl_rules(ahead)
    except ScheduleError:
        return None
    from ..analysis.nccl_timing import unit_cost_makespan

    plain = [unit_cost_makespan(program, schedule, t_comm) for t_comm in _AHEAD_PROBES]
    early = [unit_cost_makespan(ahead, schedule, t_comm) for t_comm in _AHEAD_PROBES]
    faster = all(e <= p for e, p in zip(early, plain)) and any(
        e < p for e, p in zip(early, plain))
    return ahead if faster else None


def nccl_posting_kind(schedule: Schedule, variable_shapes: bool = False) -> str:
    """Which program ``nccl_program`` is: ``user`` (the schedule file's own), ``megatron``
    (Megatron's fused calls) or ``lockstep``."""
    return _checked_program(schedule, variable_shapes)[0]


def nccl_program(schedule: Schedule, variable_shapes: bool = False) -> Program:
    """The checked program the executor runs on NCCL (the posting ``nccl_posting`` picks,
    receives posted ahead where ``nccl_post_ahead`` says so)."""
    return (_ahead_program(schedule, variable_shapes)
            or _checked_program(schedule, variable_shapes)[1])


__all__ = ["MEGATRON", "LOCKSTEP", "USER", "lower", "nccl_posting", "nccl_posting_kind",
           "nccl_post_ahead", "nccl_program", "user_postings"]
