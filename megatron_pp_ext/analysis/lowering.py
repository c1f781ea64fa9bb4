"""Lower a schedule into the P2P program the executor runs (it interprets it): per rank, the
batches it posts (each of Megatron's fused calls is one ``batch_isend_irecv``) and where it
waits on them (``analysis.program_pass``, from the action lists alone), and choose the posting.
On NCCL: a schedule file's own program, else Megatron's fused calls where NCCL's rules allow
them, else lockstep rounds; receives posted ahead where that is proven and never slower;
``check_nccl_rules`` checks the chosen program before any rank sends a byte. Elsewhere (gloo,
in memory): Megatron's fused calls, receives posted a call early (``runtime_program``).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..ir import Schedule, ScheduleError
from ..program import Program
from .gc_pause import gc_paused
from .messages import comm_plan, lockstep_postings, lockstep_rounds, paired_in
from .nccl_rules import check_nccl_rules
from .nccl_timing import unit_cost_makespans
from .program_pass import lower_program, lower_program_lazily
from .user_program import postings as derive_postings
from .user_program import program_of

MEGATRON, LOCKSTEP = "megatron", "lockstep"  # the executor's two ways of posting on NCCL
# and, for DualPipe's F&B pairs, a third: DualPipe's commit (every action's or pair's sends in
# one batch with the receives of what follows, a pair's two inputs received before it)
COMMIT = "commit"


@gc_paused
def lower(schedule: Schedule, posting: str = MEGATRON,
          variable_shapes: bool = False, post_ahead: bool = False,
          postings: list | None = None, prefetch: bool = False,
          overlapped_pairs: bool = False, plans: list | None = None) -> Program:
    """The P2P program for ``schedule`` (``analysis.program_pass``): ``megatron`` posting fuses
    a send with the next receive going the other way, as Megatron's 1F1B does; ``lockstep``
    posts one batch per round (``lockstep_posting``). ``variable_shapes``: every call first
    exchanges its shape headers in a batch of its own and waits on it, as the transport does
    on NCCL. ``postings``: each rank's lockstep-seam posting given explicitly (a user's
    program, ``user_program.postings``). ``prefetch`` and ``overlapped_pairs``:
    ``program_pass``'s rule of that name; ``overlapped_pairs``: the F&B pairs (only where the
    schedule has them: DualPipe, DualPipeV), posted as DualPipe commits with ``COMMIT``, else
    in lockstep rounds in which a pair takes one round, whatever ``posting`` says. ``plans``:
    every rank's ``messages.comm_plan``, when the caller has them."""
    pairs = overlapped_pairs and bool(schedule.options.get("overlapped_pairs"))
    if pairs and postings is None and posting != COMMIT:
        posting = LOCKSTEP
    name = _name(schedule, posting, variable_shapes)
    if postings is None and posting == LOCKSTEP:
        postings = lockstep_postings(schedule, plans=plans, pairs=pairs)
    return lower_program(schedule, name, postings, post_ahead, variable_shapes, prefetch, plans,
                         commit_pairs(schedule) if pairs and posting == COMMIT else None)


def commit_pairs(schedule: Schedule, rounds: list[list[int]] | None = None
                 ) -> list[frozenset[int]]:
    """Each rank's F&B pairs for the commit posting, as the lockstep rounds pair them (an F
    and the B or I after it, the B's input made before the F's round); ``rounds``:
    ``lockstep_rounds(schedule, pairs=True)``, when the caller has them."""
    return [paired_in(mine) for mine in rounds or lockstep_rounds(schedule, pairs=True)]


def _name(schedule: Schedule, posting: str, variable_shapes: bool) -> str:
    return (f"schedule {schedule.name} (p={schedule.num_ranks}, m={schedule.num_microbatches}, "
            f"v={schedule.chunks}, {posting} posting"
            f"{', variable shapes' if variable_shapes else ''})")


USER = "user"  # a schedule file's own communication (analysis.user_program)


@dataclass(frozen=True)
class NcclChoice:
    """How a schedule is posted on NCCL, and the program that posting gives, checked."""

    posting: str  # USER, MEGATRON or LOCKSTEP
    postings: list | None  # each rank's lockstep-seam posting; None: Megatron's fused calls
    post_ahead: bool  # receives posted ahead (``nccl_post_ahead``)
    overlapped_pairs: bool  # DualPipe's F&B pairs in one call (kept only where NCCL allows)
    program: Program  # the checked program (shape headers included with variable shapes)


@gc_paused
def nccl_choice(schedule: Schedule, variable_shapes: bool = False,
                overlapped_pairs: bool = False) -> NcclChoice:
    """The posting on NCCL: the program a schedule file brought, else Megatron's fused calls
    where NCCL's rules allow them (1F1B, GPipe, ZB-H1: every call and timer as Megatron's),
    else lockstep rounds; receives posted ahead where ``nccl_post_ahead`` says so; the F&B
    pairs where the model computes them in one call and the program with them passes too.
    Raises ``ScheduleError`` (naming the ranks, the ops and the cycle) if no program passes
    ``check_nccl_rules``: before any byte moves."""
    program = program_of(schedule)
    if program is not None:  # run as written: no pairs, nothing posted ahead
        postings = user_postings(schedule, program, variable_shapes)
        return NcclChoice(USER, postings, False, False, lower(
            schedule, variable_shapes=variable_shapes, postings=postings))
    pairs = overlapped_pairs and bool(schedule.options.get("overlapped_pairs"))
    try:
        choice = _derived_choice(schedule, variable_shapes, pairs)
    except ScheduleError:
        if not pairs:
            raise
        # the pairs only save time: never at the price of a program that could hang
        choice = _derived_choice(schedule, variable_shapes, False)
    return choice


def _derived_choice(schedule: Schedule, variable_shapes: bool, pairs: bool) -> NcclChoice:
    plans = [comm_plan(schedule, rank) for rank in range(schedule.num_ranks)]
    if pairs:  # a round for each pair, or DualPipe's commit where that passes and is faster
        rounds = lockstep_rounds(schedule, pairs=True)
        postings = lockstep_postings(schedule, rounds, plans)
        program = lower(schedule, LOCKSTEP, variable_shapes, postings=postings,
                        overlapped_pairs=True, plans=plans)
        times = unit_cost_makespans(program, schedule, _PROBES, check=True)
        commit = _commit_program(schedule, variable_shapes, times, plans,
                                 commit_pairs(schedule, rounds))
        if commit is not None:
            return NcclChoice(COMMIT, None, False, True, commit)
        return NcclChoice(LOCKSTEP, postings, False, True, program)
    try:  # lowered as the check plays it: where the fused calls hang, they do so early;
        # timed at the probes in the same play, for the receives posted ahead to beat
        program, feeds = lower_program_lazily(schedule, _name(schedule, MEGATRON,
                                                              variable_shapes),
                                              None, False, variable_shapes, False, plans)
        times = unit_cost_makespans(program, schedule, _PROBES, feeds, check=True)
    except ScheduleError:
        postings = lockstep_postings(schedule, plans=plans)
        program = lower(schedule, variable_shapes=variable_shapes, postings=postings,
                        plans=plans)
        check_nccl_rules(program)
        return NcclChoice(LOCKSTEP, postings, False, False, program)
    ahead = _ahead_program(schedule, variable_shapes, program, times, plans)
    return NcclChoice(MEGATRON, None, ahead is not None, False, ahead or program)


def nccl_posting(schedule: Schedule, variable_shapes: bool = False) -> dict[int, object] | None:
    """Each rank's lockstep posting on NCCL (``nccl_choice``), or None for Megatron's fused
    calls."""
    postings = nccl_choice(schedule, variable_shapes).postings
    return None if postings is None else dict(enumerate(postings))


def user_postings(schedule: Schedule, program: Program,
                  variable_shapes: bool = False) -> list:
    """The postings that lower to a user's own ``program`` (a CSV with communication):
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


# Unit costs with messages of half and one forward: where posting ahead (or DualPipe's
# commit) must not lose.
_PROBES = (0.5, 1.0)


def nccl_post_ahead(schedule: Schedule, variable_shapes: bool = False) -> bool:
    """Whether receives are posted ahead on NCCL: only with Megatron's fused calls, where the
    program with receives posted ahead passes ``check_nccl_rules`` and, timed under NCCL's
    rules at unit costs with messages of half and one forward, is never slower and somewhere
    faster (GPipe: its receives then overlap the forwards; 1F1B's are all fused already)."""
    return nccl_choice(schedule, variable_shapes).post_ahead


def _commit_program(schedule: Schedule, variable_shapes: bool, rounds_times: list[float],
                    plans: list, pairs: list[frozenset[int]]) -> Program | None:
    """The F&B pairs posted as DualPipe commits them (``COMMIT``), where that program passes
    ``check_nccl_rules`` and, timed at unit costs with the probes' message times, is never
    slower than the lockstep rounds (``rounds_times``, at the probes) and somewhere faster
    (DualPipeV: no rank waits for a round its pair takes no part in); else None. (Without
    its pairs DualPipeV's commit can hang: a rank's sends wait on a neighbour that waits for
    the pair's other input.)"""
    program, feeds = lower_program_lazily(schedule, _name(schedule, COMMIT, variable_shapes),
                                          None, False, variable_shapes, False, plans, pairs)
    try:
        times = unit_cost_makespans(program, schedule, _PROBES, feeds, check=True)
    except ScheduleError:
        return None
    return program if _never_slower(rounds_times, times) else None


def _never_slower(mine: list[float], theirs: list[float]) -> bool:
    """Whether the step times ``theirs`` (at the probes) are never above ``mine`` and
    somewhere below."""
    return all(t <= m for m, t in zip(mine, theirs)) and any(
        t < m for m, t in zip(mine, theirs))


def _ahead_program(schedule: Schedule, variable_shapes: bool, program: Program,
                   times: list[float], plans: list) -> Program | None:
    """Megatron's fused ``program`` (its step ``times`` at the probes) with receives posted
    ahead where ``nccl_post_ahead`` allows it, else None."""
    ahead = lower(schedule, MEGATRON, variable_shapes, post_ahead=True, plans=plans)
    if ahead.steps == program.steps:  # every receive is fused already: nothing to gain
        return None
    try:
        ahead_times = unit_cost_makespans(ahead, schedule, _PROBES, check=True)
    except ScheduleError:
        return None
    return ahead if _never_slower(times, ahead_times) else None


def nccl_program(schedule: Schedule, variable_shapes: bool = False) -> Program:
    """The checked program the executor runs on NCCL (``nccl_choice``), shape headers
    included with variable shapes."""
    return nccl_choice(schedule, variable_shapes).program


def runtime_program(schedule: Schedule, *, batched: bool, prefetch: bool = False,
                    overlapped_pairs: bool = False, variable_shapes: bool = False,
                    choice: NcclChoice | None = None) -> Program:
    """The program the executor interprets. ``batched`` (NCCL): ``nccl_choice``'s program
    (``choice``, when the caller has it), lowered without the shape headers, which the
    transport exchanges inside each call; else Megatron's fused calls, receives posted a call
    early with ``prefetch``; with ``overlapped_pairs`` where the schedule has F&B pairs, as
    on NCCL, the pairs' posting ``nccl_choice`` picks (DualPipe's commit where it passes and is
    faster, else lockstep rounds with a pair in one), so every rank pairs."""
    if not batched:
        if overlapped_pairs and schedule.options.get("overlapped_pairs"):
            choice = nccl_choice(schedule, overlapped_pairs=True)
            if choice.overlapped_pairs:  # the pairs' program NCCL would run, lowered once
                return choice.program
        return lower(schedule, MEGATRON, prefetch=prefetch, overlapped_pairs=overlapped_pairs)
    choice = choice or nccl_choice(schedule, variable_shapes, overlapped_pairs)
    if not variable_shapes:
        return choice.program
    return lower(schedule, choice.posting if choice.postings is None else LOCKSTEP,
                 post_ahead=choice.post_ahead, postings=choice.postings,
                 overlapped_pairs=choice.overlapped_pairs)


__all__ = ["MEGATRON", "LOCKSTEP", "COMMIT", "USER", "NcclChoice", "commit_pairs", "lower",
           "nccl_choice", "nccl_posting", "nccl_post_ahead", "nccl_program", "runtime_program",
           "user_postings"]
