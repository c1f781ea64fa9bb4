"""W holds the weight gradients of the layers people train with (issue 13, part 1).

Multi-process gloo on the CPU with the tiny Megatron-Core GPT: tensor parallel 2 x pipeline
parallel 2 with and without sequence parallelism, gradient-accumulation fusion (Megatron's
own schedule needs apex's CUDA kernel for it: a CPU stand-in with the kernel's arithmetic,
``support.wgrad_runs.fused_kernel_standin``), and Transformer Engine linears through a CPU
stand-in that follows TE's documented deferral API (``support.te_standin``; TE is GPU-only,
so this path is unverified on a GPU). Every split run is compared with 1F1B (full
backwards) on the same model and data, and its per-rank ``StepResult.weight_grads`` say that
W ran the weight GEMMs."""

import pytest
import torch

from megatron_pp_ext.integration.forward_backward import ScheduleFunction
from megatron_pp_ext.train.processes import spawn
from support.te_standin import old_te_layer_spec, te_layer_spec
from support.wgrad_runs import fused_w_unit, merge, plain_layer_spec, tp_step, tp_steps

pytestmark = pytest.mark.megatron_cpu
FP32 = dict(rtol=1e-5, atol=1e-6)  # "within fp32 rounding"
M = 8  # microbatches
LINEARS_PER_STAGE = 4 * 4  # QKV, projection, FC1, FC2 in each of a stage's 4 layers


def side_by_side(world_size, *runs):
    per_rank = spawn(world_size, tp_steps, list(runs), timeout_s=240)
    return [merge([ranks[i] for ranks in per_rank]) for i in range(len(runs))]


def assert_same_grads(got, want):
    assert sorted(got["grads"]) == sorted(want["grads"]) and len(want["grads"]) > 50
    for name, grad in want["grads"].items():
        torch.testing.assert_close(got["grads"][name], grad, **FP32, msg=name)
    assert got["losses"] == pytest.approx(want["losses"], rel=1e-5) and len(want["losses"]) == M


def expected_w_gemms(pp_rank, pp=2):
    """Weight GEMMs a rank's W's run in one step: every linear of its stage, for every
    microbatch, and the output layer on the last stage."""
    return M * (LINEARS_PER_STAGE + (1 if pp_rank == pp - 1 else 0))


def assert_w_ran_every_gemm(run):
    for pp_rank, stats in zip(run["pp_ranks"], run["weight_grads"]):
        assert stats["deferred"] == stats["in_w"] == expected_w_gemms(pp_rank), stats
        assert stats["kept_in_i"] == 0 and stats["w_seconds"] > 0, stats


def test_tp2_pp2_sequence_parallel_linears_defer_to_w():
    """zb-h1 at tp=2 x pp=2 equals Megatron's 1F1B with and without --sequence-parallel, and
    W runs the same number of weight GEMMs either way (the column-parallel ones included)."""
    zb = ScheduleFunction("zb-h1")
    plain_1f1b, plain_zb, sp_1f1b, sp_zb = side_by_side(
        4, dict(schedule="1f1b", sp=False), dict(schedule=zb, sp=False),
        dict(schedule="1f1b", sp=True), dict(schedule=zb, sp=True))
    assert_same_grads(plain_zb, plain_1f1b)
    assert_same_grads(sp_zb, sp_1f1b)
    assert_w_ran_every_gemm(plain_zb)
    assert_w_ran_every_gemm(sp_zb)
    for pp_rank, plain, sp in zip(sp_zb["pp_ranks"], plain_zb["weight_grads"],
                                  sp_zb["weight_grads"]):
        assert sp["in_w"] == plain["in_w"]
        assert "linear+sp" not in plain["by_kind"]
        # QKV and FC1 of each layer (and the output layer) gather their input in W
        assert sp["by_kind"]["linear+sp"] == M * (2 * 4 + (1 if pp_rank == 1 else 0))


def test_v_schedules_under_sequence_parallelism_match_1f1b():
    """zb-v and dualpipev (V layout) at tp=2 x pp=2 with sequence parallelism: the same
    gradients, by global parameter name, as 1F1B on Megatron's layout."""
    reference, zb_v, dualpipev = side_by_side(
        4, dict(schedule="1f1b", sp=True),
        dict(schedule=ScheduleFunction("zb-v"), sp=True, layout="v"),
        dict(schedule=ScheduleFunction("dualpipev"), sp=True, layout="v"))
    assert_same_grads(zb_v, reference)
    assert_same_grads(dualpipev, reference)
    # zb-v has no full B: W runs every weight GEMM. A rank holds two stages of two layers
    # each (as many linears as one loop stage); in the V layout rank 0 holds the last stage.
    for pp_rank, stats in zip(zb_v["pp_ranks"], zb_v["weight_grads"]):
        assert stats["deferred"] == stats["in_w"] == M * (
            LINEARS_PER_STAGE + (1 if pp_rank == 0 else 0))
        assert stats["by_kind"]["linear+sp"] == M * (2 * 4 + (1 if pp_rank == 0 else 0))
    for stats in dualpipev["weight_grads"]:
        assert stats["deferred"] == stats["in_w"] > 0


def test_gradient_accumulation_fusion_accumulates_into_main_grad_in_w():
    """tp=2 x pp=2, sequence parallel, gradient-accumulation fusion and overlap_grad_reduce
    (Megatron DDP's grad-ready hooks assert a gradient): zb-h1 equals Megatron's 1F1B."""
    reference, zb = side_by_side(
        4, dict(schedule="1f1b", sp=True, fused=True, overlap=True),
        dict(schedule=ScheduleFunction("zb-h1"), sp=True, fused=True, overlap=True))
    assert_same_grads(zb, reference)
    assert_w_ran_every_gemm(zb)
    for stats in zb["weight_grads"]:
        assert set(stats["by_kind"]) == {"linear+fused", "linear+sp+fused"}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_w_is_one_gemm_into_main_grad_without_weight_sized_temporaries(dtype):
    """One Megatron linear with gradient-accumulation fusion, microbatch by microbatch: I
    leaves main_grad alone; each W is one GEMM accumulating in place into the fp32 main_grad
    (bf16 operands upcast: activation-sized copies only), allocates nothing of the weight's
    size, leaves no gradient on the weight, and the sum equals the fp32 accumulation of
    Megatron's kernel (its own backward, with the CPU stand-in of the kernel)."""
    result = spawn(1, fused_w_unit, dtype, timeout_s=120)[0]
    numel = result["weight_numel"]
    assert not result["after_i"][0].any()
    for mb in range(1, len(result["after_i"])):
        assert torch.equal(result["after_i"][mb], result["after_w"][mb - 1])  # I added nothing
    for ops in result["w_ops"]:
        gemms = [op for op in ops if op[0] in ("mm", "addmm", "addmm_", "matmul", "bmm")]
        assert gemms == [("addmm_", numel, True)], ops  # in place, into main_grad
        fresh = [op for op in ops if not op[2]]
        assert all(size < numel for _, size, _ in fresh), ops
        if dtype == "float32":
            assert not fresh, ops
    assert result["grads_after_w"] == [False] * len(result["w_ops"])
    torch.testing.assert_close(result["after_w"][-1], result["expected"], rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(result["after_w"][-1], result["megatron"], rtol=1e-6, atol=1e-5)
    assert result["stats"]["in_w"] == len(result["w_ops"])


def test_transformer_engine_linears_defer_through_te_backward_dw():
    """TE stand-in linears (Megatron's wrapper, built without delay_wgrad_compute as Megatron
    builds a dense model): the plugin switches TE's deferral on for the split step only, W
    runs TE's backward_dw (past Megatron's config gate), with and without fusion and
    overlap_grad_reduce; the gradients equal 1F1B's; afterwards every TE store is the
    module's own (not delaying) again."""
    zb = ScheduleFunction("zb-h1")
    runs = side_by_side(
        2, dict(schedule="1f1b", pp=2, tp=1, layer_spec_fn=te_layer_spec),
        dict(schedule=zb, pp=2, tp=1, layer_spec_fn=te_layer_spec),
        dict(schedule="1f1b", pp=2, tp=1, layer_spec_fn=te_layer_spec, fused=True,
             overlap=True),
        dict(schedule=zb, pp=2, tp=1, layer_spec_fn=te_layer_spec, fused=True, overlap=True),
        dict(schedule=ScheduleFunction("dualpipev"), pp=2, tp=1, layout="v",
             layer_spec_fn=te_layer_spec))
    reference, split, fused_reference, fused_split, dualpipev = runs
    assert_same_grads(split, reference)
    assert_same_grads(fused_split, fused_reference)
    assert_same_grads(dualpipev, reference)
    for run in (split, fused_split):
        assert_w_ran_every_gemm(run)
        for pp_rank, stats in zip(run["pp_ranks"], run["weight_grads"]):
            assert stats["by_kind"]["te"] == M * LINEARS_PER_STAGE
    # DualPipeV's full B's compute TE's wgrads at once (counted apart), its I's defer them
    assert all(s["in_b"] > 0 and s["by_kind"]["te"] > 0 for s in dualpipev["weight_grads"])
    assert not any(w for run in runs for w in run["warnings"])


def test_te_delaying_stores_are_put_back_after_the_step():
    per_rank = spawn(2, tp_steps, [
        dict(schedule=ScheduleFunction("zb-h1"), pp=2, tp=1, layer_spec_fn=te_layer_spec),
        dict(schedule="1f1b", pp=2, tp=1, layer_spec_fn=te_layer_spec)], timeout_s=120)
    assert [r["te_stores_delaying_after"] for ranks in per_rank for r in ranks] == [0] * 4


def test_a_schedule_whose_w_would_be_empty_warns_once_naming_the_layers():
    """Plain torch Linear subclasses in every layer: W holds nothing on the first stage and
    only the output layer on the last. One warning per process (two steps here) names them
    and says what the schedule loses; the gradients are still right."""
    zb = ScheduleFunction("zb-h1")
    per_rank = spawn(2, tp_steps, [
        dict(schedule=zb, pp=2, tp=1, layer_spec_fn=plain_layer_spec),
        dict(schedule=zb, pp=2, tp=1, layer_spec_fn=plain_layer_spec),
        dict(schedule="1f1b", pp=2, tp=1, layer_spec_fn=plain_layer_spec)], timeout_s=120)
    first, second, reference = (merge([ranks[i] for ranks in per_rank]) for i in range(3))
    assert_same_grads(first, reference)
    assert second["warnings"] == []  # once per process
    by_rank = {r["pp_rank"]: r["warnings"] for r in (ranks[0] for ranks in per_rank)}
    assert [len(w) for w in by_rank.values()] == [1, 1]
    first_stage, last_stage = by_rank[0][0], by_rank[1][0]
    for text in (first_stage, last_stage):
        assert "16 layers of support.wgrad_runs.PlainLinear" in text
        assert "decoder.layers.0.self_attention.linear_qkv" in text
        assert "computed in I (full backward), not in W" in text
    assert "W is empty on this rank" in first_stage and "use 1f1b" in first_stage
    assert "W holds only" in last_stage and "loses most of its bubble gain" in last_stage
    assert first["weight_grads"][0]["in_w"] == 0


def test_te_modules_that_cannot_defer_are_named():
    """TE before 2.3 (no WeightGradStore): nothing to switch on; the warning says why."""
    ranks = spawn(2, tp_step, ScheduleFunction("zb-h1"), pp=2, tp=1,
                  layer_spec_fn=old_te_layer_spec, timeout_s=120)
    text = next(r for r in ranks if r["pp_rank"] == 0)["warnings"]
    assert len(text) == 1
    assert "OldTELinear: no WeightGradStore (Transformer Engine < 2.3)" in text[0]
    assert "W is empty on this rank" in text[0]


def test_the_warning_share_reads_100_percent_only_when_nothing_is_left_out():
    """A MoE rank: the experts' and attention's weights defer, the router's few do not; the
    warning must not say W holds 100% next to a layer it cannot defer."""
    from megatron_pp_ext.runtime.wgrad import weight_share_text

    assert weight_share_text(1_000_000, 1_000_000) == "100%"
    assert weight_share_text(999_872, 1_000_000) == "99.98%"  # 128 router weights left out
    assert weight_share_text(750, 1_000) == "75%"
    assert weight_share_text(1, 1_000_000) == "0.01%"
    assert weight_share_text(0, 1_000) == "0%"
