"""Megatron-LM's real training loop, ``megatron.training.pretrain`` from the installed wheel, on
the CPU (gloo, 4 processes: data parallel 2 beside pipeline parallel 2), 5 iterations, with the
flags people train with (--bf16 --use-distributed-optimizer --clip-grad 1.0
--overlap-grad-reduce): Megatron's own schedule against every ``--pipeline-schedule``.

One launch per schedule (``support.megatron_loop.run_pretrain``: our GPT model provider, a
MockGPTDataset provider, the CPU patches the loop needs). Every run starts from the same
weights (each parameter filled from its global name), so all layouts can be compared:

* bit-identical losses and grad norms where the order of arithmetic is Megatron's: 1f1b,
  gpipe, zb-h1, zb-h2 and auto (whichever of those auto picks) against Megatron's 1F1B;
  interleaved against Megatron's interleaved schedule;
* equal within fp32 (rtol 1e-5) where it is not: zb-v and dualpipev (the V layout places the
  stages differently, so the grad norm sums its per-rank parts in another order) against
  Megatron's 1F1B.

Every schedule runs with all four flags; the split-backward schedules with
--overlap-grad-reduce over 5 iterations are what caught the grad-sync point of one chunk
(docs/megatron-lm.md, "The real loop in CI").
"""

import math

import pytest

from megatron_pp_ext.train.processes import spawn
from support.megatron_loop import merge_history, pretrain_argv, run_pretrain

ITERS = 5  # the fewest the issue allows
TIMEOUT = 300  # a hang fails the test; nothing is timed
OVERLAP = "--overlap-grad-reduce"
FP32_RTOL = 1e-5

MEGATRON_1F1B = "forward_backward_pipelining_without_interleaving"
MEGATRON_INTERLEAVED = "forward_backward_pipelining_with_interleaving"


def _pretrain(schedule=None, vp=None, overlap=True):
    argv = pretrain_argv(pp=2, dp=2, schedule=schedule, vp=vp, iters=ITERS)
    if not overlap:
        argv.remove(OVERLAP)
    return merge_history(spawn(4, run_pretrain, argv, timeout_s=TIMEOUT))


@pytest.fixture(scope="module")
def megatron_1f1b():
    return _pretrain()


@pytest.fixture(scope="module")
def megatron_interleaved():
    return _pretrain(vp=2)


def _check_run(history, schedule_name):
    assert history["schedule"] == schedule_name
    assert len(history["lm loss"]) == ITERS and len(history["grad_norm"]) == ITERS
    assert history["skipped"] == [0] * ITERS
    assert all(math.isfinite(x) for x in history["lm loss"] + history["grad_norm"])


def test_megatron_own_schedules_train(megatron_1f1b, megatron_interleaved):
    _check_run(megatron_1f1b, MEGATRON_1F1B)
    _check_run(megatron_interleaved, MEGATRON_INTERLEAVED)
    # the loss moves, and --clip-grad 1.0 had something to clip
    assert megatron_1f1b["lm loss"][-1] != megatron_1f1b["lm loss"][0]
    assert max(megatron_1f1b["grad_norm"]) > 1.0
    # the same model and data: the two layouts agree within fp32
    assert megatron_interleaved["lm loss"] == pytest.approx(megatron_1f1b["lm loss"], rel=FP32_RTOL)
    assert megatron_interleaved["grad_norm"] == pytest.approx(
        megatron_1f1b["grad_norm"], rel=FP32_RTOL)


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
]


@pytest.mark.parametrize(
    "schedule,vp,overlap,reference,exact", CASES, ids=[case[0] for case in CASES])
def test_pipeline_schedule_flag_matches_megatron(
    request, schedule, vp, overlap, reference, exact
):
    ref = request.getfixturevalue(f"megatron_{reference}")
    out = _pretrain(schedule=schedule, vp=vp, overlap=overlap)
    _check_run(out, f"ScheduleFunction({schedule!r})")
    if exact:
        assert out["lm loss"] == ref["lm loss"]
        assert out["grad_norm"] == ref["grad_norm"]
    else:
        assert out["lm loss"] == pytest.approx(ref["lm loss"], rel=FP32_RTOL)
        assert out["grad_norm"] == pytest.approx(ref["grad_norm"], rel=FP32_RTOL)


# ------------------------------------------------------------------ V layout plumbing (pure)


def test_v_layout_plumbing_from_arguments():
    from argparse import Namespace

    from megatron_pp_ext.integration import megatron_args

    assert [[megatron_args.v_chunk_stage(r, 4, c) for c in (0, 1)] for r in range(4)] == [
        [0, 7], [1, 6], [2, 5], [3, 4]
    ]
    args = Namespace(pipeline_schedule="zb-v", pipeline_model_parallel_size=2,
                     virtual_pipeline_model_parallel_size=2,
                     untie_embeddings_and_output_weights=False)
    with pytest.raises(ValueError, match="--untie-embeddings-and-output-weights"):
        megatron_args.schedule_options_from_args(args)
    args.untie_embeddings_and_output_weights = True
    assert megatron_args.schedule_options_from_args(args)["schedule"] == "zb-v"

    def provider(**kwargs):
        return kwargs

    assert megatron_args.uses_v_layout(args)
    assert megatron_args.model_provider_for_args(provider, args).v_layout
    for name in ("1f1b", "interleaved", "auto", None):
        args.pipeline_schedule = name
        assert not megatron_args.uses_v_layout(args)
        assert megatron_args.model_provider_for_args(provider, args) is provider
