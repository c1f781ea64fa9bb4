"""NCCL's rules: the checker of a lowered P2P program, the executor's two ways of posting on
NCCL (Megatron's fused calls; lockstep rounds where those could hang), and every schedule
executed over an in-memory fabric that enforces the rules (support/nccl_fabric.py: a mock of
NCCL, which cannot run here: rendezvous sends, one Work per batch, one stream of batches per
rank, data visible only after the wait)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from megatron_pp_ext.analysis.nccl_rules import (
    RECV,
    SEND,
    Batch,
    P2POp,
    Post,
    Program,
    Wait,
    check_nccl_rules,
)
from megatron_pp_ext.ir import Schedule, ScheduleError
from megatron_pp_ext.runtime.executor import Executor
from megatron_pp_ext.runtime.inmemory import run_ranks_in_threads
from megatron_pp_ext.analysis.lowering import (
    COMMIT,
    LOCKSTEP,
    MEGATRON,
    lower,
    nccl_choice,
    nccl_posting,
    nccl_program,
)
from megatron_pp_ext.analysis.messages import comm_plan, lockstep_rounds
from megatron_pp_ext.analysis.nccl_play import NcclPlay
from megatron_pp_ext.schedules import build_schedule
from support.emulated import microbatch_inputs, stage_weights
from support.inmemory import ROWS, WIDTH, RecordingWork, assert_equals_pp1, run_inmemory
from support.nccl_fabric import NcclRulesFabric

SCHEDULES = ["gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2", "zb-v", "dualpipev"]
TWO_CHUNKS = {"interleaved", "zb-v", "dualpipev"}
#: the schedules whose Megatron-style posting (a send fused only with a receive going the
#: other way) can hang under NCCL's rules, so the executor posts them in lockstep rounds
LOCKSTEP_SCHEDULES = {"interleaved", "zb-h2", "zb-v", "dualpipev"}
PEER_CSV = Path(__file__).parent / "data" / "torch_zb1p_2rank_2stagep_compute.csv"


def _runs_interleaved(p, m):
    """Megatron's interleaved grouping (group size p) needs m >= p and m a multiple of p."""
    return m >= p and m % p == 0


def _build(name, p, m):
    try:
        return build_schedule(name, p, m, chunks=2 if name in TWO_CHUNKS else 1)
    except ScheduleError as exc:  # interleaved needs m >= p and m % p in {0} or >= p
        if name == "interleaved" and "interleaved" in str(exc):
            return None
        raise


# ------------------------------------------------------------------ the checker, by hand
def _two_ranks(first, second) -> Program:
    """Two ranks, each posting its batches in order and waiting on each right away."""
    program = Program("hand-made")
    for rank, batches in enumerate((first, second)):
        steps = []
        for index, ops in enumerate(batches):
            steps += [Post(Batch(rank, index, ops)), Wait(index)]
        program.steps.append(steps)
    return program


def test_both_ranks_sending_first_hang_and_the_cycle_is_named():
    program = _two_ranks(
        [[P2POp(SEND, 1, "a")], [P2POp(RECV, 1, "b")]],
        [[P2POp(SEND, 0, "b")], [P2POp(RECV, 0, "a")]])
    with pytest.raises(ScheduleError) as info:
        check_nccl_rules(program)
    text = str(info.value)
    assert "can hang under NCCL's rules" in text
    assert "rank 0's host waits on its batch #0" in text
    assert "running: send a to rank 1" in text and "running: send b to rank 0" in text
    assert "cycle: rank 0 -> rank 1 -> rank 0" in text


def test_the_same_messages_fused_in_one_batch_each_pass():
    check_nccl_rules(_two_ranks(
        [[P2POp(SEND, 1, "a"), P2POp(RECV, 1, "b")]],
        [[P2POp(SEND, 0, "b"), P2POp(RECV, 0, "a")]]))


def test_a_send_held_behind_an_unmatched_receive_on_its_stream_hangs():
    # rank 0 posts a receive nobody sends yet, then (without waiting) a send: the send
    # cannot start before the receive's batch completes, and rank 1 waits for the send.
    program = Program("stream order")
    program.steps = [
        [Post(Batch(0, 0, [P2POp(RECV, 1, "late")])), Post(Batch(0, 1, [P2POp(SEND, 1, "x")])),
         Wait(1), Wait(0)],
        [Post(Batch(1, 0, [P2POp(RECV, 0, "x")])), Wait(0),
         Post(Batch(1, 1, [P2POp(SEND, 0, "late")])), Wait(1)],
    ]
    with pytest.raises(ScheduleError, match=r"queued behind batch #0 on that rank's stream"):
        check_nccl_rules(program)
    # the same ops with the receive posted after the send's batch: fine
    program.steps[0] = [Post(Batch(0, 0, [P2POp(SEND, 1, "x")])),
                        Post(Batch(0, 1, [P2POp(RECV, 1, "late")])), Wait(0), Wait(1)]
    check_nccl_rules(program)


def test_messages_matched_out_of_order_are_rejected():
    program = _two_ranks(
        [[P2POp(SEND, 1, "a")], [P2POp(SEND, 1, "b")]],
        [[P2POp(RECV, 0, "b")], [P2POp(RECV, 0, "a")]])
    with pytest.raises(ScheduleError, match=r"send #0 is a .* while receive #0 expects b"):
        check_nccl_rules(program)


def test_an_unreceived_send_is_rejected():
    program = _two_ranks([[P2POp(SEND, 1, "a")]], [[]])
    with pytest.raises(ScheduleError, match="rank 0 sends 1 message.* rank 1, which receives 0"):
        check_nccl_rules(program)


@pytest.mark.parametrize("name, posting", [("1f1b", MEGATRON), ("zb-v", LOCKSTEP),
                                           ("dualpipev", LOCKSTEP)])
def test_the_play_takes_each_op_and_batch_once(name, posting):
    """The check is linear in the program (analysis/nccl_play.py): a pair is matched once per
    op whose batch starts to run, and a host moves once at the start and once per batch that
    completes; no rounds over every rank and pair. A play that polled would count far more
    (rounds x pairs: some 2,600 rounds x 128 pairs for zb-v at p=64)."""
    schedule = build_schedule(name, 8, 32)
    program = lower(schedule, posting)
    counts = {"pairs": 0, "hosts": 0}

    class Counting(NcclPlay):
        def _transfer(self, pair):
            counts["pairs"] += 1
            super()._transfer(pair)

        def _advance_host(self, rank):
            counts["hosts"] += 1
            super()._advance_host(rank)

    assert Counting(program).play() == []
    batches = [b for r in range(8) for b in program.batches(r)]
    assert counts["pairs"] == sum(len(b.ops) for b in batches)
    assert counts["hosts"] == 8 + len(batches)



# ------------------------------------------------------------------ the lowered programs
@pytest.mark.parametrize("name", sorted(LOCKSTEP_SCHEDULES))
def test_megatron_posting_of_these_schedules_can_hang_on_nccl(name):
    schedule = _build(name, 2, 4)
    with pytest.raises(ScheduleError, match=r"can hang under NCCL's rules(.|\n)*cycle: rank"):
        check_nccl_rules(lower(schedule, MEGATRON))
    check_nccl_rules(lower(schedule, LOCKSTEP))


def test_1f1b_on_nccl_posts_exactly_megatrons_calls():
    program = lower(build_schedule("1f1b", 4, 8), MEGATRON)
    calls = [step.batch.call for step in program.steps[1] if isinstance(step, Post)]
    # rank 1 of 4: warmup 2 (recv_forward, send_forward), steady 6 fused pairs, cooldown
    assert calls[:4] == ["recv_forward", "send_forward", "recv_forward", "send_forward"]
    assert calls[4:6] == ["recv_forward", "send_forward_recv_backward"]
    assert "send_backward_recv_forward" in calls
    assert calls[-2:] == ["recv_backward", "send_backward"]
    assert nccl_posting(build_schedule("1f1b", 4, 8)) is None


def test_every_builder_passes_nccls_rules_for_every_size():
    """p 1..8, m 1..16 and 20, 24, 32 (v as each schedule needs): the executor's program on
    NCCL never hangs."""
    checked = {name: 0 for name in SCHEDULES}
    lockstep = {name: 0 for name in SCHEDULES}
    for name in SCHEDULES:
        for p in range(1, 9):
            for m in [*range(1, 17), 20, 24, 32]:
                schedule = _build(name, p, m)
                if schedule is None:
                    continue
                posting = nccl_posting(schedule)  # raises if neither program passes
                checked[name] += 1
                lockstep[name] += posting is not None
    sizes = [(p, m) for p in range(1, 9) for m in [*range(1, 17), 20, 24, 32]]
    assert checked == {**{name: len(sizes) for name in SCHEDULES},
                       "interleaved": sum(_runs_interleaved(p, m) for p, m in sizes)}
    # Megatron's fused calls everywhere for the one-chunk schedules without deferred W queues
    assert lockstep["1f1b"] == lockstep["gpipe"] == lockstep["zb-h1"] == 0
    for name in LOCKSTEP_SCHEDULES:
        assert lockstep[name] > 0, name


def test_pytorchs_zb1p_csv_passes_ncclss_rules():
    schedule = Schedule.from_csv(PEER_CSV.read_text(), name="torch-zb1p",
                                 stage_to_rank=[0, 1, 0, 1])
    check_nccl_rules(lower(schedule, nccl_posting(schedule) and LOCKSTEP or MEGATRON))


def test_lockstep_rounds_are_a_unit_cost_run():
    rounds = lockstep_rounds(build_schedule("1f1b", 2, 2))
    # rank 0: 0F0 0F1 0B0 0B1; rank 1: 1F0 1B0 1F1 1B1 (each action one round; 0B0 waits
    # for 1B0, which ends in round 3, and 0B1 for 1B1, which ends in round 5)
    assert rounds == [[0, 1, 3, 5], [1, 2, 3, 4]]


# ------------------------------------------------------------------ running on NCCL's rules
def _run_as_lowered(schedule, where: str, delays=None, pairs=False, variable_shapes=False,
                    memory=False):
    """One step over the NCCL-rules fabric: executed actions = the lists, every rank's posted
    batches = the lowered program's (``nccl_program``: the posting the executor picks; with
    ``pairs`` for stages that compute DualPipe's F&B pairs in one call), gradients = pp=1."""
    fabric = NcclRulesFabric(schedule.num_ranks)
    program = nccl_choice(schedule, variable_shapes, overlapped_pairs=pairs).program
    results = run_inmemory(schedule, delays=delays, nccl_rules=True, timeout_s=20, fabric=fabric,
                           program=program if not variable_shapes else None, pairs=pairs,
                           variable_shapes=variable_shapes, memory=memory)
    for rank, (result, work) in enumerate(results):
        assert [str(a) for a in result.executed] == [str(a) for a in schedule.actions[rank]]
        assert work.computed == [str(a) for a in schedule.actions[rank]]
        assert fabric.posted[rank] == [[(op.kind, op.peer) for op in batch.ops]
                                       for batch in program.batches(rank)], (where, rank)
    assert_equals_pp1(results, schedule, where)
    return results


@pytest.mark.parametrize("name", SCHEDULES)
def test_every_schedule_runs_on_the_nccl_rules_fabric(name):
    """p 1..8 x m in (1, 2, 3, 4, 5, 8, 12, 16) (v as the schedule needs): m below, at and
    above p for every p, odd and even; the lowered program of every m 1..16 (and 20, 24, 32)
    is checked against NCCL's rules by test_every_builder_passes_nccls_rules_for_every_size."""
    runs, sizes = 0, [(p, m) for p in range(1, 9) for m in (1, 2, 3, 4, 5, 8, 12, 16)]
    for p, m in sizes:
        schedule = _build(name, p, m)
        if schedule is None:
            continue
        _run_as_lowered(schedule, f"{name} p={p} m={m}")
        runs += 1
    assert runs == (sum(_runs_interleaved(p, m) for p, m in sizes) if name == "interleaved"
                    else len(sizes))


@pytest.mark.parametrize("name,chunks", [("v-half", 2), ("v-min", 2), ("zb-auto", 1),
                                         ("zb-auto", 2)])
def test_the_schedules_built_for_costs_and_memory_run_on_the_nccl_rules_fabric(name, chunks):
    """v-half, v-min and zb-auto over p 1..6 x m (1, 2, 3, 5, 8, 12): executed order, posted
    batches and gradients as for every other schedule; the executed peaks are the
    simulator's. zb-auto is built where its order is often no fixed builder's: a last rank
    1.5x heavier, messages of 0.3 forward, a budget of p - 1 microbatches (below 1F1B's)."""
    from megatron_pp_ext.analysis.simulate import simulate

    synthesized = 0
    for p in range(1, 7):
        for m in (1, 2, 3, 5, 8, 12):
            share = [1.0] * (p - 1) + [1.5]
            options = dict(t_f=share, t_i=share, t_w=share, t_comm=0.3,
                           memory_budget=max(1, p - 1)) if name == "zb-auto" else {}
            schedule = build_schedule(name, p, m, chunks, **options)
            results = _run_as_lowered(schedule, f"{name} p={p} m={m} v={chunks}", memory=True)
            predicted = simulate(schedule).peak_activations
            assert [r.peak_activations for r, _ in results] == predicted, (name, p, m)
            assert all(r.peak_bytes > 0 for r, _ in results), (name, p, m)  # measured too
            source = schedule.options.get("synthesized_from", "")
            synthesized += source.startswith(("list scheduler", "V block"))
    if name == "zb-auto":  # its own orders, not only the fixed builders'
        assert synthesized == {1: 17, 2: 10}[chunks], synthesized


def test_dualpipev_pairs_run_on_the_nccl_rules_fabric():
    """The pairs' posting (stages that compute an F&B pair in one call; ``nccl_choice``):
    DualPipe's commit where it beats the lockstep rounds (p >= 4 here), else the rounds; a
    pair whose two actions both send sends both in one batch. p 1..6 x m in (1, 2, 3, 4, 5,
    8, 12, 16), and variable shapes at four sizes: every rank pairs every F followed by a B or
    I of its other chunk (24 at p=4, m=16), runs the lists, posts the checked program and
    equals pp=1."""
    postings = {}
    for p in range(1, 7):
        for m in (1, 2, 3, 4, 5, 8, 12, 16):
            schedule = build_schedule("dualpipev", p, m, 2)
            results = _run_as_lowered(schedule, f"dualpipev pairs p={p} m={m}", pairs=True)
            for rank, (_, work) in enumerate(results):
                row = schedule.actions[rank]
                candidates = sum(a.kind == "F" and b.kind in ("B", "I") and a.stage != b.stage
                                 for a, b in zip(row, row[1:]))
                assert len(work.pairs) == candidates, (p, m, rank, work.pairs)
                if (p, m) == (4, 16):
                    assert candidates == 24
            # a pair whose two actions both send (to another rank) sends both in one batch
            choice = nccl_choice(schedule, overlapped_pairs=True)
            program, postings[p, m] = choice.program, choice.posting
            for rank, (_, work) in enumerate(results):
                plans = {str(a): plan for a, plan in zip(schedule.actions[rank],
                                                         comm_plan(schedule, rank))}
                sending = sum(all(plans[a].send for a in pair.split("+")) for pair in work.pairs)
                assert sending == sum(sum(op.kind == SEND for op in b.ops) == 2
                                      for b in program.batches(rank)), (p, m, rank)
                if (p, m) == (4, 16) and rank in (1, 2):
                    assert sending == 24
    assert {postings[p, m] for p in (4, 5, 6) for m in (8, 12, 16)} == {COMMIT}
    assert {postings[p, m] for p in (1, 2) for m in (4, 8, 16)} == {LOCKSTEP}
    for p, m in ((2, 4), (2, 8), (3, 5), (4, 8)):
        _run_as_lowered(build_schedule("dualpipev", p, m, 2), f"dualpipev pairs shapes p={p} "
                        f"m={m}", pairs=True, variable_shapes=True)


def test_zb_v_with_the_longest_warmup_runs_on_the_nccl_rules_fabric():
    """zb-v with warmup_forwards = 2p-1 (the back-to-back form), p 1..8 x m in (1, 2, 3, 4, 5,
    8, 12, 16): it passes NCCL's rules and every step posts the checked program, runs the lists
    and equals pp=1."""
    runs = 0
    for p in range(1, 9):
        for m in (1, 2, 3, 4, 5, 8, 12, 16):
            schedule = build_schedule("zb-v", p, m, 2, warmup_forwards=max(p, 2 * p - 1))
            _run_as_lowered(schedule, f"zb-v warmup_forwards={2 * p - 1} p={p} m={m}")
            runs += 1
    assert runs == 64


def test_random_delays_on_the_nccl_rules_fabric():
    """200 runs, random schedule, size and per-rank delays: no hang, posted = the program,
    gradients = pp=1."""
    rng = random.Random(11)
    runs = 0
    while runs < 200:
        name, p, m = rng.choice(SCHEDULES), rng.randint(2, 6), rng.randint(1, 12)
        schedule = _build(name, p, m)
        if schedule is None:
            continue
        delays = [rng.choice([0.0, 0.0002, 0.001]) for _ in range(p)]
        _run_as_lowered(schedule, f"{name} p={p} m={m} delays={delays}", delays)
        runs += 1


def test_the_fabric_hangs_where_the_checker_says():
    """Megatron-style posting of interleaved at p=2, m=4 over the fabric: rank 0 waits for
    2F0's input, which rank 1 sent in a batch stuck behind its own unreceived send."""
    schedule = _build("interleaved", 2, 4)
    weights, inputs = stage_weights(4, WIDTH), microbatch_inputs(4, ROWS, WIDTH)
    fused = lower(schedule, MEGATRON)  # not the checked program the fabric would get
    with pytest.raises(ScheduleError, match="can hang under NCCL's rules"):
        check_nccl_rules(fused)

    def rank_fn(rank, transport):
        work = RecordingWork(schedule, rank, weights, inputs)
        return Executor(schedule, rank, transport, work, recv_shape=(ROWS, WIDTH),
                        dtype=torch.float64, device=torch.device("cpu"), timeout_s=2,
                        program=fused).run()

    from megatron_pp_ext.runtime.errors import PipelineTimeoutError

    with pytest.raises(PipelineTimeoutError) as info:
        run_ranks_in_threads(2, rank_fn, timeout_s=60, fabric=NcclRulesFabric(2))
    assert "waiting for the forward tensor of microbatch 0 from rank" in str(info.value)


def test_cli_prints_the_checked_nccl_program():
    from support.cli_run import cli_in_process

    out = cli_in_process("simulate", "--schedule", "1f1b", "-p", "2", "-m", "2",
                         "--nccl-program")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("# 1f1b: megatron posting")
    assert lines[1:] == [
        "0F0,(0SEND_F0)BATCH#0,0F1,(0SEND_F1;0RECV_B0)BATCH#1,WAIT#1,WAIT#0,0B0,"
        "(0RECV_B1)BATCH#2,WAIT#2,WAIT#1,0B1",
        "(1RECV_F0)BATCH#0,WAIT#0,1F0,1B0,(1SEND_B0;1RECV_F1)BATCH#1,WAIT#1,1F1,1B1,"
        "(1SEND_B1)BATCH#2,WAIT#1,WAIT#2",
    ]


# ------------------------------------------------------------------ variable shapes, timers
def test_variable_shapes_add_a_header_batch_that_the_checker_sees():
    """With variable sequence lengths every call first exchanges its shape headers in a batch
    of its own and waits on it. GPipe at p=2, m=1 then hangs with Megatron's fused calls:
    rank 0's fused (send 1F0; receive 0B0) cannot get B0's header before rank 1 has F0's
    payload, which rank 0 posts only after the headers. Lockstep posting passes."""
    schedule = build_schedule("gpipe", 2, 1)
    check_nccl_rules(lower(schedule, MEGATRON))  # fixed shapes: fine
    program = lower(schedule, MEGATRON, variable_shapes=True)
    assert program.to_csv().splitlines()[0].startswith(
        "0F0,(HEADER_0SEND_F0;HEADER_0RECV_B0)BATCH#0,WAIT#0,(0SEND_F0;0RECV_B0)BATCH#1")
    with pytest.raises(ScheduleError, match="cycle: rank"):
        check_nccl_rules(program)
    assert nccl_posting(schedule, variable_shapes=True) is not None  # lockstep
    check_nccl_rules(lower(schedule, LOCKSTEP, variable_shapes=True))


@pytest.mark.parametrize("name", SCHEDULES)
def test_every_schedule_with_variable_shapes_runs_on_the_nccl_rules_fabric(name):
    for p, m in ((2, 1), (2, 4), (3, 2), (4, 8)):
        schedule = _build(name, p, m)
        if schedule is None:
            continue
        assert_equals_pp1(run_inmemory(schedule, nccl_rules=True, variable_shapes=True,
                                       timeout_s=20), schedule, f"{name} p={p} m={m}")


@pytest.mark.parametrize("name", sorted(LOCKSTEP_SCHEDULES))
def test_lockstep_posting_with_megatrons_timers(name):
    """Megatron's timers (log level 2) time each call until its receive is waited on; a
    lockstep program posts the next call of the same name before that, so there only the
    post is timed (a timer started twice would assert)."""
    from megatron.core.timers import Timers

    from megatron_pp_ext.train.cpu_shims import cpu_shims

    timers = [Timers(2, "minmax") for _ in range(4)]  # one per rank, as one per process
    schedule = _build(name, 4, 8)
    assert nccl_posting(schedule) is not None
    with cpu_shims(force=True):  # Megatron's timers synchronize CUDA; no GPU here
        results = run_inmemory(schedule, nccl_rules=True, timers=timers, timeout_s=20)
    assert_equals_pp1(results, schedule, name)
    for rank_timers in timers:
        assert any(timer.startswith(("forward-send", "backward-send", "forward-recv",
                                     "backward-recv")) for timer in rank_timers._timers)
