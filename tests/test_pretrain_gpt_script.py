"""Megatron-LM's own ``pretrain_gpt.py`` (this release's, shared/megatron-lm/<version>/) through
``scripts/pretrain_gpt_pp.py``, with the flags users combine (issue 59). Every run here, as every
run of the tests' Megatron-LM loop (support.megatron_loop), is the script users launch: its
``get_batch`` (which reads data only on the ranks it believes hold an entry or an exit), its
TP batch broadcast, its dataset provider and loss.

* dualpipe and zb-v against Megatron's 1F1B on the same arguments: tensor parallel 2 with
  sequence parallelism and evaluation iterations; full recompute under fp16 with dynamic loss
  scaling; selective recompute. dualpipe holds the model's entry and exit on ranks 0 and p-1,
  zb-v on rank 0: before issue 59 the script gave the copy of part 0 on rank p-1 no tokens
  (``TypeError: embedding(): argument 'indices' ... must be Tensor, not NoneType``) and, with
  TP, its second TP rank none either.
* Megatron 0.19's ``--step-batch-size-schedule "0:2 256:4 768:6 1536:8"`` (8 steps of m = 2, 2,
  4, 4, 6, 6, 8, 8 at --seq-length 64): every schedule the flag offers trains it as Megatron's
  own schedule does (the argument-time checks once read --global-batch-size, which Megatron
  leaves at micro batch x data parallel = 1 there, and refused interleaved and dualpipe);
  its evaluation (Megatron's default eval batch: 1 microbatch) runs under dualpipe, and is
  refused under interleaved at argument time, naming the flag to change (Megatron's own
  interleaved stops at its first evaluation, mid-run).

Tolerances: dualpipe and the loop schedules keep Megatron's order of arithmetic (bit-identical),
except under fp16 main gradients (below); the V layout sums the grad norm's per-rank parts in
another order (support.megatron_loop.assert_v_trains_as).
"""

import pytest

from megatron_pp_ext.train.processes import SpawnError, spawn
from support.megatron_loop import (
    assert_v_trains_as,
    merge_history,
    pretrain_argv,
    run_pretrain,
    run_pretrain_shared,
)

pytestmark = pytest.mark.megatron_cpu
ITERS = 3
TIMEOUT = 300  # a hang fails the test; nothing is timed
MEGATRON_1F1B = "forward_backward_pipelining_without_interleaving"
MEGATRON_INTERLEAVED = "forward_backward_pipelining_with_interleaving"
TWO_CHUNKS = {"interleaved": 2, "zb-v": 2, "dualpipev": 2, "v-half": 2, "v-min": 2,
              "dualpipe": 2}


def _argv(pp, dp, schedule, extra, iters=ITERS, fp16=False):
    argv = pretrain_argv(pp=pp, dp=dp, schedule=schedule, vp=TWO_CHUNKS.get(schedule),
                         iters=iters, extra=extra)
    if fp16:
        argv[argv.index("--bf16")] = "--fp16"  # dynamic loss scaling: Megatron's default
    return argv


def _run(world, argv):
    """One launch per argument set a session (support.shared_runs), merged."""
    return merge_history(run_pretrain_shared(world, argv, TIMEOUT))


# ------------------------------------------------------------------ flags users combine

TP2_SP_EVAL = ("tp2-sp-eval", 4, 2, 1, ["--tensor-model-parallel-size", "2",
                                         "--sequence-parallel", "--eval-interval", "2",
                                         "--eval-iters", "1"], False)
# the dynamic loss scaler starts at 2^18: step 1 overflows and is skipped, the scale is halved
# (--hysteresis 1: at the first overflow) and steps 2 and 3 train
FULL_RECOMPUTE_FP16 = ("full-recompute-fp16", 4, 2, 2, [
    "--recompute-granularity", "full", "--recompute-method", "uniform",
    "--recompute-num-layers", "1", "--initial-loss-scale", "262144", "--hysteresis", "1"], True)
SELECTIVE = ("selective-recompute", 4, 2, 2, ["--recompute-granularity", "selective"], False)
COMBOS = [TP2_SP_EVAL, FULL_RECOMPUTE_FP16, SELECTIVE]

# fp16 main gradients (Megatron's default under --fp16: no fp32 accumulation) are summed in
# fp16 in the order microbatches finish: dualpipe sums each direction's half on its copy and
# then the two copies, so an element's gradient can differ by a few fp16 roundings (2^-11
# relative each) from 1F1B's one running sum. Measured (steps 2 and 3, step 1 skipped): grad
# norms 1.4e-5 and 2.0e-4 apart, the step-3 loss 1e-7. (With
# --accumulate-allreduce-grads-in-fp32, as under --bf16, the runs are bit-identical.)
FP16_GRAD_NORM_RTOL = 1e-3
FP16_LOSS_RTOL = 1e-5


@pytest.mark.parametrize("schedule", ["dualpipe", "zb-v"])
@pytest.mark.parametrize("name,world,pp,dp,extra,fp16", COMBOS, ids=[c[0] for c in COMBOS])
def test_entry_and_exit_ranks_train_as_megatrons_1f1b(name, world, pp, dp, extra, fp16,
                                                       schedule):
    ref = _run(world, _argv(pp, dp, None, extra, fp16=fp16))
    out = _run(world, _argv(pp, dp, schedule, extra, fp16=fp16))
    assert ref["schedule"] == MEGATRON_1F1B
    assert out["schedule"] == f"ScheduleFunction({schedule!r})"
    assert len(out["lm loss"]) == ITERS and out["skipped"] == ref["skipped"]
    assert ref["skipped"] == ([1, 0, 0] if fp16 else [0] * ITERS)
    assert out["lm loss"][0] == ref["lm loss"][0]  # the same weights, the same data
    if fp16:  # no grad norm for the skipped step
        assert out["grad_norm"][0] is ref["grad_norm"][0] is None
        assert out["lm loss"] == pytest.approx(ref["lm loss"], rel=FP16_LOSS_RTOL)
        assert out["grad_norm"][1:] == pytest.approx(ref["grad_norm"][1:],
                                                     rel=FP16_GRAD_NORM_RTOL)
    elif schedule == "zb-v":
        assert_v_trains_as(out, ref)
    else:
        assert out["lm loss"] == ref["lm loss"] and out["grad_norm"] == ref["grad_norm"]
    if "--eval-iters" in extra:  # after steps 2 and 3, then the validation and test sets
        assert len(ref["eval lm loss"]) == 3
        assert out["eval lm loss"] == pytest.approx(ref["eval lm loss"], rel=1e-6)


# ------------------------------------------------------------------ batch-size schedule

BATCH_SIZE_SCHEDULE = ["--seq-length", "64", "--max-position-embeddings", "64",
                       "--step-batch-size-schedule", "0:2 256:4 768:6 1536:8"]
STEPS = 8
COUNTS = [2, 2, 4, 4, 6, 6, 8, 8]  # thresholds in tokens: 256 / 64 = 4 samples, ...
FLAG_SCHEDULES = ["gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2", "zb-v", "v-half", "v-min",
                  "zb-auto", "dualpipev", "dualpipe"]


def _batch_schedule_argv(schedule, extra=()):
    """pp 2, one replica, Megatron 0.19's batch-size schedule (no --global-batch-size: the
    two may not be given together)."""
    argv = _argv(2, 1, schedule, [*BATCH_SIZE_SCHEDULE, *extra], iters=STEPS)
    at = argv.index("--global-batch-size")
    del argv[at:at + 2]
    return argv


@pytest.fixture(scope="module")
def megatron_with_batch_schedule():
    """Megatron's own 1F1B and interleaved schedule under the batch-size schedule."""
    loop = _run(2, _batch_schedule_argv(None))
    interleaved = _run(2, _batch_schedule_argv(
        None, ["--num-virtual-stages-per-pipeline-rank", "2"]))
    assert (loop["schedule"], interleaved["schedule"]) == (MEGATRON_1F1B, MEGATRON_INTERLEAVED)
    assert loop["microbatches"] == interleaved["microbatches"] == COUNTS
    return {"1f1b": loop, "interleaved": interleaved}


@pytest.mark.parametrize("schedule", FLAG_SCHEDULES)
def test_every_schedule_trains_megatrons_batch_size_schedule(megatron_with_batch_schedule,
                                                             schedule):
    """Each step runs the count the schedule gives it, and the steps train as Megatron's
    own schedule trains them (interleaved: Megatron's interleaved; the others: its 1F1B)."""
    out = _run(2, _batch_schedule_argv(schedule))
    assert out["schedule"] == f"ScheduleFunction({schedule!r})"
    assert out["microbatches"] == COUNTS and out["skipped"] == [0] * STEPS
    ref = megatron_with_batch_schedule["interleaved" if schedule == "interleaved" else "1f1b"]
    if schedule in ("zb-v", "v-half", "v-min", "dualpipev"):
        assert_v_trains_as(out, ref)
    else:
        assert out["lm loss"] == ref["lm loss"] and out["grad_norm"] == ref["grad_norm"]


EVAL = ["--eval-interval", "4", "--eval-iters", "1"]


def test_the_batch_schedules_one_microbatch_evaluation_runs_under_dualpipe():
    """Megatron leaves --eval-global-batch-size at micro batch x data parallel = 1 under a
    batch-size schedule: dualpipe runs that one microbatch in its first direction, as 1F1B."""
    ref = _run(2, _batch_schedule_argv(None, EVAL))
    out = _run(2, _batch_schedule_argv("dualpipe", EVAL))
    assert len(ref["eval lm loss"]) == 4  # after steps 4 and 8, then validation and test
    assert out["eval lm loss"] == ref["eval lm loss"]
    assert out["lm loss"] == ref["lm loss"] and out["grad_norm"] == ref["grad_norm"]


def test_a_count_the_schedule_cannot_run_is_refused_before_any_communication():
    """interleaved cannot run the 1-microbatch evaluation at p = 2 (Megatron's own rule for
    its interleaved schedule, which Megatron's loop enforces only at the first evaluation,
    mid-run): the plugin refuses at argument time on every rank, naming the count, where it
    comes from and the flag that sets it, before pretrain() joins any process group."""
    with pytest.raises(SpawnError) as refused:
        spawn(2, run_pretrain, _batch_schedule_argv("interleaved", EVAL), timeout_s=TIMEOUT)
    text = str(refused.value)
    assert "ValueError: --pipeline-schedule interleaved cannot run 1 microbatches per " \
           "evaluation step at --pipeline-model-parallel-size 2 (evaluation: " \
           "--eval-global-batch-size 1 / (--eval-micro-batch-size 1 x data-parallel size 1))" \
           in text
    assert "initialize_megatron" not in text and "failed too" in text
