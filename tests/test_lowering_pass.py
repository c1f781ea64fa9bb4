"""The program is what runs: each rank's executor, given a program lowered by the pass
(``analysis.program_pass``), posts exactly its batches (every op, in order), waits exactly
where it says and computes in its order (``support.executor_dry_run`` records it against a
transport on NCCL's code path), for every posting the lowering has: Megatron's fused calls over
p 1..8 x m 1..16 for the schedules that post them on NCCL, and on a grid of sizes for every
schedule lockstep rounds, receives posted ahead or a call early, DualPipe's F&B pairs, variable
shapes (the transport's shape headers are the pass's) and a schedule file's own program. The
fabric tests (``test_nccl_rules.py``) run the same programs over the NCCL-rules fabric.

Until the executor interpreted programs, this file held the pass to the executor's own
postings; the pass was equal to them on all 1258 programs of this grid when it took over."""

import pytest

from megatron_pp_ext.analysis.lowering import (COMMIT, LOCKSTEP, MEGATRON, lower, nccl_choice,
                                               nccl_post_ahead, nccl_posting, user_postings)
from megatron_pp_ext.analysis.nccl_timing import unit_cost_makespans
from megatron_pp_ext.analysis.messages import (ACTIVATION, LockstepPosting, Message,
                                                lockstep_postings)
from megatron_pp_ext.analysis.user_program import load
from megatron_pp_ext.ir import ScheduleError
from megatron_pp_ext.program import Compute, Post, Wait
from megatron_pp_ext.runtime.executor import Executor
from megatron_pp_ext.schedules import build_schedule
from support.executor_dry_run import executed_program

SCHEDULES = ["gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2", "zb-v", "dualpipev"]
TWO_CHUNKS = {"interleaved", "zb-v", "dualpipev"}
GRID = [(p, m) for p in (1, 2, 3, 4, 7, 8) for m in (1, 2, 3, 5, 8, 16)]


def _build(name, p, m):
    try:
        return build_schedule(name, p, m, chunks=2 if name in TWO_CHUNKS else 1)
    except ScheduleError:  # interleaved: m >= p, m mod p in {0} or >= p
        assert name == "interleaved"
        return None


def _assert_runs_as_lowered(schedule, where, variable_shapes=False, **how):
    program = lower(schedule, **how)
    want = lower(schedule, variable_shapes=True, **how) if variable_shapes else program
    ran = executed_program(schedule, program, variable_shapes=variable_shapes,
                           pairs=how.get("overlapped_pairs", False))
    for rank in range(schedule.num_ranks):
        assert ran.steps[rank] == want.steps[rank], (where, rank, want.text(rank),
                                                     ran.text(rank))


@pytest.mark.parametrize("name", SCHEDULES)
def test_the_executor_runs_megatrons_fused_calls_as_lowered(name):
    """p 1..8 x m 1..16 for the schedules whose NCCL posting is Megatron's fused calls (the
    others' fused programs fail NCCL's rules and run only off NCCL: the grid below has them)."""
    compared = 0
    sizes = ([(p, m) for p in range(1, 9) for m in range(1, 17)]
             if name in ("gpipe", "1f1b", "zb-h1") else GRID)
    for p, m in sizes:
        schedule = _build(name, p, m)
        if schedule is not None:
            _assert_runs_as_lowered(schedule, f"{name} p={p} m={m}", posting=MEGATRON)
            compared += 1
    assert compared == (sum(m >= p and (m % p == 0 or m % p >= p) for p, m in sizes)
                        if name == "interleaved" else len(sizes))


@pytest.mark.parametrize("name", SCHEDULES)
def test_the_executor_runs_every_other_posting_as_lowered(name):
    for p, m in GRID:
        schedule = _build(name, p, m)
        if schedule is None:
            continue
        where = f"{name} p={p} m={m}"
        _assert_runs_as_lowered(schedule, where + " lockstep", posting=LOCKSTEP)
        _assert_runs_as_lowered(schedule, where + " ahead", post_ahead=True)
        _assert_runs_as_lowered(schedule, where + " early", prefetch=True)
        _assert_runs_as_lowered(schedule, where + " shapes", variable_shapes=True)
        if name == "dualpipev":
            _assert_runs_as_lowered(schedule, where + " pairs", overlapped_pairs=True)


def _pairs(program):
    return [[f"{a.action}+{b.action}" for a, b in zip(steps, steps[1:])
             if isinstance(a, Compute) and a.paired] for steps in program.steps]


def test_dualpipev_pairs_are_in_the_program():
    """The F&B pairs, in lockstep rounds (a pair in one round), pair every F followed by a B
    or I of the other chunk, on every rank (the middle ranks too, whose gradient arrives from
    another rank), whatever fused posting is asked for. The drop-in runs the same pairs as
    DualPipe commits them (``nccl_choice``: it passes NCCL's rules and beats the rounds at
    unit costs): a pair's sends in one batch with the next pair's two receives. Without pairs
    neither program has any."""
    schedule = build_schedule("dualpipev", 4, 8)
    rounds = lower(schedule, LOCKSTEP, overlapped_pairs=True)
    assert lower(schedule, MEGATRON, overlapped_pairs=True).steps == rounds.steps
    assert _pairs(rounds)[0] == ["0F4+7I0", "0F5+7I1", "0F6+7I2", "0F7+7B3",
                                 "7F4+0B0", "7F5+0B1", "7F6+0B2", "7F7+0B3"]
    assert [len(p) for p in _pairs(rounds)] == [8, 8, 8, 8]
    assert _pairs(rounds)[2] == ["2F4+5I0", "2F5+5B1", "5F4+2B0", "2F6+5B2",
                                 "5F5+2B1", "2F7+5B3", "5F6+2B2", "5F7+2B3"]
    # the pair's round is one batch: both sends, then the round's receives
    steps = rounds.steps[1]
    k = next(k for k, s in enumerate(steps) if isinstance(s, Compute) and s.action == "6F5")
    assert steps[k + 1] == Compute("1B1") and isinstance(steps[k + 2], Post)
    assert [(op.kind, op.label, op.peer) for op in steps[k + 2].batch.ops] == [
        ("send", "forward 7F5", 0), ("send", "backward 0B1", 0), ("recv", "backward 6B4", 0)]
    choice = nccl_choice(schedule, overlapped_pairs=True)
    commit = lower(schedule, COMMIT, overlapped_pairs=True)
    assert (choice.posting, choice.overlapped_pairs) == (COMMIT, True)
    assert choice.program.steps == commit.steps and _pairs(commit) == _pairs(rounds)
    steps = commit.steps[1]
    k = next(k for k, s in enumerate(steps) if isinstance(s, Compute) and s.action == "1F7")
    assert steps[k + 1] == Compute("6B3") and isinstance(steps[k + 2], Post)
    assert [(op.kind, op.label, op.peer) for op in steps[k + 2].batch.ops] == [
        ("send", "forward 2F7", 2), ("send", "backward 5B3", 2),
        ("recv", "forward 6F5", 2), ("recv", "backward 1B1", 2)]  # the next pair's inputs
    # unit costs under NCCL's rules, messages of half and one forward: rounds, then commit
    assert [unit_cost_makespans(program, schedule, (0.5, 1.0))
            for program in (rounds, commit)] == [[78.0, 90.0], [71.5, 83.0]]
    assert not any(isinstance(s, Compute) and s.paired for steps in lower(schedule,
                   LOCKSTEP).steps for s in steps)
    assert not any(isinstance(s, Compute) and s.paired for steps in lower(schedule).steps
                   for s in steps)
    # the pairs move posts, never compute order
    assert [[s.action for s in steps if isinstance(s, Compute)]
            for steps in rounds.steps] == [[str(a) for a in actions]
                                           for actions in schedule.actions]


def test_a_schedule_files_own_program_runs_as_written():
    """A 1F1B CSV at p=2, m=2 with its communication written out in lockstep batches (the
    program the lowering derives, round-tripped through its CSV form)."""
    schedule = build_schedule("1f1b", 2, 2)
    text = lower(schedule, LOCKSTEP).to_csv()
    loaded, program = load(text, name="own")
    postings = user_postings(loaded, program)
    _assert_runs_as_lowered(loaded, "own program", postings=postings)
    _assert_runs_as_lowered(loaded, "own program, shapes", postings=postings,
                            variable_shapes=True)
    assert nccl_choice(loaded).program.steps == lower(loaded, postings=postings).steps


def test_a_receive_out_of_the_senders_order_is_refused():
    """A posting in which rank 1 first receives rank 0's second message (1F1 before 1F0)."""
    schedule = build_schedule("gpipe", 2, 2)
    postings = lockstep_postings(schedule)
    postings[1] = LockstepPosting(after={}, before={0: [[Message(0, ACTIVATION, 1, 1)]]})
    with pytest.raises(RuntimeError, match="posted out of rank 0's sending order"):
        lower(schedule, postings=postings)


def test_a_program_that_does_not_fit_the_schedule_is_refused_before_it_runs():
    """The executor reads the program's compute steps against the rank's action list, and
    stops where a program would compute before it has received, or wait on what it never
    posted."""
    schedule = build_schedule("1f1b", 2, 2)
    other = lower(build_schedule("gpipe", 2, 2))
    with pytest.raises(ValueError, match=r"rank 1's compute step #1 is 1F1, but its action "
                       r"list has 1B0 there"):
        Executor(schedule, 1, None, None, recv_shape=None, dtype=None, device=None,
                 program=other)
    program = lower(schedule)
    waitless = [s for s in program.steps[1] if not isinstance(s, Wait)]
    program.steps[1], program.action_starts = waitless, []
    with pytest.raises(RuntimeError, match=r"rank 1: 1F0 needs the forward tensor of "
                       r"microbatch 0 from rank 0, which the program has not received"):
        executed_program(schedule, program)
    program = lower(schedule)
    program.steps[0].append(Wait(99, op=0))
    with pytest.raises(RuntimeError, match="waits on op 0 of batch #99, which it has not"):
        executed_program(schedule, program)
    assert any(isinstance(s, Post) for s in program.steps[0])


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zb-v"])
def test_the_nccl_choice_answers_both_questions_from_one_check(name):
    """nccl_choice (what the drop-in derives once per schedule): gpipe posts ahead, 1f1b
    fuses, zb-v runs in lockstep."""
    schedule = _build(name, 4, 8)
    choice = nccl_choice(schedule)
    assert (choice.postings is None, choice.post_ahead) == (
        nccl_posting(schedule) is None, nccl_post_ahead(schedule))
    assert (choice.posting, choice.post_ahead) == {
        "gpipe": (MEGATRON, True), "1f1b": (MEGATRON, False), "zb-v": (LOCKSTEP, False)}[name]
