"""Post-validated optimizer step (``integration.post_validation``) against Megatron's own
synchronous ``optimizer.step()``, bit for bit, on the CPU (gloo, 4 processes: pipeline 2 x data
parallel 2, the tiny Megatron-Core GPT, Megatron's ``get_megatron_optimizer``).

Each run trains two replicas side by side (``support.post_validation_run``): the reference
steps synchronously; the other steps optimistically (``begin_step``) and settles at its next
``zero_grad()``. Per step the clip threshold is set so that clipping triggers on steps 1 and
4 and not on 0, 2, 3; on step 3 the last stage's gradient of one parameter is filled with inf
(an fp16 overflow). After every step: model parameters, main parameters, Adam's exp_avg,
exp_avg_sq and step, and the loss scaler's scale and trackers equal bit for bit, and the
returned (success, grad norm, zeros) are Megatron's. A last step goes through the synchronous
``step()`` (what Megatron-LM's ``train_step`` calls). The negative control runs with a
rollback that restores nothing and must differ, so the comparison can fail.
"""

import pytest

from megatron_pp_ext.train.processes import spawn
from support.post_validation_run import run_post_validation

CLIPS = [100.0, 0.05, 100.0, 100.0, 0.05]  # clipping triggers on steps 1 and 4
INF_STEP = 3
TIMEOUT = 300  # a hang fails the test; nothing is timed


def _run(**kwargs):
    return spawn(4, run_post_validation, pp=2, clips=CLIPS, timeout_s=TIMEOUT, **kwargs)


def _check_bit_identical(results, inf_step):
    for r in results:
        assert r["wrapped"] == "ChainedOptimizer"
        assert r["mismatches"] == [[]] * len(CLIPS), (r["rank"], r["mismatches"])
        assert [x["megatron"] for x in r["pv"]] == r["ref"], r["rank"]
        sync_ref, sync_pv, sync_mismatch = r["sync"]
        assert sync_pv == sync_ref and sync_mismatch == []
        for step, outcome in enumerate(r["pv"]):
            if step == inf_step:  # skipped, as Megatron skips it: rolled back, not redone
                assert r["ref"][step] == [False, None, None]
                assert outcome["found_inf"] and outcome["rolled_back"] and not outcome["redone"]
            elif CLIPS[step] < 1.0:  # Megatron clipped: rolled back and redone clipped
                assert outcome["clipped"] and outcome["rolled_back"] and outcome["redone"]
                assert r["ref"][step][1] > CLIPS[step]
            else:  # the optimistic step was Megatron's step: kept
                assert not outcome["rolled_back"] and not outcome["clipped"]
                assert r["ref"][step][1] < CLIPS[step]


@pytest.mark.parametrize("schedule,distributed", [("zb-h2", False), ("1f1b", True)],
                         ids=["float16-optimizer-zb-h2", "distributed-optimizer-1f1b"])
def test_fp16_clipping_and_overflow_bit_identical(schedule, distributed):
    results = _run(precision="fp16", distributed=distributed, schedule=schedule,
                   inf_step=INF_STEP)
    _check_bit_identical(results, INF_STEP)
    leaf = "DistributedOptimizer" if distributed else "Float16OptimizerWithFloat16Params"
    assert {r["leaf"] for r in results} == {leaf}
    for r in results:
        # the snapshot: fp32 main params + exp_avg + exp_avg_sq (12 B each), the fp16 model
        # params (2 B each; all of the rank's, sharded optimizer or not) and Adam's step counts
        per_main = r["snapshot_bytes"][-1] / r["main_numel"]
        assert (14.0 if not distributed else 12.0) <= per_main
        assert r["snapshot_bytes"][0] < r["snapshot_bytes"][-1]  # no Adam state before step 0


@pytest.mark.parametrize("precision,distributed", [("bf16", True), ("fp32", False)])
def test_without_loss_scaler_clipping_bit_identical(precision, distributed):
    results = _run(precision=precision, distributed=distributed, schedule="zb-h1")
    _check_bit_identical(results, inf_step=None)
    leaf = "DistributedOptimizer" if distributed else "FP32Optimizer"
    assert {r["leaf"] for r in results} == {leaf}


def test_rollback_that_restores_nothing_is_caught():
    results = _run(precision="fp16", schedule="zb-h2", inf_step=INF_STEP, without_restore=True)
    for r in results:
        first_rollback = min(step for step, o in enumerate(r["pv"]) if o["rolled_back"])
        assert r["mismatches"][first_rollback], r["rank"]
        assert all(not m for m in r["mismatches"][:first_rollback])


def test_refusals():
    from megatron_pp_ext.integration.post_validation import PostValidatedOptimizer

    with pytest.raises(ValueError, match="FP32Optimizer, Float16Optimizer"):
        PostValidatedOptimizer(object())


# ------------------------------------------------------------------ running ahead (RunAhead)
RUN_AHEAD = [("fp16", False, "zb-h2", INF_STEP), ("fp16", True, "1f1b", INF_STEP),
             ("bf16", True, "zb-h1", None), ("fp32", False, "1f1b", None),
             ("fp32", False, "zb-v", None)]


@pytest.mark.parametrize("precision,distributed,schedule,inf_step", RUN_AHEAD,
                         ids=[f"{c[0]}-{'distributed' if c[1] else 'local'}-{c[2]}"
                              for c in RUN_AHEAD])
def test_run_ahead_bit_identical(precision, distributed, schedule, inf_step):
    """Step k+1 runs on step k's optimistic weights before step k is validated; a step after
    a rolled-back one (clipped, overflowed) or after a loss-scale change is replayed with the
    same microbatches. Losses of every step and the whole state after every step equal
    Megatron's synchronous loop. zb-v: the V layout, two chunks per rank, one recorded
    iterator per chunk."""
    results = _run(precision=precision, distributed=distributed, schedule=schedule,
                   inf_step=inf_step, run_ahead=True,
                   layout="v" if schedule == "zb-v" else "loop")
    for r in results:
        assert r["mismatches"] == [[]] * len(CLIPS), (r["rank"], r["mismatches"])
        assert [x["megatron"] for x in r["pv"]] == r["ref"]
        assert r["pv_losses"] == r["ref_losses"]
        rolled = [o["rolled_back"] for o in r["pv"]]
        assert rolled == [CLIPS[k] < 1.0 or k == inf_step for k in range(len(CLIPS))]
        # replayed: every step after a rollback (fp16: also after the scale grew, step 1)
        for k in range(1, len(CLIPS)):
            if rolled[k - 1]:
                assert r["replayed"][k]
        assert not r["replayed"][0]
        assert r["replays"] == sum(r["replayed"])
    if precision != "fp16":
        assert all(r["replayed"] == [False] + [rolled for rolled in
                   [o["rolled_back"] for o in r["pv"]][:-1]] for r in results)


def test_run_ahead_replays_after_a_loss_scale_change_alone():
    """No clipping, no overflow: the fp16 scaler grows after 2 good steps (window 2), so the
    step after it ran with the old scale and is replayed, though nothing was rolled back."""
    results = spawn(4, run_post_validation, pp=2, clips=[100.0] * 4, precision="fp16",
                    schedule="1f1b", run_ahead=True, timeout_s=TIMEOUT)
    for r in results:
        assert r["mismatches"] == [[]] * 4 and r["pv_losses"] == r["ref_losses"]
        assert not any(o["rolled_back"] for o in r["pv"])
        assert r["replayed"] == [False, False, True, False]


# ------------------------------------------------------------------ Megatron-LM's real loop

#: --clip-grad for the loop's runs: between the grad norms of the tiny GPT's steps as
#: Megatron initialises it (pretrain_gpt.py, pp=2 x dp=2: 2.78, 1.81, 2.32, 2.34, 1.79, 2.20),
#: so some steps are clipped (the redone path) and some are not (the kept one)
CLIP = 2.0

def test_pretrain_flag_bit_identical_to_megatron_step():
    """``--pp-post-validate`` in ``megatron.training.pretrain`` (4 processes, pp=2 x dp=2,
    --bf16 --use-distributed-optimizer --clip-grad 2.0 --overlap-grad-reduce, 5 iterations):
    the optimizer the loop builds is post-validated, clipping triggers on some steps and not
    on others (so both the kept and the redone path run), and losses and grad norms are
    Megatron's own, bit for bit (zb-h2 keeps Megatron's order of arithmetic)."""
    from support.megatron_loop import merge_history, pretrain_argv, run_pretrain
    from support.post_validation_pretrain import run_pretrain_reporting_post_validation

    iters, clip = 5, ["--clip-grad", str(CLIP)]
    reference = merge_history(spawn(4, run_pretrain, pretrain_argv(pp=2, dp=2, iters=iters,
                                                                   extra=clip),
                                    timeout_s=TIMEOUT))
    argv = pretrain_argv(pp=2, dp=2, schedule="zb-h2", iters=iters,
                         extra=clip + ["--pp-post-validate"])
    results = spawn(4, run_pretrain_reporting_post_validation, argv, timeout_s=TIMEOUT)
    out = merge_history(results)
    assert out["lm loss"] == reference["lm loss"]
    assert out["grad_norm"] == reference["grad_norm"]
    assert out["skipped"] == reference["skipped"] == [0] * iters
    for r in results:
        assert len(r["post_validated"]) == 1  # one optimizer per rank, wrapped
        outcomes = r["post_validated"][0]
        assert len(outcomes) == iters
        clipped = [o["clipped"] for o in outcomes]
        assert clipped == [norm > CLIP for norm in reference["grad_norm"]]
        assert all(o["redone"] == o["clipped"] == o["rolled_back"] for o in outcomes)
    assert any(norm > CLIP for norm in reference["grad_norm"])
    assert any(norm <= CLIP for norm in reference["grad_norm"])


def test_pretrain_run_ahead_bit_identical_to_megatron_loop():
    """``--pp-post-validate --pp-run-ahead`` in ``megatron.training.pretrain`` (4 processes,
    pp=2 x dp=2, zb-h2, 6 iterations, an evaluation every 2): Megatron-LM's ``train_step`` is
    the plugin's, each rank starts step k+1 before step k is validated, and every step's
    loss, grad norm and skipped flag, and every evaluation's loss, are those of Megatron's own
    loop (1F1B, synchronous step) bit for bit. --clip-grad 2.0 clips some steps and not
    others; a step after a clipped one is replayed unless the clipped one settled at once
    (before an evaluation, and the last). What the loop logs lags one iteration."""
    from support.megatron_loop import merge_history, pretrain_argv, run_pretrain
    from support.post_validation_pretrain import run_pretrain_reporting_post_validation

    iters, eval_every = 6, 2
    extra = ["--clip-grad", str(CLIP), "--eval-interval", str(eval_every), "--eval-iters", "1"]
    reference = merge_history(spawn(4, run_pretrain, pretrain_argv(pp=2, dp=2, iters=iters,
                                                                   extra=extra),
                                    timeout_s=TIMEOUT))
    argv = pretrain_argv(pp=2, dp=2, schedule="zb-h2", iters=iters,
                         extra=extra + ["--pp-post-validate", "--pp-run-ahead"])
    results = spawn(4, run_pretrain_reporting_post_validation, argv, timeout_s=TIMEOUT)
    settled_at_once = {i for i in range(iters) if (i + 1) % eval_every == 0 or i + 1 == iters}
    for r in results:
        steps = r["run_ahead"]
        assert [s["iteration"] for s in steps] == list(range(iters))
        assert [s["grad_norm"] for s in steps] == reference["grad_norm"]
        assert [s["skipped"] for s in steps] == reference["skipped"] == [0] * iters
        if r["lm loss"]:  # the last pipeline rank of each replica
            assert [s["lm loss"] for s in steps] == reference["lm loss"]
            assert r["eval lm loss"] == reference["eval lm loss"]
            assert len(r["eval lm loss"]) == iters // eval_every + 2  # + valid and test at end
        # the loop logs step k-1 at iteration k
        assert r["grad_norm"] == [None] + reference["grad_norm"][:-1]
        clipped = [o["clipped"] for o in r["post_validated"][0]]
        assert clipped == [norm > CLIP for norm in reference["grad_norm"]]
        replayed = [False] + [clipped[k - 1] and k - 1 not in settled_at_once
                              for k in range(1, iters)]
        assert [s["replayed"] for s in steps] == replayed
        assert any(replayed) and not all(clipped)


def test_pretrain_run_ahead_on_the_v_layout_bit_identical_to_its_synchronous_loop():
    """zb-v with 2p-1 = 3 warm-up forwards (pp=2 x dp=2, two chunks per rank, the loss relayed
    from rank 0 to the last rank without a blocking send) run ahead in
    ``megatron.training.pretrain``: every step's loss, grad norm and skipped flag equal the
    same schedule's under Megatron's own ``train_step`` bit for bit, with --clip-grad 2.0
    clipping some steps (so some steps are replayed)."""
    from support.megatron_loop import merge_history, pretrain_argv, run_pretrain
    from support.post_validation_pretrain import run_pretrain_reporting_post_validation

    iters = 5
    extra = ["--clip-grad", str(CLIP), "--pp-warmup-forwards", "3"]
    reference = merge_history(spawn(4, run_pretrain, pretrain_argv(
        pp=2, dp=2, schedule="zb-v", vp=2, iters=iters, extra=extra), timeout_s=TIMEOUT))
    results = spawn(4, run_pretrain_reporting_post_validation, pretrain_argv(
        pp=2, dp=2, schedule="zb-v", vp=2, iters=iters,
        extra=extra + ["--pp-post-validate", "--pp-run-ahead"]), timeout_s=TIMEOUT)
    replays = 0
    for r in results:
        steps = r["run_ahead"]
        assert [s["grad_norm"] for s in steps] == reference["grad_norm"]
        assert [s["skipped"] for s in steps] == reference["skipped"] == [0] * iters
        if r["lm loss"]:
            assert [s["lm loss"] for s in steps] == reference["lm loss"]
        replays += sum(s["replayed"] for s in steps)
    assert replays > 0 and any(norm <= CLIP for norm in reference["grad_norm"])


def test_run_ahead_refuses_flags_that_read_weights_after_the_step():
    import argparse

    from megatron_pp_ext.integration.run_ahead_step import refused_flags, synchronising_flags

    args = argparse.Namespace(log_params_norm=True, overlap_param_gather=False,
                              rerun_mode="validate_results")
    assert refused_flags(args) == [
        "--log-params-norm (the loop reads every rank's weights after each step, before it "
        "settles)"]
    assert synchronising_flags(args) == [
        "--rerun-mode validate_results all-reduces a flag over every rank after each "
        "forward-backward (add --rerun-mode disabled)"]
    args = argparse.Namespace(log_params_norm=False, rerun_mode="disabled")
    assert refused_flags(args) == [] and synchronising_flags(args) == []


# ------------------------------------------------------------------ install() and the flag
def test_install_option_wraps_megatron_training_optimizer_factory():
    import megatron.core.optimizer as megatron_optimizer
    from megatron.training import training

    import megatron_pp_ext
    from megatron_pp_ext.integration.install import current_installation

    original = megatron_optimizer.get_megatron_optimizer
    assert training.get_megatron_optimizer is original
    try:
        megatron_pp_ext.install(schedule="1f1b", post_validate=True)
        assert current_installation().options.post_validate
        assert getattr(training.get_megatron_optimizer, "post_validated", False)
        # the library's own name too, so a module imported later binds the wrapper
        assert megatron_optimizer.get_megatron_optimizer is training.get_megatron_optimizer
        megatron_pp_ext.install(schedule="1f1b")  # installing again without it: put back
        assert training.get_megatron_optimizer is original
        megatron_pp_ext.install(schedule="zb-h2", post_validate=True)
        assert getattr(training.get_megatron_optimizer, "post_validated", False)
    finally:
        megatron_pp_ext.uninstall()
    assert training.get_megatron_optimizer is original
    assert megatron_optimizer.get_megatron_optimizer is original


def test_megatron_lm_flag():
    import argparse

    from megatron_pp_ext.integration import megatron_args

    parser = megatron_args.add_pipeline_schedule_args(argparse.ArgumentParser())
    args = parser.parse_args(["--pipeline-schedule", "zb-h2", "--pp-post-validate"])
    args.pipeline_model_parallel_size = 4
    assert megatron_args.schedule_options_from_args(args)["post_validate"] is True
    args = parser.parse_args(["--pipeline-schedule", "zb-h2"])
    args.pipeline_model_parallel_size = 4
    assert "post_validate" not in megatron_args.schedule_options_from_args(args)
    args = parser.parse_args(["--pp-post-validate"])
    args.pipeline_schedule = None
    with pytest.raises(ValueError, match="add --pipeline-schedule"):
        megatron_args.schedule_options_from_args(args)
    args = parser.parse_args(["--pipeline-schedule", "zb-h2", "--pp-post-validate",
                              "--pp-run-ahead"])
    args.pipeline_model_parallel_size = 4
    options = megatron_args.schedule_options_from_args(args)
    assert options["post_validate"] is True and options["run_ahead"] is True
    args = parser.parse_args(["--pipeline-schedule", "zb-h2", "--pp-run-ahead"])
    args.pipeline_model_parallel_size = 4
    with pytest.raises(ValueError, match="add --pp-post-validate"):
        megatron_args.schedule_options_from_args(args)


def test_zb_v_warmup_forwards_option_and_flag():
    import argparse

    import megatron_pp_ext
    from megatron_pp_ext.integration import megatron_args

    with pytest.raises(ValueError, match="warmup_forwards=7 shapes zb-v only, and zb-h2 would "
                                         "ignore it: drop it or use schedule='zb-v'"):
        megatron_pp_ext.install(schedule="zb-h2", warmup_forwards=7)
    parser = megatron_args.add_pipeline_schedule_args(argparse.ArgumentParser())
    args = parser.parse_args(["--pipeline-schedule", "zb-v", "--pp-warmup-forwards", "7"])
    args.pipeline_model_parallel_size, args.virtual_pipeline_model_parallel_size = 4, 2
    args.untie_embeddings_and_output_weights = True
    assert megatron_args.schedule_options_from_args(args)["warmup_forwards"] == 7
    args = parser.parse_args(["--pipeline-schedule", "zb-h2", "--pp-warmup-forwards", "7"])
    args.pipeline_model_parallel_size = 4
    with pytest.raises(ValueError, match="--pp-warmup-forwards 7 shapes zb-v only, and zb-h2 "
                                         "would ignore it"):
        megatron_args.schedule_options_from_args(args)


def test_install_run_ahead_replaces_train_step_and_puts_it_back():
    from megatron.training import training

    import megatron_pp_ext
    from megatron_pp_ext.integration.run_ahead_step import LocalMaxStat, RunAheadTrainStep

    original = training.train_step
    original_max_stat = training.reduce_max_stat_across_model_parallel_group
    with pytest.raises(ValueError, match="add post_validate=True"):
        megatron_pp_ext.install(schedule="zb-h2", run_ahead=True)
    assert training.train_step is original
    try:
        installation = megatron_pp_ext.install(schedule="zb-h2", post_validate=True,
                                               run_ahead=True)
        assert isinstance(training.train_step, RunAheadTrainStep)
        assert installation.train_step is training.train_step
        # training_log's per-iteration learning-rate all-reduce, made local once checked
        assert isinstance(training.reduce_max_stat_across_model_parallel_group, LocalMaxStat)
        assert training.train_step.max_stat is training.reduce_max_stat_across_model_parallel_group
        megatron_pp_ext.install(schedule="zb-h2", post_validate=True)  # again, without it
        assert training.train_step is original and installation.train_step is None
        assert training.reduce_max_stat_across_model_parallel_group is original_max_stat
        megatron_pp_ext.install(schedule="zb-h2", post_validate=True, run_ahead=True)
        assert isinstance(training.train_step, RunAheadTrainStep)
    finally:
        megatron_pp_ext.uninstall()
    assert training.train_step is original
    assert training.reduce_max_stat_across_model_parallel_group is original_max_stat
