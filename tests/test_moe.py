"""Mixture-of-experts GPT through Megatron-LM's real loop on the CPU (issue 26, item 3 without
the overlap): Megatron's MoE layers (``--num-experts 4 --moe-router-topk 2
--expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall``, SequentialMLP experts,
--bf16), pp=2 x ep=2 on 4 gloo processes (the expert groups are the two data-parallel replicas
of each pipeline stage), 3 iterations, with the flags of tests/test_pretrain_loop.py.

* 1f1b and zb-h1 train as Megatron's own 1F1B, bit for bit, and zb-h1's W runs the weight
  GEMMs of every expert, as it does the dense layers' (counted);
* zb-v and dualpipev (the V layout) train as Megatron's 1F1B within the V layout's tolerance
  (support.megatron_loop.assert_v_trains_as);
* the expert groups' all-to-alls are agreed before the first step: data-parallel replicas
  run with different schedules are refused on every rank, naming the first all-to-all where
  two ranks of an expert group part (issue 26, item 2);
* DeepSeek-V3's shape (a shared expert, MTP, the embedding and the MTP layer with the loss
  on their own stages) under dualpipev and zb-v with the overlap flag (issue 41, item 3).

The CPU patches the MoE dispatcher needs (its device-to-host event, its split sizes as host
arrays) are in support.megatron_loop, each with its reason.
"""

import pytest

from megatron_pp_ext.analysis.collectives import issued, moe_collectives, with_collectives
from megatron_pp_ext.analysis.lowering import lower, runtime_program
from megatron_pp_ext.program import Compute
from megatron_pp_ext.schedules import build_schedule
from megatron_pp_ext.train.processes import SpawnError, spawn
from support.megatron_loop import (
    NUM_LAYERS,
    assert_dualpipe_copies_equal,
    assert_v_trains_as,
    merge_history,
    pretrain_argv,
    run_pretrain,
    run_pretrain_of_rank,
)

pytestmark = pytest.mark.megatron_cpu
ITERS = 3
M = 4  # microbatches per step
TIMEOUT = 300  # a hang fails the test; nothing is timed
EXPERTS, EP = 4, 2
MOE = ["--num-experts", str(EXPERTS), "--moe-router-topk", "2",
       "--expert-model-parallel-size", str(EP), "--moe-token-dispatcher-type", "alltoall"]
LAYERS_PER_STAGE = 4  # 8 layers over pp=2
MEGATRON_1F1B = "forward_backward_pipelining_without_interleaving"
MEGATRON_INTERLEAVED = "forward_backward_pipelining_with_interleaving"
OVERLAP = "--overlap-moe-expert-parallel-comm"

_RUNS: dict = {}


def _pretrain(schedule=None, vp=None, overlap=False):
    """Every rank's history (one launch per configuration, shared by this module's tests)."""
    key = (schedule, vp, overlap)
    if key not in _RUNS:
        argv = pretrain_argv(pp=2, dp=2, schedule=schedule, vp=vp, iters=ITERS,
                             num_microbatches=M, extra=MOE + ([OVERLAP] if overlap else []))
        _RUNS[key] = spawn(4, run_pretrain, argv, timeout_s=TIMEOUT)
    return _RUNS[key]


@pytest.fixture(scope="module")
def megatron_1f1b():
    out = merge_history(_pretrain())
    assert out["schedule"] == MEGATRON_1F1B
    assert out["skipped"] == [0] * ITERS and out["lm loss"][-1] != out["lm loss"][0]
    return out


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_loop_schedules_train_the_moe_gpt_as_megatrons_1f1b(megatron_1f1b, schedule):
    out = merge_history(_pretrain(schedule))
    assert out["schedule"] == f"ScheduleFunction({schedule!r})"
    assert out["lm loss"] == megatron_1f1b["lm loss"]
    assert out["grad_norm"] == megatron_1f1b["grad_norm"]


def test_zb_h1_defers_every_experts_weight_gradient_to_w():
    """Per microbatch and layer, W runs the attention's two weight GEMMs (QKV, projection) and
    FC1 and FC2 of each of the EXPERTS / EP experts on this rank (SequentialMLP: Megatron
    linears), and the output layer's on the last stage; nothing runs whole in I."""
    local_experts = EXPERTS // EP
    per_layer = 2 + 2 * local_experts
    for history in _pretrain("zb-h1"):
        last_stage = history["rank"] in (2, 3)  # Megatron's order: pipeline ranks {0,2},{1,3}
        expected = M * (LAYERS_PER_STAGE * per_layer + (1 if last_stage else 0))
        for stats in history["weight_grads"]:
            assert stats["deferred"] == stats["in_w"] == expected, (history["rank"], stats)
            assert stats["kept_in_i"] == 0 and stats["by_kind"] == {"linear": expected}


@pytest.mark.parametrize("schedule", ["zb-v", "dualpipev"])
def test_v_schedules_train_the_moe_gpt_as_megatrons_1f1b(megatron_1f1b, schedule):
    out = merge_history(_pretrain(schedule, vp=2))
    assert out["schedule"] == f"ScheduleFunction({schedule!r})"
    assert_v_trains_as(out, megatron_1f1b)


@pytest.mark.parametrize("schedule, vp", [("1f1b", None), ("zb-h1", None), ("zb-v", 2),
                                          ("dualpipev", 2)])
def test_each_rank_issues_the_all_to_alls_its_program_records(schedule, vp):
    """The all_to_all_single calls each rank makes in a step (counted in the run) are those
    the lowered program records for its actions (analysis.collectives: 3 per MoE layer each
    way, none in W): 96 on every rank here (4 microbatches x 4 layers x (3 + 3))."""
    built = build_schedule(schedule, 2, M, chunks=vp)
    layers = {stage: NUM_LAYERS // built.num_stages for stage in range(built.num_stages)}
    per_action = moe_collectives(layers)
    for history in _pretrain(schedule, vp):
        pp_rank = history["rank"] // 2  # Megatron's order: pipelines {0, 2} and {1, 3}
        recorded = issued(with_collectives(lower(built), per_action), pp_rank)
        assert history["all_to_all"] == [len(recorded)] * ITERS == [96] * ITERS


def test_replicas_with_different_schedules_are_refused_before_any_p2p():
    """Replica A (pipeline ranks 0 and 2) runs 1f1b, replica B (1 and 3) gpipe: each replica's
    pipeline ranks agree among themselves, but the two ranks of each expert group would issue
    their all-to-alls in different orders (1F1B's first backward where GPipe runs its next
    forward). Every rank raises the same ValueError at its first step, before the pipeline
    sends anything; without the check the all-to-alls pair up wrongly."""
    argvs = [pretrain_argv(pp=2, dp=2, schedule=schedule, iters=1, num_microbatches=M,
                           extra=MOE) for schedule in ("1f1b", "gpipe", "1f1b", "gpipe")]
    with pytest.raises(SpawnError) as failed:
        spawn(4, run_pretrain_of_rank, argvs, timeout_s=TIMEOUT)
    text = str(failed.value)
    assert "ranks [" in text and "failed too" in text  # every rank, not one
    # stage 0 (ranks 0, 1): 1F1B's warm-up is 1 forward, then 0B0 where GPipe runs 0F2: the
    # 25th all-to-all (2 forwards x 4 MoE layers x 3); stage 1 (ranks 2, 3): 1B0 against 1F1,
    # the 13th. Whichever rank reported first:
    assert ("at collective #25 on that group, rank 0 issues all_to_all on the expert group "
            "(MoE layer 3 combine (gradient)) in action 0B0 and rank 1 issues all_to_all on the "
            "expert group (MoE layer 0 dispatch tokens) in action 0F2 (96 and 96 in a step)"
            in text) or (
            "at collective #13 on that group, rank 2 issues all_to_all on the expert group "
            "(MoE layer 3 combine (gradient)) in action 1B0 and rank 3 issues all_to_all on the "
            "expert group (MoE layer 0 dispatch tokens) in action 1F1 (96 and 96 in a step)"
            in text), text[-3000:]
    assert "run every replica with the same schedule" in text


# ------------------------------------------------ --overlap-moe-expert-parallel-comm (item 1)
# On the CPU nothing runs concurrently (the test support's CPU patches make Megatron's CUDA
# streams and events no-ops: one thread runs the compute and communication nodes in order),
# but the per-layer plan does run: each F&B pair as one combined call, layer by layer. The
# overlap must not change the arithmetic.


def _same_run(out, ref):
    assert out["lm loss"] == ref["lm loss"] and out["grad_norm"] == ref["grad_norm"]


def test_dualpipev_pairs_run_through_megatrons_plan_bit_identical():
    """dualpipev with the flag: every F&B pair of the schedule (4 per step on each rank at
    p=2, m=4) is one call of Megatron's combined_forward_backward_step, the other F's and B's
    go through it alone; losses, grad norms and the W's weight GEMMs are those without it."""
    plain, overlapped = _pretrain("dualpipev", 2), _pretrain("dualpipev", 2, overlap=True)
    _same_run(merge_history(overlapped), merge_history(plain))
    program = runtime_program(build_schedule("dualpipev", 2, M, chunks=2), batched=False,
                              overlapped_pairs=True)
    for with_flag, without in zip(overlapped, plain):
        pp_rank = with_flag["rank"] // 2
        pairs = sum(isinstance(step, Compute) and step.paired for step in program.steps[pp_rank])
        assert with_flag["overlapped_pairs"] == [pairs] * ITERS == [4] * ITERS
        assert without["overlapped_pairs"] == [None] * ITERS
        assert [w["deferred"] for w in with_flag["weight_grads"]] == \
            [w["deferred"] for w in without["weight_grads"]]


def test_interleaved_with_the_flag_is_megatrons_combined_1f1b_bit_for_bit():
    """Megatron's own combined 1F1B (its interleaved schedule with the flag) runs here with
    the CPU patches, and the plugin's interleaved with the flag trains as it does, bit for bit.
    The plugin's interleaved has no F&B pairs: each rank reports 0 (and warns)."""
    megatron = merge_history(_pretrain(vp=2, overlap=True))
    assert megatron["schedule"] == MEGATRON_INTERLEAVED
    ours = _pretrain("interleaved", 2, overlap=True)
    _same_run(merge_history(ours), megatron)
    assert all(h["overlapped_pairs"] == [0] * ITERS for h in ours)


def test_zb_v_with_the_flag_runs_every_f_and_i_through_the_plan_bit_identical():
    """zb-v (no pairs) with the flag: its lone F's and I's through Megatron's combined step,
    the loss applied on rank 0's second chunk (the V layout's last stage, which Megatron's
    parallel state does not know), W's unchanged: the same run as without the flag."""
    plain, overlapped = _pretrain("zb-v", 2), _pretrain("zb-v", 2, overlap=True)
    _same_run(merge_history(overlapped), merge_history(plain))
    for with_flag, without in zip(overlapped, plain):
        assert with_flag["overlapped_pairs"] == [0] * ITERS
        assert with_flag["weight_grads"][0]["deferred"] == without["weight_grads"][0]["deferred"]


def test_dualpipe_trains_the_moe_gpt_as_megatrons_1f1b_with_and_without_the_flag(megatron_1f1b):
    """dualpipe (the bidirectional DualPipe) on the MoE GPT: each rank's two parts (its own
    and a copy of its partner's) with their experts, the copies' gradients summed per expert-
    parallel rank; with --overlap-moe-expert-parallel-comm its F&B pairs (F of one direction,
    B of the other: 2 per step on each rank at p = 2, m = 4) go through Megatron's combined
    step. Both train as Megatron's 1F1B (measured: bit-identical), the copies stay equal."""
    for overlap, pairs in ((False, None), (True, 2)):
        ranks = _pretrain("dualpipe", 2, overlap=overlap)
        out = merge_history(ranks)
        assert out["schedule"] == "ScheduleFunction('dualpipe')"
        assert_v_trains_as(out, megatron_1f1b)
        assert out["lm loss"][0] == megatron_1f1b["lm loss"][0]
        assert all(r["overlapped_pairs"] == [pairs] * ITERS for r in ranks)
        assert_dualpipe_copies_equal(out["part_digests"], replicas=2)


# ------------------------------------------------ DeepSeek-V3's shape (issue 41, item 3)

DEEPSEEK = MOE + ["--moe-shared-expert-intermediate-size", "64", "--disable-bias-linear",
                  "--position-embedding-type", "rope", "--mtp-num-layers", "1",
                  "--clip-grad", "0"]
DEEPSEEK_V_LAYOUT = "E|tttt|tttt|mL"  # the embedding alone, the MTP layer and the loss alone
DEEPSEEK_LOOP_LAYOUT = "Etttt|ttttmL"  # the same stages merged pairwise: 1F1B's two ranks


def _deepseek(schedule=None):
    layout = DEEPSEEK_LOOP_LAYOUT if schedule is None else DEEPSEEK_V_LAYOUT
    extra = DEEPSEEK + ["--pipeline-model-parallel-layout", layout] + (
        [OVERLAP] if schedule else [])
    argv = pretrain_argv(pp=2, dp=2, schedule=schedule, iters=ITERS, num_microbatches=M,
                         extra=extra)
    return spawn(4, run_pretrain, argv, timeout_s=TIMEOUT)


def test_a_deepseek_v3_shaped_model_trains_under_the_v_schedules_as_megatrons_1f1b():
    """DeepSeek-V3's recipe on the tiny GPT: MoE with a shared expert, top-2 routing over 4
    experts, expert parallelism 2, one MTP layer, a layout string with the embedding alone on
    the first stage and the MTP layer with the loss alone on the last, and
    --overlap-moe-expert-parallel-comm. dualpipev (its 4 F&B pairs per step through Megatron's
    combined step) and zb-v train it as Megatron's 1F1B over the stages merged pairwise: the
    same lm and MTP losses at every step (--clip-grad 0: support.megatron_loop, FIRST_STEP_RTOL,
    says why), grad norms summed in another order (fp32). Multi-latent attention is not in it:
    Megatron-Core 0.19.2's local spec (the CPU's; no Transformer Engine) cannot build it
    (``DotProductAttention.__init__() got an unexpected keyword argument 'k_channels'``)."""
    ref = merge_history(_deepseek())
    assert ref["schedule"] == MEGATRON_1F1B and ref["mtp loss"] is not None
    for schedule, pairs in (("dualpipev", 4), ("zb-v", 0)):
        ranks = _deepseek(schedule)
        out = merge_history(ranks)
        assert out["schedule"] == f"ScheduleFunction({schedule!r})"
        assert out["lm loss"] == ref["lm loss"] and out["mtp loss"] == ref["mtp loss"]
        assert out["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-6)
        assert all(r["overlapped_pairs"] == [pairs] * ITERS for r in ranks)


def test_a_deepseek_v3_shaped_model_trains_under_dualpipe_as_megatrons_1f1b():
    """The same recipe under dualpipe, DeepSeek's own schedule, with the flag: its parts are
    1F1B's stages, so the layout string (which places layers per V stage) is left out on both
    sides: 1F1B's even split, the MTP layer with the loss on the last stage (rank p-1, and its
    copy on rank 0). The same losses as Megatron's 1F1B (the MTP loss summed over both loss
    ranks, in another order: fp32), 2 F&B pairs per step on each rank, copies equal."""
    argv = pretrain_argv(pp=2, dp=2, iters=ITERS, num_microbatches=M, extra=DEEPSEEK)
    ref = merge_history(spawn(4, run_pretrain, argv, timeout_s=TIMEOUT))
    argv = pretrain_argv(pp=2, dp=2, schedule="dualpipe", vp=2, iters=ITERS,
                         num_microbatches=M, extra=DEEPSEEK + [OVERLAP])
    ranks = spawn(4, run_pretrain, argv, timeout_s=TIMEOUT)
    out = merge_history(ranks)
    assert out["schedule"] == "ScheduleFunction('dualpipe')"
    assert out["lm loss"] == pytest.approx(ref["lm loss"], rel=1e-6)
    assert out["lm loss"][0] == ref["lm loss"][0]
    for got, want in zip(out["mtp loss"], ref["mtp loss"]):
        assert got == pytest.approx(want, rel=1e-6)
    assert out["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-6)
    assert all(r["overlapped_pairs"] == [2] * ITERS for r in ranks)
    assert_dualpipe_copies_equal(out["part_digests"], replicas=2)
