"""The lowering pass (``analysis.program_pass``: the P2P program from the action lists alone)
against the executor's own postings (``support.executor_dry_run``: each rank's executor run
against a recording transport on its NCCL path): step for step equal (every batch, its ops,
their order, every wait), with Megatron's fused calls over p 1..8 x m 1..16 for the schedules
that post them on NCCL, and on a grid of sizes for every schedule with lockstep rounds,
receives posted ahead, variable shapes and a schedule file's own program. The fabric tests (``test_nccl_rules.py``) check the same program
against what the executor posts over the NCCL-rules fabric while it really runs."""

import pytest

from megatron_pp_ext.analysis.lowering import (LOCKSTEP, MEGATRON, lower, nccl_decision,
                                               nccl_post_ahead, nccl_posting, user_postings)
from megatron_pp_ext.analysis.messages import (ACTIVATION, LockstepPosting, Message,
                                                lockstep_postings)
from megatron_pp_ext.analysis.user_program import load
from megatron_pp_ext.ir import ScheduleError
from megatron_pp_ext.schedules import build_schedule
from support.executor_dry_run import executor_program

SCHEDULES = ["gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2", "zb-v", "dualpipev"]
TWO_CHUNKS = {"interleaved", "zb-v", "dualpipev"}
GRID = [(p, m) for p in (1, 2, 3, 4, 7, 8) for m in (1, 2, 3, 5, 8, 16)]


def _build(name, p, m):
    try:
        return build_schedule(name, p, m, chunks=2 if name in TWO_CHUNKS else 1)
    except ScheduleError:  # interleaved: m >= p, m mod p in {0} or >= p
        assert name == "interleaved"
        return None


def _assert_same(schedule, where, **how):
    ours = lower(schedule, **how)
    theirs = executor_program(schedule, postings=how.get("postings"),
                              post_ahead=how.get("post_ahead", False),
                              variable_shapes=how.get("variable_shapes", False))
    for rank in range(schedule.num_ranks):
        assert ours.steps[rank] == theirs.steps[rank], (where, rank, ours.text(rank),
                                                        theirs.text(rank))


@pytest.mark.parametrize("name", SCHEDULES)
def test_the_pass_posts_what_the_executor_posts_with_megatrons_fused_calls(name):
    """p 1..8 x m 1..16 for the schedules whose NCCL posting is Megatron's fused calls (the
    others' fused programs fail NCCL's rules and are never run: the grid below has them)."""
    compared = 0
    sizes = ([(p, m) for p in range(1, 9) for m in range(1, 17)]
             if name in ("gpipe", "1f1b", "zb-h1") else GRID)
    for p, m in sizes:
        schedule = _build(name, p, m)
        if schedule is not None:
            _assert_same(schedule, f"{name} p={p} m={m}", posting=MEGATRON)
            compared += 1
    assert compared == (sum(m >= p and (m % p == 0 or m % p >= p) for p, m in sizes)
                        if name == "interleaved" else len(sizes))


@pytest.mark.parametrize("name", SCHEDULES)
def test_the_pass_posts_what_the_executor_posts_in_lockstep_ahead_and_with_shapes(name):
    for p, m in GRID:
        schedule = _build(name, p, m)
        if schedule is None:
            continue
        where = f"{name} p={p} m={m}"
        _assert_same(schedule, where + " lockstep", posting=LOCKSTEP,
                     postings=lockstep_postings(schedule))
        _assert_same(schedule, where + " ahead", posting=MEGATRON, post_ahead=True)
        _assert_same(schedule, where + " shapes", posting=MEGATRON, variable_shapes=True)


def test_the_pass_posts_a_schedule_files_own_program_as_the_executor_does():
    """A 1F1B CSV at p=2, m=2 with its communication written out in lockstep batches (the
    program the lowering derives, round-tripped through its CSV form)."""
    schedule = build_schedule("1f1b", 2, 2)
    text = lower(schedule, LOCKSTEP).to_csv()
    loaded, program = load(text, name="own")
    postings = user_postings(loaded, program)
    _assert_same(loaded, "own program", postings=postings)
    _assert_same(loaded, "own program, shapes", postings=postings, variable_shapes=True)


def test_a_receive_out_of_the_senders_order_is_refused_by_both():
    """A posting in which rank 1 first receives rank 0's second message (1F1 before 1F0):
    the executor and the pass both refuse it with the same RuntimeError."""
    schedule = build_schedule("gpipe", 2, 2)
    postings = lockstep_postings(schedule)
    postings[1] = LockstepPosting(after={}, before={0: [[Message(0, ACTIVATION, 1, 1)]]})
    errors = []
    for run in (lambda: lower(schedule, postings=postings),
                lambda: executor_program(schedule, postings=postings)):
        with pytest.raises(RuntimeError) as info:
            run()
        errors.append(str(info.value))
    assert errors[0] == errors[1] and "posted out of rank 0's sending order" in errors[0]


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zb-v"])
def test_the_drop_ins_one_check_decides_as_the_two_questions_do(name):
    """nccl_decision (what the drop-in derives once per schedule) is nccl_posting and
    nccl_post_ahead asked apart: gpipe posts ahead, 1f1b fuses, zb-v runs in lockstep."""
    schedule = _build(name, 4, 8)
    decision = nccl_decision(schedule)
    assert decision == (nccl_posting(schedule), nccl_post_ahead(schedule))
    assert (decision[0] is None, decision[1]) == {
        "gpipe": (True, True), "1f1b": (True, False), "zb-v": (False, False)}[name]
