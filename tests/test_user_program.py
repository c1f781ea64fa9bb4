"""A schedule CSV that brings its own communication (analysis.user_program): read, checked
against NCCL's rules and the executor, and run as written over the NCCL-rules fabric."""

from __future__ import annotations

import pytest

from megatron_pp_ext.ir import ScheduleError
from megatron_pp_ext.runtime.executor import Executor
from megatron_pp_ext.runtime.inmemory import run_ranks_in_threads
from megatron_pp_ext.analysis.lowering import lower, nccl_program, user_postings
from megatron_pp_ext.analysis.user_program import has_communication, load
from megatron_pp_ext.schedules import build_schedule
from support.emulated import microbatch_inputs, stage_weights
from support.inmemory import ROWS, WIDTH, RecordingWork, assert_equals_pp1
from support.nccl_fabric import NcclRulesFabric

import torch

# GPipe at p=2, m=2 in torch.distributed.pipelining's lone ops: every op a batch of its own
TORCH_GPIPE = ("0F0,0SEND_F0,0F1,0SEND_F1,0RECV_B0,0B0,0RECV_B1,0B1\n"
               "1RECV_F0,1F0,1RECV_F1,1F1,1B0,1SEND_B0,1B1,1SEND_B1\n")
# 1F1B at p=2, m=2 the same way: rank 0's lone send of 1F1 waits for rank 1's receive, which
# rank 1 posts after its lone send of 0B0, which waits for rank 0's receive, queued behind
TORCH_1F1B = ("0F0,0SEND_F0,0F1,0SEND_F1,0RECV_B0,0B0,0RECV_B1,0B1\n"
              "1RECV_F0,1F0,1B0,1SEND_B0,1RECV_F1,1F1,1B1,1SEND_B1\n")


def _run(schedule, postings):
    fabric = NcclRulesFabric(schedule.num_ranks)
    program = lower(schedule, postings=postings)  # the user's batches, as the executor runs them
    weights = stage_weights(schedule.num_stages, WIDTH)
    inputs = microbatch_inputs(schedule.num_microbatches, ROWS, WIDTH)

    def rank_fn(rank, transport):
        work = RecordingWork(schedule, rank, weights, inputs)
        return Executor(schedule, rank, transport, work, recv_shape=(ROWS, WIDTH),
                        dtype=torch.float64, device=torch.device("cpu"), timeout_s=20,
                        program=program).run(), work

    return run_ranks_in_threads(schedule.num_ranks, rank_fn, timeout_s=30, fabric=fabric), fabric


def _batches(program, rank):
    return [[(op.kind, op.peer) for op in b.ops] for b in program.batches(rank)]


@pytest.mark.parametrize("name,p,m,v", [("gpipe", 3, 4, 1), ("1f1b", 3, 5, 1),
                                        ("interleaved", 2, 4, 2), ("zb-h1", 3, 5, 1),
                                        ("zb-h2", 3, 5, 1), ("zb-v", 3, 5, 2),
                                        ("dualpipev", 2, 5, 2)])
def test_every_builders_program_round_trips_and_runs_as_written(name, p, m, v):
    built = build_schedule(name, p, m, v)
    written = nccl_program(built).to_csv()
    assert has_communication(written)
    schedule, program = load(written, name=name, stage_to_rank=built.stage_to_rank)
    assert schedule.actions == built.actions
    from_json = load(nccl_program(built).to_json(), stage_to_rank=built.stage_to_rank)[1]
    assert from_json.to_csv() == program.to_csv() == written
    results, fabric = _run(schedule, user_postings(schedule, program))
    for rank in range(p):
        assert fabric.posted[rank] == _batches(program, rank)
    assert_equals_pp1(results, schedule, name)


def test_torch_lone_ops_run_as_written():
    schedule, program = load(TORCH_GPIPE, name="torch-gpipe")
    assert [len(program.batches(r)) for r in range(2)] == [4, 4]  # one batch per op
    results, fabric = _run(schedule, user_postings(schedule, program))
    assert fabric.posted == [[[("send", 1)], [("send", 1)], [("recv", 1)], [("recv", 1)]],
                             [[("recv", 0)], [("recv", 0)], [("send", 0)], [("send", 0)]]]
    assert_equals_pp1(results, schedule, "torch-gpipe")


def test_a_program_that_can_hang_is_refused_with_its_cycle():
    schedule, program = load(TORCH_1F1B, name="torch-1f1b")
    with pytest.raises(ScheduleError, match=r"can hang under NCCL's rules(.|\n)*"
                       r"cycle: rank 0 -> rank 1 -> rank 0"):
        user_postings(schedule, program)


def test_a_batch_the_executor_cannot_post_as_written():
    # rank 1 receives 1F1 between 1B0 and its send: a send must follow its action
    text = ("0F0,0SEND_F0,0F1,(0SEND_F1;0RECV_B0)BATCH#1,0B0,0RECV_B1,0B1\n"
            "1RECV_F0,1F0,1B0,1RECV_F1,1SEND_B0,1F1,1B1,1SEND_B1\n")
    schedule, program = load(text, name="bad")
    with pytest.raises(ScheduleError, match=r"rank 1's batch #1 as written is \[\('recv', 0, "
                       r"'forward 1F1'\)\], but the executor would post \[\('send', 0, "
                       r"'backward 0B0'\)\]"):
        user_postings(schedule, program)
    two_sends = TORCH_GPIPE.replace("0SEND_F0,0F1,0SEND_F1", "0F1,(0SEND_F0;0SEND_F1)BATCH#0")
    schedule, program = load(two_sends, name="two")
    with pytest.raises(ScheduleError, match="rank 0: the executor cannot post batch #0"):
        user_postings(schedule, program)
    missing = TORCH_GPIPE.replace(",0SEND_F1", "")  # 1F1's activation is never sent
    schedule, program = load(missing, name="missing")
    with pytest.raises(ScheduleError, match=r"rank 0's batch #1 as written is "
                       r"\[\('recv', 1, 'backward 0B0'\)\], but the executor would post "
                       r"\[\('send', 1, 'forward 1F1'\)\]"):
        user_postings(schedule, program)


def test_compute_only_csv_has_no_program():
    schedule, program = load("0F0,0B0\n", name="one")
    assert program is None and [str(a) for a in schedule.actions[0]] == ["0F0", "0B0"]


# ------------------------------------------------------------------ a schedule file, end to end
def test_a_schedule_file_with_its_own_communication_runs_it_under_nccl_rules(tmp_path):
    """zb-h1 at p=2, m=8 written with the LOCKSTEP program (not the fused calls the plugin
    would pick for zb-h1): installed from the file, the plugin posts exactly the file's
    batches (real processes, gloo made to follow NCCL's batch rules), and the step is bit for
    bit the built-in zb-h1's."""
    from megatron_pp_ext.integration.forward_backward import ScheduleFunction
    from megatron_pp_ext.analysis.lowering import LOCKSTEP, lower
    from megatron_pp_ext.schedules import load_schedule_file
    from megatron_pp_ext.train.processes import spawn
    from support.nccl_rules import run_steps_under_rules
    from support.reference import assert_same, merge_results

    built = build_schedule("zb-h1", 2, 8)
    program = lower(built, LOCKSTEP)
    path = tmp_path / "zbh1_lockstep.csv"
    path.write_text(program.to_csv())
    assert load_schedule_file(str(path)).options["communication"] == program.cells()
    timeouts = dict(p2p_timeout_s=30.0, first_step_timeout_s=30.0)
    common = dict(pp=2, num_microbatches=8, ddp=True, nccl_rules=True)
    per_rank = spawn(2, run_steps_under_rules,
                     [dict(common, schedule=ScheduleFunction("zb-h1", **timeouts)),
                      dict(common, schedule=ScheduleFunction(str(path), **timeouts))],
                     timeout_s=300)
    ours, theirs = ([ranks[i] for ranks in per_rank] for i in range(2))
    assert [r["nccl_batches"] for r in theirs] == [len(program.batches(r)) for r in range(2)]
    assert [r["nccl_batches"] for r in ours] != [r["nccl_batches"] for r in theirs]
    assert_same(merge_results(theirs), merge_results(ours))


def test_simulate_command_reads_a_csv_with_its_own_communication(tmp_path, capsys):
    from megatron_pp_ext.cli import main
    from megatron_pp_ext.analysis.lowering import LOCKSTEP, lower

    program = lower(build_schedule("zb-h1", 2, 4), LOCKSTEP)
    path = tmp_path / "own.csv"
    path.write_text(program.to_csv())
    assert main(["simulate", "--csv", str(path), "--nccl-program"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("# own: user posting (the schedule file's own batches")
    assert "\n".join(out[1:]) + "\n" == program.to_csv()
