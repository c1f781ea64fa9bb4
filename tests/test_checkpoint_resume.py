"""Resume without a lost or changed step (issue 27, item 4): Megatron-LM's real loop
(``megatron.training.pretrain``, 4 gloo processes, pp=2 x dp=2, --bf16
--use-distributed-optimizer --clip-grad 1.0 --overlap-grad-reduce) with Megatron's own
checkpointing (torch_dist, the default format).

Each case: a run with ``--save CK --save-interval 2`` is killed (every rank SIGKILLs itself, as
``scancel`` does: nothing flushed) when the loop calls ``train_step`` for iteration 3, so the
third step ran after the checkpoint and is lost; the same command with ``--load CK`` then runs
iterations 2..4 (0-based). Every resumed step's loss and grad norm equal the uninterrupted
run's, bit for bit: Megatron's 1F1B, which 1f1b, zb-h1 and zb-h1 with ``--pp-post-validate
--pp-run-ahead`` reproduce bit for bit (tests/test_pretrain_loop.py, test_post_validation.py).

The run-ahead case is the one where a checkpoint could go wrong: its train_step returns with the
step's optimizer update still unsettled. The checkpointed step (the second) is clipped, so its
optimistic, unclipped update is rolled back and redone; a checkpoint of the optimistic state
would resume from other weights. zb-v (the V layout) is resumed across two SLURM nodes in
tests/test_slurm.py.

Megatron-Core 0.19.2 without apex and Transformer Engine cannot load its own distributed
optimizer checkpoint (it asserts, then restarts Adam's step count): the test support's
``megatron_loop._checkpoint_patches`` say where and why.
"""

import json

import pytest

from megatron_pp_ext.train.processes import SpawnError, spawn
from support.megatron_loop import (
    assert_v_trains_as,
    merge_history,
    pretrain_argv,
    run_pretrain,
    run_pretrain_shared,
)

ITERS = 5
SAVE_INTERVAL = 2
KILLED_AT = 3  # train_step(iteration=3): step 2 ran after the checkpoint at 2 and is lost
TIMEOUT = 300  # a hang fails the test; nothing is timed
RUN_AHEAD = ["--pp-post-validate", "--pp-run-ahead"]

pytestmark = pytest.mark.megatron_cpu


def _argv(schedule, extra=()):
    return pretrain_argv(pp=2, dp=2, schedule=schedule, iters=ITERS, extra=list(extra))


@pytest.fixture(scope="module")
def uninterrupted():
    """Megatron's own 1F1B, 5 iterations, no checkpoint."""
    return merge_history(run_pretrain_shared(4, _argv(None), TIMEOUT))


def _steps(results):
    """{iteration: (loss, grad norm)} of a run's settled steps: train_step's returns, or with
    --pp-run-ahead the run-ahead reports (the loop logs step k-1 at iteration k)."""
    if "run_ahead" in results[0]:
        reports = {r["rank"]: r["run_ahead"] for r in results}
        grad = {s["iteration"]: s["grad_norm"] for s in reports[0]}
        losses = {s["iteration"]: s["lm loss"] for rank in reports for s in reports[rank]
                  if s["lm loss"] is not None}
        return {i: (losses[i], grad[i]) for i in grad}
    merged = merge_history(results)
    return {i: (loss, norm) for i, loss, norm in
            zip(merged["iteration"], merged["lm loss"], merged["grad_norm"])}


@pytest.mark.parametrize("schedule, extra", [("1f1b", []), ("zb-h1", []), ("zb-h1", RUN_AHEAD)],
                         ids=["1f1b", "zb-h1", "zb-h1-post-validated-run-ahead"])
def test_a_killed_run_resumes_bit_identical(tmp_path, uninterrupted, schedule, extra):
    checkpoints, records = tmp_path / "ck", tmp_path / "records"
    records.mkdir()
    with pytest.raises(SpawnError, match="died with exit code -9"):
        spawn(4, run_pretrain, _argv(schedule, [*extra, "--save", str(checkpoints),
                                                "--save-interval", str(SAVE_INTERVAL)]),
              kill_at_iteration=KILLED_AT, record_to=str(records),
              timeout_s=TIMEOUT)
    # the checkpoint at 2 is complete; the first rank to die had run step 2 (lost with it)
    assert (checkpoints / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    assert sorted(p.name for p in checkpoints.iterdir()) == [
        "iter_0000002", "latest_checkpointed_iteration.txt"]
    killed = [json.loads(p.read_text()) for p in records.glob("history-rank*.json")]
    assert any(k["iteration"] == [0, 1, 2] for k in killed), [k["iteration"] for k in killed]

    resumed = spawn(4, run_pretrain, _argv(schedule, [*extra, "--load", str(checkpoints)]),
                    timeout_s=TIMEOUT)
    steps = _steps(resumed)
    assert sorted(steps) == [2, 3, 4]
    reference = {i: (uninterrupted["lm loss"][i], uninterrupted["grad_norm"][i])
                 for i in range(ITERS)}
    assert steps == {i: reference[i] for i in (2, 3, 4)}
    assert uninterrupted["skipped"] == [0] * ITERS
    # the checkpointed step was clipped (--clip-grad 1.0): run ahead, its optimistic update
    # was rolled back and redone before the save
    assert uninterrupted["grad_norm"][SAVE_INTERVAL - 1] > 1.0


def _dualpipe_argv(extra=()):
    return pretrain_argv(pp=2, dp=2, schedule="dualpipe", vp=2, iters=ITERS, extra=list(extra))


def _killed_after_checkpoint(argv, checkpoints, tmp_path):
    records = tmp_path / "records"
    records.mkdir(exist_ok=True)
    with pytest.raises(SpawnError, match="died with exit code -9"):
        spawn(4, run_pretrain, [*argv, "--save", str(checkpoints),
                                "--save-interval", str(SAVE_INTERVAL)],
              kill_at_iteration=KILLED_AT, record_to=str(records),
              timeout_s=TIMEOUT)
    assert (checkpoints / "latest_checkpointed_iteration.txt").read_text().strip() == "2"


def test_dualpipe_checkpoints_one_copy_and_resumes_bit_identical(tmp_path, uninterrupted):
    """dualpipe holds every part twice; each copy (chunk 1) writes its distributed-checkpoint
    entries as replicas of its partner's chunk 0, so the checkpoint holds one copy (two main
    replicas of a shard were refused by torch_dist before). Killed after the checkpoint at 2,
    resumed with --load: the resumed steps equal the uninterrupted run's (Megatron's 1F1B,
    which dualpipe trains bit for bit here)."""
    checkpoints = tmp_path / "ck"
    _killed_after_checkpoint(_dualpipe_argv(), checkpoints, tmp_path)
    resumed = spawn(4, run_pretrain, _dualpipe_argv(["--load", str(checkpoints)]),
                    timeout_s=TIMEOUT)
    steps = _steps(resumed)
    assert steps == {i: (uninterrupted["lm loss"][i], uninterrupted["grad_norm"][i])
                     for i in (2, 3, 4)}


def _one_replica_argv(schedule=None, extra=()):
    """pp=2 without data parallelism (2 ranks): the cross-layout cases need no replicas."""
    vp = 2 if schedule in ("dualpipe", "zb-v") else None
    return pretrain_argv(pp=2, dp=1, schedule=schedule, vp=vp, iters=ITERS, extra=list(extra))


def _written_by(schedule, tmp_path):
    """The checkpoint at iteration 2 of a ``schedule`` run killed at iteration 3."""
    folder = tmp_path / (schedule or "1f1b")
    folder.mkdir()
    records = folder / "records"
    records.mkdir()
    with pytest.raises(SpawnError, match="died with exit code -9"):
        spawn(2, run_pretrain, _one_replica_argv(schedule, [
            "--save", str(folder / "ck"), "--save-interval", str(SAVE_INTERVAL)]),
              kill_at_iteration=KILLED_AT, record_to=str(records), timeout_s=TIMEOUT)
    assert (folder / "ck" / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    return folder / "ck"


def _resumed_from(checkpoints, schedule=None):
    """The steps after loading ``checkpoints``' weights (--no-load-optim) under ``schedule``
    (None: Megatron's own 1F1B)."""
    argv = _one_replica_argv(schedule, ["--load", str(checkpoints), "--no-load-optim"])
    return _steps(spawn(2, run_pretrain, argv, timeout_s=TIMEOUT))


@pytest.fixture(scope="module")
def from_1f1b(tmp_path_factory):
    """(the checkpoint Megatron's 1F1B wrote at iteration 2, its steps resumed from it)."""
    written = _written_by(None, tmp_path_factory.mktemp("from-1f1b"))
    resumed = _resumed_from(written)
    assert sorted(resumed) == [2, 3, 4]
    return written, resumed


def test_a_1f1b_checkpoint_resumes_under_dualpipe(from_1f1b):
    """The checkpoint Megatron's 1F1B writes resumes under dualpipe (each part's two copies
    load the same entries) with the steps of 1F1B resumed from it, bit for bit. The optimizer
    state is left out (--no-load-optim): loading it into another layout needs Megatron's
    fully reshardable format (--dist-ckpt-optim-fully-reshardable), whose load fails on the
    CPU without apex even from 1F1B into 1F1B (KeyError 'step', Megatron-Core 0.19.2)."""
    written, resumed = from_1f1b
    assert _resumed_from(written, "dualpipe") == resumed


def test_checkpoints_cross_between_megatrons_1f1b_dualpipe_and_zb_v(tmp_path, from_1f1b):
    """A checkpoint is the model, whichever layout wrote it: dualpipe writes 1F1B's model,
    which Megatron's 1F1B loads and trains exactly as from its own checkpoint of the same
    step; zb-v resumes from 1F1B's (the V layout's stages load their layers by global number)
    within the V layout's tolerance."""
    written, resumed = from_1f1b
    assert _resumed_from(_written_by("dualpipe", tmp_path)) == resumed
    under_zb_v = _resumed_from(written, "zb-v")
    steps = (2, 3, 4)
    assert_v_trains_as({"lm loss": [under_zb_v[i][0] for i in steps],
                        "grad_norm": [under_zb_v[i][1] for i in steps]},
                       {"lm loss": [resumed[i][0] for i in steps],
                        "grad_norm": [resumed[i][1] for i in steps]})
