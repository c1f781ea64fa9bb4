"""Megatron-LM's real training loop, ``megatron.training.pretrain`` from the installed wheel, on
the CPU (gloo, 4 processes: data parallel 2 beside pipeline parallel 2), 5 iterations, with the
flags people train with (--bf16 --use-distributed-optimizer --clip-grad 1.0
--overlap-grad-reduce): Megatron's own schedule against every ``--pipeline-schedule``.

One launch per configuration a session (``support.megatron_loop.run_pretrain_shared``: the
resume tests and the SLURM test read the same runs; ``run_pretrain``: our GPT model provider,
a MockGPTDataset provider, the CPU patches the loop needs), each with the weights as Megatron
initialises them (no test-side filling), so a comparison holds what a user would see:

* bit-identical losses and grad norms where the order of arithmetic is Megatron's: 1f1b,
  gpipe, zb-h1, zb-h2 and auto (whichever of those auto picks) against Megatron's 1F1B;
  interleaved against Megatron's interleaved schedule;
* zb-v, dualpipev, v-half, v-min and zb-auto on two chunks (the V layout) against Megatron's
  1F1B (zb-auto on one chunk: bit-identical): their model providers start every parameter as
  1F1B does (``v_layout_models``, ``loop_init``), so the losses are equal; the grad norm sums
  its per-rank parts in another order, so the first step is held to fp32 (rtol 1e-6) and the
  later ones to the bf16 weights' rounding, which that last bit can tip through the clip
  coefficient (rtol 1e-4 for losses, 2e-3 for grad norms: support.megatron_loop's
  FIRST_STEP_RTOL);
* the V layouts with what users add (issue 22): ``--calculate-per-token-loss`` (the gradients
  are divided by the token count, which lives on rank 0 there), tied embeddings (both copies on
  rank 0, summed there) against Megatron's 1F1B with tied embeddings, and three
  ``--pipeline-model-parallel-layout`` strings: every V stage holds the string's layers
  (parameter count and layer numbers as Megatron builds that stage) and trains as Megatron's
  1F1B with the string's stages merged pairwise.

Every schedule runs with all four flags; the split-backward schedules with
--overlap-grad-reduce over 5 iterations are what caught the grad-sync point of one chunk
(docs/megatron-lm.md, "The real loop in CI").
"""

import math

import pytest

from support.megatron_lm_scripts import scripts_folder
from support.megatron_loop import (
    FIRST_STEP_RTOL,
    assert_dualpipe_copies_equal,
    assert_v_trains_as,
    merge_history,
    pretrain_argv,
    run_pretrain_shared,
)

ITERS = 5  # the fewest the issue allows
TIMEOUT = 300  # a hang fails the test; nothing is timed
OVERLAP = "--overlap-grad-reduce"
UNTIE = "--untie-embeddings-and-output-weights"
PER_TOKEN = "--calculate-per-token-loss"
LAYOUT = "--pipeline-model-parallel-layout"

MEGATRON_1F1B = "forward_backward_pipelining_without_interleaving"
MEGATRON_INTERLEAVED = "forward_backward_pipelining_with_interleaving"

_RUNS: dict = {}  # the merged history per configuration, for the tests of this module


def _pretrain(schedule=None, vp=None, overlap=True, tied=False, extra=()):
    key = (schedule, vp, overlap, tied, tuple(extra))
    if key not in _RUNS:
        argv = pretrain_argv(pp=2, dp=2, schedule=schedule, vp=vp, iters=ITERS, extra=extra)
        if not overlap:
            argv.remove(OVERLAP)
        if tied:
            argv.remove(UNTIE)
        _RUNS[key] = merge_history(run_pretrain_shared(4, argv, TIMEOUT))
    return _RUNS[key]


@pytest.fixture(scope="module")
def megatron_1f1b():
    return _pretrain()


@pytest.fixture(scope="module")
def megatron_interleaved():
    return _pretrain(vp=2)


def _check_run(history, schedule_name):
    # the release's own pretrain_gpt.py ran the steps (its forward_step and get_batch)
    assert history["forward_step_file"] == str(scripts_folder() / "pretrain_gpt.py")
    assert history["schedule"] == schedule_name
    assert len(history["lm loss"]) == ITERS and len(history["grad_norm"]) == ITERS
    assert history["skipped"] == [0] * ITERS
    assert all(math.isfinite(x) for x in history["lm loss"] + history["grad_norm"])
    # every step's grad-ready calls are the ones Megatron DDP learned (--overlap-grad-reduce
    # starts a bucket's reduction when they are met): auto relearns them after its switch
    for rank_steps in history["grad_ready_as_learned"]:
        assert all(as_learned in (None, True) for as_learned in rank_steps), rank_steps


def test_megatron_own_schedules_train(megatron_1f1b, megatron_interleaved):
    _check_run(megatron_1f1b, MEGATRON_1F1B)
    _check_run(megatron_interleaved, MEGATRON_INTERLEAVED)
    # the loss moves, and --clip-grad 1.0 had something to clip
    assert megatron_1f1b["lm loss"][-1] != megatron_1f1b["lm loss"][0]
    assert max(megatron_1f1b["grad_norm"]) > 1.0
    # Megatron seeds each pipeline rank apart: its interleaved layout starts from other weights
    assert megatron_interleaved["lm loss"][0] != megatron_1f1b["lm loss"][0]


# (schedule, virtual stages, --overlap-grad-reduce, reference, bit-identical)
CASES = [
    ("1f1b", None, True, "1f1b", True),
    ("gpipe", None, True, "1f1b", True),
    ("interleaved", 2, True, "interleaved", True),
    ("zb-h1", None, True, "1f1b", True),
    ("zb-h2", None, True, "1f1b", True),
    ("auto", None, True, "1f1b", True),
    ("zb-v", 2, True, "1f1b", False),
    ("dualpipev", 2, True, "1f1b", False),
    # built for costs and memory (issue 25): zb-auto in the loop layout (one chunk: the
    # arithmetic is 1F1B's, each stage's W's in microbatch order) and in the V layout
    ("zb-auto", None, True, "1f1b", True),
    ("zb-auto", 2, True, "1f1b", False),
    ("v-half", 2, True, "1f1b", False),
    ("v-min", 2, True, "1f1b", False),
]


@pytest.mark.parametrize(
    "schedule,vp,overlap,reference,exact", CASES,
    ids=[case[0] + ("-v" if case[0] == "zb-auto" and case[1] else "") for case in CASES])
def test_pipeline_schedule_flag_matches_megatron(
    request, schedule, vp, overlap, reference, exact
):
    ref = request.getfixturevalue(f"megatron_{reference}")
    out = _pretrain(schedule=schedule, vp=vp, overlap=overlap)
    _check_run(out, f"ScheduleFunction({schedule!r})")
    if schedule == "auto":  # one choice for the job: both data-parallel pipelines run it
        assert len(set(out["auto_choice"])) == 1 and out["auto_choice"][0] is not None
    if exact:
        assert out["lm loss"] == ref["lm loss"]
        assert out["grad_norm"] == ref["grad_norm"]
    else:
        assert_v_trains_as(out, ref)
        assert out["lm loss"][0] == ref["lm loss"][0]  # the same starting weights


# ------------------------------------------------------------------ uneven loop layouts

FIRST_LAST = ("--decoder-first-pipeline-num-layers", "3", "--decoder-last-pipeline-num-layers",
              "5")
ACCOUNT = ("--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split")
STRING = (LAYOUT, "Et|tttttttL")
# every loop schedule (and auto, which measures and switches among them) under one of
# Megatron's uneven splits, each split under at least one, against Megatron's own 1F1B with the
# same flags; (decoder layers per stage)
UNEVEN = [("1f1b", FIRST_LAST, [3, 5]), ("zb-h2", FIRST_LAST, [3, 5]),
          ("gpipe", ACCOUNT, [4, 4]), ("zb-h1", STRING, [1, 7]), ("auto", STRING, [1, 7])]


@pytest.mark.parametrize("schedule,flags,decoders", UNEVEN,
                         ids=[f"{row[0]}-{row[1][0][2:12]}" for row in UNEVEN])
def test_uneven_loop_layouts_train_as_megatrons_1f1b(schedule, flags, decoders):
    """Megatron's uneven splits through its own loop: the stages hold what Megatron builds
    (and what ``plan`` says they hold), the losses and grad norms are Megatron's, bit for bit."""
    from megatron_pp_ext.planner.pretrain_args import parse_pretrain_args
    from megatron_pp_ext.integration.stage_layers import stage_layers

    ref = _pretrain(extra=list(flags))
    _check_run(ref, MEGATRON_1F1B)
    out = _pretrain(schedule=schedule, extra=list(flags))
    _check_run(out, f"ScheduleFunction({schedule!r})")
    assert [len(layers) for _, layers in out["stages"].values()] == decoders
    assert out["stages"] == ref["stages"]
    planned = stage_layers(parse_pretrain_args(pretrain_argv(pp=2, dp=2, extra=flags)), 2, 1)
    assert [stage.decoder for stage in planned] == decoders
    assert out["lm loss"] == ref["lm loss"]
    assert out["grad_norm"] == ref["grad_norm"]


# ------------------------------------------------------------------ V layouts (issue 22)


def test_per_token_loss_divides_v_layout_gradients_by_the_token_count(megatron_1f1b):
    """--calculate-per-token-loss: the token count lives on rank 0 (the loss rank) and must
    reach finalize_model_grads, which reads it from the last pipeline rank. Every token counts
    (no loss mask), so the per-token gradient equals the per-microbatch mean's: the same grad
    norm as Megatron's 1F1B and as zb-v without the flag (it was 128x: 4 microbatches x 16
    tokens x 2 replicas, undivided)."""
    out = _pretrain(schedule="zb-v", vp=2, extra=[PER_TOKEN])
    _check_run(out, "ScheduleFunction('zb-v')")
    assert_v_trains_as(out, megatron_1f1b)
    assert_v_trains_as(out, _pretrain(schedule="zb-v", vp=2))


def test_tied_embeddings_under_v_layouts_train_as_megatrons_1f1b():
    """No --untie-embeddings-and-output-weights: the V layout holds the embedding and the
    output layer on rank 0, one copy each (the output layer's starts as the embedding), their
    gradients summed there; Megatron's 1F1B all-reduces them between ranks 0 and p-1. dualpipev
    also with --calculate-per-token-loss."""
    ref = _pretrain(tied=True)
    _check_run(ref, MEGATRON_1F1B)
    assert ref["lm loss"] != _pretrain()["lm loss"]  # tying changes the model
    for schedule, extra in (("zb-v", ()), ("dualpipev", (PER_TOKEN,))):
        out = _pretrain(schedule=schedule, vp=2, tied=True, extra=extra)
        _check_run(out, f"ScheduleFunction({schedule!r})")
        assert_v_trains_as(out, ref)
        # the same parameters as Megatron's 1F1B, stage by stage (its output layer's copy on
        # the last stage included)
        assert sum(n for n, _ in out["stages"].values()) == sum(
            n for n, _ in ref["stages"].values())


# ------------------------------------------------------------------ dualpipe (issue 41)


def _assert_dualpipe_built_1f1b_twice(out, ref, replicas: int):
    """Each rank's chunk 0 is 1F1B's chunk of that rank, its chunk 1 a copy of part p-1-r
    (stage p + k holds part k); after the last step every part's copies are equal, on every
    data-parallel replica."""
    p = len(ref["stages"])
    assert sorted(out["stages"]) == list(range(2 * p))
    for part in range(p):
        assert out["stages"][part] == ref["stages"][part]
        assert out["stages"][p + part] == ref["stages"][part]
    assert sorted(out["part_digests"]) == list(range(p))
    assert_dualpipe_copies_equal(out["part_digests"], replicas)


def test_dualpipe_trains_as_megatrons_1f1b(megatron_1f1b):
    """--pipeline-schedule dualpipe (the bidirectional DualPipe) through Megatron-LM's loop,
    with --bf16 --use-distributed-optimizer --overlap-grad-reduce --clip-grad 1.0 and data
    parallelism 2: each part's two copies start as 1F1B's stage (seeded as its rank), their
    gradients are summed after finalize_model_grads and the copies are left out of the grad
    norm, so losses and grad norms follow Megatron's 1F1B (the first step within fp32; measured
    here: bit-identical, as the bf16 gradients of 4 microbatches sum exactly in fp32). Without
    the pair sum the first grad norm was 1.385 against 2.782, and the copies drifted apart."""
    out = _pretrain(schedule="dualpipe", vp=2)
    _check_run(out, "ScheduleFunction('dualpipe')")
    assert_v_trains_as(out, megatron_1f1b)
    assert out["lm loss"][0] == megatron_1f1b["lm loss"][0]
    _assert_dualpipe_built_1f1b_twice(out, megatron_1f1b, replicas=2)


def test_dualpipe_with_tied_embeddings_and_per_token_loss():
    """Tied embeddings: ranks 0 and p-1 each hold the embedding and the output layer's copy
    (summed on the rank, then across the pair); --calculate-per-token-loss: the token count
    is the sum of both loss ranks' (each counts its direction's microbatches)."""
    ref = _pretrain(tied=True)
    out = _pretrain(schedule="dualpipe", vp=2, tied=True, extra=[PER_TOKEN])
    _check_run(out, "ScheduleFunction('dualpipe')")
    assert_v_trains_as(out, ref)
    _assert_dualpipe_built_1f1b_twice(out, ref, replicas=2)


# (string, schedule, the same model as Megatron's 1F1B with this string: stages merged pairwise)
LAYOUTS = [
    ("Ettt|tt|tt|tL", "zb-v", "Ettttt|tttL"),
    ("E|tttt|tttt|L", "zb-v", None),  # embedding alone and loss alone: both on rank 0
    ("Et|ttt|ttt|tL", "dualpipev", None),
]


@pytest.mark.parametrize("layout,schedule,merged", LAYOUTS, ids=[row[0] for row in LAYOUTS])
def test_layout_strings_under_v_layouts_give_each_stage_the_strings_layers(
        layout, schedule, merged):
    """V stage s holds the string's stage s (rank r: stages r and 2p-1-r), with Megatron's
    parameter count and layer numbers for it; it trains as Megatron's 1F1B over the string's
    stages merged pairwise (rank q: stages 2q and 2q+1), which for the last two strings is
    Megatron's even split (no string)."""
    out = _pretrain(schedule=schedule, extra=[LAYOUT, layout])
    _check_run(out, f"ScheduleFunction({schedule!r})")
    ref = _pretrain(extra=[LAYOUT, merged] if merged else [])
    _check_run(ref, MEGATRON_1F1B)
    _assert_v_stages_hold(out, ref, layout)


def _assert_v_stages_hold(out, ref, layout):
    """V stage s of ``out`` holds the layout string's stage s (its decoder layers by global
    number), ``ref`` (Megatron's 1F1B, rank q) holds V stages 2q and 2q+1 together, parameter
    for parameter, and ``out`` trains as ``ref``."""
    from megatron.core.transformer.pipeline_parallel_layer_layout import (
        PipelineParallelLayerLayout,
    )

    stages = ["".join(kind.name[0] for kind in stage)  # Megatron's own reading of the string
              for stage in PipelineParallelLayerLayout.parse_str_to_list(layout)]
    assert [layers for _, layers in out["stages"].values()] == [
        [1 + sum(s.count("d") for s in stages[:i]) + k for k in range(stage.count("d"))]
        for i, stage in enumerate(stages)]
    for q, (params, layers) in ref["stages"].items():  # 1F1B's rank q = V stages 2q, 2q+1
        pair = [out["stages"][2 * q], out["stages"][2 * q + 1]]
        assert layers == pair[0][1] + pair[1][1]
        assert params == pair[0][0] + pair[1][0]
    assert_v_trains_as(out, ref)


# (schedule, Megatron's split flags, the layout string the V layout builds, 1F1B's flags for
# the same model: V stages merged pairwise)
V_SPLITS = [
    ("zb-v", ["--num-layers", "6", *ACCOUNT], "Et|tt|tt|tL", ["--num-layers", "6", *ACCOUNT]),
    ("dualpipev", ["--decoder-first-pipeline-num-layers", "1",
                   "--decoder-last-pipeline-num-layers", "3"], "Et|tt|tt|t*3L", list(FIRST_LAST)),
]


@pytest.mark.parametrize("schedule,flags,layout,merged", V_SPLITS,
                         ids=[row[0] for row in V_SPLITS])
def test_megatrons_split_flags_under_v_layouts_place_the_first_and_last_stage(
        schedule, flags, layout, merged):
    """--account-for-embedding/loss-in-pipeline-split and --decoder-first/last-pipeline-num-
    layers under a V schedule apply to V stage 0 and 2p-1 (both on rank 0): the drop-in builds
    the equivalent layout string (the one ``plan`` shows) and trains as Megatron's 1F1B over
    the same model (the account-for flags themselves, for the first split)."""
    from megatron_pp_ext.planner.pretrain_plan import plan_pretrain

    argv = pretrain_argv(pp=2, dp=2, extra=["--num-virtual-stages-per-pipeline-rank", "2",
                                            *flags])
    planned = plan_pretrain(argv, schedule=schedule, world_size=4)
    assert planned.to_dict()["pipeline_model_parallel_layout"] == layout
    assert any(f"the drop-in builds --pipeline-model-parallel-layout '{layout}'" in note
               for note in planned.notes)
    out = _pretrain(schedule=schedule, vp=2, extra=flags)
    _check_run(out, f"ScheduleFunction({schedule!r})")
    ref = _pretrain(extra=merged)
    _check_run(ref, MEGATRON_1F1B)
    _assert_v_stages_hold(out, ref, layout)


# ------------------------------------------------------------------ multi-token prediction (issue 41)

ROPE = ("--position-embedding-type", "rope")  # Megatron's MTP takes rope (or none)
MTP_SCHEDULES = [("1f1b", None), ("zb-h1", None), ("zb-h2", None), ("zb-v", 2),
                 ("dualpipev", 2), ("v-half", 2), ("dualpipe", 2)]


def _pretrain_mtp(depth, schedule=None, vp=None):
    """pp 2 without data parallelism (one rank holds the MTP layers: its metrics tracker is
    the step's MTP loss), --mtp-num-layers ``depth``, and --clip-grad 0: the V layouts sum
    the grad norm's per-rank parts in another order (its last bit differs), which under
    clipping tips every update by ~1e-7 and lets bf16 roundings diverge from step 3 on
    (measured with MTP: 4e-3 in the step-5 grad norm, more than without it); unclipped,
    equal gradients give bit-identical losses at every step."""
    key = ("mtp", depth, schedule)
    if key not in _RUNS:
        argv = pretrain_argv(pp=2, dp=1, schedule=schedule, vp=vp, iters=ITERS,
                             extra=[*ROPE, "--mtp-num-layers", str(depth), "--clip-grad", "0"])
        _RUNS[key] = merge_history(run_pretrain_shared(2, argv, TIMEOUT))
    return _RUNS[key]


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("schedule,vp", MTP_SCHEDULES, ids=[row[0] for row in MTP_SCHEDULES])
def test_mtp_trains_as_megatrons_1f1b(schedule, vp, depth):
    """--mtp-num-layers under every kind of schedule against Megatron's 1F1B: the loop
    schedules bit-identical (lm loss, MTP loss per depth, grad norm), deferred W included
    (the output layer serves the main logits and each depth's: one W delivers their sum, as
    autograd does); the V layouts with the MTP block on the last stage (rank 0), its
    embedding copy starting as the first stage's and its gradient summed with it there, the
    final layer norm on the stage of the last decoder layer, and every other weight as 1F1B
    draws it: the same gradients, so the same losses at every step, and grad norms that sum
    the same squares in another order (fp32). Before issue 41 the V layouts' first grad norm
    was 14% low (the copy started at zero, the final norm sat on the wrong stage) and
    zb-h1's differed in its last bits."""
    ref = _pretrain_mtp(depth)
    _check_run(ref, MEGATRON_1F1B)
    assert ref["mtp loss"] is not None and len(ref["mtp loss"]) == ITERS
    assert all(len(step) == depth and all(x > 0 for x in step) for step in ref["mtp loss"])
    out = _pretrain_mtp(depth, schedule, vp)
    _check_run(out, f"ScheduleFunction({schedule!r})")
    if vp is None:
        assert out["lm loss"] == ref["lm loss"]
        assert out["mtp loss"] == ref["mtp loss"]
        assert out["grad_norm"] == ref["grad_norm"]
        return
    if schedule == "dualpipe":
        # the MTP block on both loss ranks (part p-1 and its copy), each tracking its
        # direction's microbatches; the step's sum reaches the last rank's log
        assert out["lm loss"] == ref["lm loss"]
        assert out["grad_norm"] == pytest.approx(ref["grad_norm"], rel=FIRST_STEP_RTOL)
        for got, want in zip(out["mtp loss"], ref["mtp loss"]):
            assert got == pytest.approx(want, rel=FIRST_STEP_RTOL)
        _assert_dualpipe_built_1f1b_twice(out, ref, replicas=1)
        return
    assert out["lm loss"] == ref["lm loss"]
    assert out["mtp loss"] == ref["mtp loss"]
    assert out["grad_norm"] == pytest.approx(ref["grad_norm"], rel=FIRST_STEP_RTOL)
    # 1F1B's rank q holds V stages 2q and 2q+1 (the MTP block, the embedding's copy and the
    # final norm with the last decoder layers); the two middle stages hold two plain layers each
    assert [out["stages"][s][1] for s in range(4)] == [[1, 2], [3, 4], [5, 6], [7, 8]]
    for q, (params, layers) in ref["stages"].items():
        assert params == out["stages"][2 * q][0] + out["stages"][2 * q + 1][0]
    assert out["stages"][1][0] == out["stages"][2][0]


# ------------------------------------------------------------------ V layout plumbing (pure)


def test_v_layout_plumbing_from_arguments():
    from argparse import Namespace

    from megatron_pp_ext.integration import megatron_args

    assert [[megatron_args.v_chunk_stage(r, 4, c) for c in (0, 1)] for r in range(4)] == [
        [0, 7], [1, 6], [2, 5], [3, 4]
    ]
    args = Namespace(pipeline_schedule="zb-v", pipeline_model_parallel_size=2,
                     virtual_pipeline_model_parallel_size=2,
                     untie_embeddings_and_output_weights=False)  # tied: both copies on rank 0
    assert megatron_args.schedule_options_from_args(args)["schedule"] == "zb-v"

    def provider(**kwargs):
        return kwargs

    assert megatron_args.uses_v_layout(args)
    assert megatron_args.model_provider_for_args(provider, args).v_layout
    for name in ("1f1b", "interleaved", "auto", None):
        args.pipeline_schedule = name
        assert not megatron_args.uses_v_layout(args)
        assert megatron_args.model_provider_for_args(provider, args) is provider
