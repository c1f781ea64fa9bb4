"""Lower a schedule into the P2P program the executor runs on NCCL: per rank, the batches it
posts (each of Megatron's fused calls is one ``batch_isend_irecv``) and where it waits on them
(``analysis.program_pass``, from the action lists alone), and choose the posting: a schedule
file's own program, else Megatron's fused calls where NCCL's rules allow them, else lockstep
rounds; receives posted ahead where that is proven and never slower. ``check_nccl_rules``
checks the chosen program before any rank sends a byte.
"""

from __future__ import annotations

from ..ir import Schedule, ScheduleError
from ..program import Program
from .messages import lockstep_postings
from .nccl_rules import check_nccl_rules
from .nccl_timing import unit_cost_makespan
from .program_pass import lower_program
from .user_program import postings as derive_postings
from .user_program import program_of

MEGATRON, LOCKSTEP = "megatron", "lockstep"  # the executor's two ways of posting on NCCL


def lower(schedule: Schedule, posting: str = MEGATRON,
          variable_shapes: bool = False, post_ahead: bool = False,
          postings: list | None = None) -> Program:
    """The executor's P2P program for ``schedule`` on NCCL (``analysis.program_pass``):
    ``megatron`` posting fuses a send with the next receive going the other way, as
    Megatron's 1F1B does; ``lockstep`` posts one batch per round (``lockstep_posting``).
    ``variable_shapes``: every call first exchanges its shape headers in a batch of its own and
    waits on it, as the transport does on NCCL. ``postings``: each rank's lockstep-seam
    posting given explicitly (a user's program, ``user_program.postings``)."""
    name = (f"schedule {schedule.name} (p={schedule.num_ranks}, "
            f"m={schedule.num_microbatches}, v={schedule.chunks}, {posting} "
            f"posting{', variable shapes' if variable_shapes else ''})")
    if postings is None and posting == LOCKSTEP:
        postings = lockstep_postings(schedule)
    return lower_program(schedule, name, postings, post_ahead, variable_shapes)


USER = "user"  # a schedule file's own communication (analysis.user_program)


def _checked_program(schedule: Schedule, variable_shapes: bool) -> tuple[str, Program, list]:
    """(how, the program, each rank's lockstep-seam posting or None for Megatron's fused
    calls): the file's own program, else Megatron's fused calls, else lockstep rounds; the
    first whose program passes ``check_nccl_rules``."""
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
    postings = derive_postings(schedule, program)
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


def _ahead_program(schedule: Schedule, variable_shapes: bool,
                   checked: tuple | None = None) -> Program | None:
    """The program with receives posted ahead where ``nccl_post_ahead`` allows it, else None
    (``checked``: ``_checked_program``'s result, when the caller has it)."""
    posting, program, _ = checked or _checked_program(schedule, variable_shapes)
    if posting != MEGATRON:
        return None
    ahead = lower(schedule, MEGATRON, variable_shapes, post_ahead=True)
    try:
        check_nccl_rules(ahead)
    except ScheduleError:
        return None
    plain = [unit_cost_makespan(program, schedule, t_comm) for t_comm in _AHEAD_PROBES]
    early = [unit_cost_makespan(ahead, schedule, t_comm) for t_comm in _AHEAD_PROBES]
    faster = all(e <= p for e, p in zip(early, plain)) and any(
        e < p for e, p in zip(early, plain))
    return ahead if faster else None


def nccl_decision(schedule: Schedule,
                  variable_shapes: bool = False) -> tuple[dict[int, object] | None, bool]:
    """``(nccl_posting, nccl_post_ahead)`` from one check of the program: what the drop-in
    derives once per schedule before its first step on NCCL."""
    checked = _checked_program(schedule, variable_shapes)
    postings = checked[2]
    ahead = _ahead_program(schedule, variable_shapes, checked) is not None
    return (None if postings is None else dict(enumerate(postings))), ahead


def nccl_posting_kind(schedule: Schedule, variable_shapes: bool = False) -> str:
    """Which program ``nccl_program`` is: ``user`` (the schedule file's own), ``megatron``
    (Megatron's fused calls) or ``lockstep``."""
    return _checked_program(schedule, variable_shapes)[0]


def nccl_program(schedule: Schedule, variable_shapes: bool = False) -> Program:
    """The checked program the executor runs on NCCL (the posting ``nccl_posting`` picks,
    receives posted ahead where ``nccl_post_ahead`` says so)."""
    checked = _checked_program(schedule, variable_shapes)
    return _ahead_program(schedule, variable_shapes, checked) or checked[1]


__all__ = ["MEGATRON", "LOCKSTEP", "USER", "lower", "nccl_decision", "nccl_posting",
           "nccl_posting_kind",
           "nccl_post_ahead", "nccl_program", "user_postings"]
