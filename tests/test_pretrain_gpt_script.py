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
* every schedule the flag offers against Megatron's own schedule, on every release of the
  window (the release matrix), and on 0.19+ under Megatron's ``--step-batch-size-schedule
  "0:2 256:4 768:6 1536:8"`` (8 steps of m = 2, 2, 4, 4, 6, 6, 8, 8 at --seq-length 64): the
  argument-time checks once read --global-batch-size, which Megatron leaves at micro batch x
  data parallel = 1 there, and refused interleaved and dualpipe;
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
# the dynamic loss scaler starts at 2^18: on 0.19 step 1 overflows and is skipped, the scale is
# halved (--hysteresis 1: at the first overflow) and steps 2 and 3 train
FULL_RECOMPUTE_FP16 = ("full-recompute-fp16", 2, 2, 1, [
    "--recompute-granularity", "full", "--recompute-method", "uniform",
    "--recompute-num-layers", "1", "--initial-loss-scale", "262144", "--hysteresis", "1"], True)
SELECTIVE = ("selective-recompute", 2, 2, 1, ["--recompute-granularity", "selective"], False)
COMBOS = [TP2_SP_EVAL, FULL_RECOMPUTE_FP16, SELECTIVE]

# fp16 main gradients (Megatron's default under --fp16: no fp32 accumulation) are summed in
# fp16 in the order microbatches finish: dualpipe sums each direction's half on its copy and
# then the two copies, so an element's gradient can differ by a few fp16 roundings (2^-11
# relative each) from 1F1B's one running sum. Measured (steps 2 and 3, step 1 skipped): grad
# norms 1.4e-5 and 2.0e-4 apart, the step-3 loss 1e-7. (With
# --accumulate-allreduce-grads-in-fp32, as under --bf16, the runs are bit-identical.)
FP16_GRAD_NORM_RTOL = 1e-3
FP16_LOSS_RTOL = 1e-5


#: (combination, schedule): dualpipe under each; the V layout (entry and exit on rank 0) where
#: its batch reading differs most, under tensor parallelism
CASES = [(combo, "dualpipe") for combo in COMBOS] + [(TP2_SP_EVAL, "zb-v")]


@pytest.mark.parametrize("combo,schedule", CASES, ids=[f"{c[0]}-{s}" for c, s in CASES])
def test_entry_and_exit_ranks_train_as_megatrons_1f1b(combo, schedule):
    _name, world, pp, dp, extra, fp16 = combo
    ref = _run(world, _argv(pp, dp, None, extra, fp16=fp16))
    out = _run(world, _argv(pp, dp, schedule, extra, fp16=fp16))
    assert ref["schedule"] == MEGATRON_1F1B
    assert out["schedule"] == f"ScheduleFunction({schedule!r})"
    assert len(out["lm loss"]) == ITERS and out["skipped"] == ref["skipped"]
    assert out["lm loss"][0] == ref["lm loss"][0]  # the same weights, the same data
    if fp16:  # a skipped step (0.19: the first) has no grad norm
        assert [g is None for g in out["grad_norm"]] == [bool(s) for s in ref["skipped"]]
        assert out["lm loss"] == pytest.approx(ref["lm loss"], rel=FP16_LOSS_RTOL)
        trained = [k for k, skipped in enumerate(ref["skipped"]) if not skipped]
        assert [out["grad_norm"][k] for k in trained] == pytest.approx(
            [ref["grad_norm"][k] for k in trained], rel=FP16_GRAD_NORM_RTOL)
    elif schedule == "zb-v":
        assert_v_trains_as(out, ref)
    else:
        assert out["lm loss"] == ref["lm loss"] and out["grad_norm"] == ref["grad_norm"]
    if "--eval-iters" in extra:  # after steps 2 and 3, then the validation and test sets
        assert len(ref["eval lm loss"]) == 3
        assert out["eval lm loss"] == pytest.approx(ref["eval lm loss"], rel=1e-6)


# ------------------------------------------------------------------ every schedule of the flag

SMALL = ["--num-layers", "4"]  # one layer a stage in the V layouts: these runs are many
BATCH_SIZE_SCHEDULE = [*SMALL, "--seq-length", "64", "--max-position-embeddings", "64",
                       "--step-batch-size-schedule", "0:2 256:4 768:6 1536:8"]
COUNTS = [2, 2, 4, 4, 6, 6, 8, 8]  # thresholds in tokens: 256 / 64 = 4 samples, ...
FIXED_COUNTS = [4, 4, 4]  # before 0.19: no batch-size schedule; m = 4, 3 steps
FLAG_SCHEDULES = ["gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2", "zb-v", "v-half", "v-min",
                  "zb-auto", "dualpipev", "dualpipe"]


def _has_batch_size_schedule() -> bool:
    from megatron.training import arguments

    parser = arguments.add_megatron_arguments(__import__("argparse").ArgumentParser())
    return any("--step-batch-size-schedule" in action.option_strings
               for action in parser._actions)


def _counts() -> list[int]:
    return COUNTS if _has_batch_size_schedule() else FIXED_COUNTS


def _batch_schedule_argv(schedule, extra=()):
    """pp 2, one replica: Megatron 0.19's batch-size schedule (no --global-batch-size: the
    two may not be given together), or before 0.19 a fixed batch of 4 microbatches."""
    if not _has_batch_size_schedule():
        return _argv(2, 1, schedule, [*SMALL, *extra], iters=len(FIXED_COUNTS))
    argv = _argv(2, 1, schedule, [*BATCH_SIZE_SCHEDULE, *extra], iters=len(COUNTS))
    at = argv.index("--global-batch-size")
    del argv[at:at + 2]
    return argv


@pytest.fixture(scope="module")
def megatron_1f1b_every_count():
    loop = _run(2, _batch_schedule_argv(None))
    assert loop["schedule"] == MEGATRON_1F1B and loop["microbatches"] == _counts()
    return loop


@pytest.fixture(scope="module")
def megatron_interleaved_every_count():
    interleaved = _run(2, _batch_schedule_argv(
        None, ["--num-virtual-stages-per-pipeline-rank", "2"]))
    assert interleaved["schedule"] == MEGATRON_INTERLEAVED
    assert interleaved["microbatches"] == _counts()
    return interleaved


@pytest.mark.parametrize("schedule", FLAG_SCHEDULES)
def test_every_schedule_trains_as_megatrons_own_schedule(request, schedule):
    """Every schedule the flag offers, through the release's own pretrain_gpt.py, against
    Megatron's own schedule on the same arguments (interleaved: Megatron's interleaved; the
    others: its 1F1B): on 0.19+ under Megatron's batch-size schedule, each step running the
    count the schedule gives it (m = 2, 2, 4, 4, 6, 6, 8, 8), before 0.19 at m = 4."""
    fixture = "interleaved" if schedule == "interleaved" else "1f1b"
    ref = request.getfixturevalue(f"megatron_{fixture}_every_count")
    out = _run(2, _batch_schedule_argv(schedule))
    assert out["schedule"] == f"ScheduleFunction({schedule!r})"
    assert out["microbatches"] == _counts() and out["skipped"] == [0] * len(_counts())
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
