"""Costs and memory from the model's own dimensions, held to Megatron-LM's own estimators:
the per-stage F, I, W FLOPs add up to ``megatron.training.training.num_floating_point_operations``
(dense GQA + SwiGLU, and MoE with MTP), the first stage's weights, gradients and optimizer
state are ``megatron.training.theoretical_memory_usage.compute_weight_and_optimizer_memory``,
and Megatron's layout flags give the stages Megatron builds (or Megatron's refusal)."""

from __future__ import annotations

import pytest
from megatron.training.theoretical_memory_usage import compute_weight_and_optimizer_memory
from megatron.training.training import num_floating_point_operations

from megatron_pp_ext.planner.model_shape import model_shape
from megatron_pp_ext.planner.pretrain_args import parse_pretrain_args
from megatron_pp_ext.planner.pretrain_plan import plan_pretrain
from megatron_pp_ext.planner.gpus import GPUS
from megatron_pp_ext.planner.stage_flops import stage_flops, stage_seconds, step_flops
from megatron_pp_ext.integration.stage_layers import stage_layers
from megatron_pp_ext.planner.static_memory import bytes_per_param, stage_params

# A 70B-class GPT (the issue's): 80 layers, hidden 8192, 64 heads in 8 query groups, SwiGLU
# 28672, 8192 tokens, a 128k vocabulary; tp 8 with sequence parallelism, pp 8, bf16.
LLAMA_70B = [
    "--num-layers", "80", "--hidden-size", "8192", "--num-attention-heads", "64",
    "--group-query-attention", "--num-query-groups", "8", "--swiglu", "--ffn-hidden-size",
    "28672", "--seq-length", "8192", "--max-position-embeddings", "8192",
    "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--disable-bias-linear",
    "--untie-embeddings-and-output-weights", "--vocab-size", "128256",
    "--tensor-model-parallel-size", "8", "--sequence-parallel",
    "--pipeline-model-parallel-size", "8", "--micro-batch-size", "1",
    "--global-batch-size", "512", "--bf16", "--tokenizer-type", "NullTokenizer",
    "--mock-data", "--train-iters", "10", "--lr", "1e-4",
]
MOE = ["--num-experts", "16", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "4096",
       "--moe-shared-expert-intermediate-size", "2048", "--expert-model-parallel-size", "4",
       "--mtp-num-layers", "1"]


def _validated(argv, world_size):
    """Megatron's arguments with the fields its ``validate_args`` would add that its
    estimators read (validate_args itself asks the GPU)."""
    args = parse_pretrain_args(argv)
    shape = model_shape(args)
    args.kv_channels, args.padded_vocab_size = shape.kv_channels, shape.vocab
    args.world_size = world_size
    args.data_parallel_size = world_size // (args.tensor_model_parallel_size
                                             * args.pipeline_model_parallel_size)
    if args.expert_tensor_parallel_size is None:
        args.expert_tensor_parallel_size = args.tensor_model_parallel_size
    if args.num_experts is not None and args.moe_ffn_hidden_size is None:
        args.moe_ffn_hidden_size = args.ffn_hidden_size
    return args, shape


@pytest.mark.parametrize("extra", [[], MOE], ids=["dense", "moe-mtp"])
def test_stage_flops_add_up_to_megatrons_count(extra):
    args, shape = _validated(LLAMA_70B + extra, 512)
    stages = stage_layers(args, 8, 1)
    m, dp = 64, 8
    ours = step_flops(shape, stages, m, dp)
    assert ours == pytest.approx(num_floating_point_operations(args, 512), rel=1e-12)
    # the output layer over 128k tokens is about one more layer on the last stage (of 10)
    f = [stage_flops(shape, stage).f for stage in stages]
    if not extra:
        assert f[0] == f[3] and 1.1 < f[-1] / f[0] < 1.3


def test_i_and_w_split_as_the_gemms_split():
    args, shape = _validated(LLAMA_70B, 512)
    middle = stage_layers(args, 8, 1)[3]
    flops = stage_flops(shape, middle)
    # W is the weight GEMMs, once; I is them again and the core attention's backward (2x)
    core = flops.f - flops.gemm
    assert flops.w == flops.gemm and flops.i == pytest.approx(flops.gemm + 2 * core)
    assert 0.05 < core / flops.f < 0.2  # s = 8192: the attention core is ~12% of the forward
    full = stage_flops(shape, middle, "full")
    assert full.i == pytest.approx(flops.i + flops.f) and full.w == flops.w
    # seconds: the GEMMs and the rest at the H100's dense bf16 peak x the efficiency
    t_f, t_i, t_w = stage_seconds(flops, GPUS["H100"], 0.5, fp8=False)
    assert t_f == pytest.approx(flops.f / (989e12 * 0.5))
    assert t_w == pytest.approx(flops.w / (989e12 * 0.5))


@pytest.mark.parametrize("extra", [[], ["--use-distributed-optimizer"]], ids=["adam", "dist-opt"])
def test_first_stage_static_bytes_are_megatrons_estimate(extra):
    args, shape = _validated(LLAMA_70B + extra, 512)
    stages = stage_layers(args, 8, 1)
    per_param, _ = bytes_per_param(args)
    dp = args.data_parallel_size if extra else 1
    ours = per_param.of(stage_params(shape, stages[0], shares_tied_copy=False), dp, dp)
    # Megatron spreads the final norm over the stages (8192 x 1 parameters / 8): the only gap
    assert ours == pytest.approx(compute_weight_and_optimizer_memory(args), rel=1e-6)


PP4 = ["--pipeline-model-parallel-size", "4", "--num-layers", "32"]


@pytest.mark.parametrize("flags, layers", [
    (["--decoder-first-pipeline-num-layers", "9", "--decoder-last-pipeline-num-layers", "9"],
     ["E+9t", "7t", "7t", "9t+L"]),
    (["--num-layers", "30", "--account-for-embedding-in-pipeline-split",
      "--account-for-loss-in-pipeline-split"], ["E+7t", "8t", "8t", "7t+L"]),
    (["--pipeline-model-parallel-layout", "Et*2|t*10|t*10|t*10L"], ["E+2t", "10t", "10t", "10t+L"]),
])
def test_megatrons_layout_flags_give_its_stages(flags, layers):
    plan = plan_pretrain(LLAMA_70B + PP4 + flags, schedule="1f1b", world_size=128)
    assert [s.describe() for s in plan.stages] == layers and not plan.even
    assert sum(s.decoder for s in plan.stages) == plan.num_layers
    # each rank's bytes follow its own layers: the heavy last stage holds one microbatch
    # (1F1B), rank 0 four; its static bytes carry the output layer
    middle = plan.activations.stage_bytes[1] // plan.stages[1].decoder
    assert plan.activations.stage_bytes[2] == plan.stages[2].decoder * middle
    assert plan.peak_in_flight == [4, 3, 2, 1]


def test_a_layout_string_gives_the_v_layout_its_stages():
    """Stage s of the string is V stage s: rank r holds stages r and 2p-1-r, and v = 2 comes
    from the string (4 stages over pp 2)."""
    flags = ["--pipeline-model-parallel-size", "2", "--num-layers", "8",
             "--pipeline-model-parallel-layout", "Et|ttt|ttt|tL"]
    plan = plan_pretrain(LLAMA_70B + flags, schedule="zb-v", world_size=64)
    assert plan.v == 2 and plan.layout == "v"
    assert [s.describe() for s in plan.stages] == ["E+1t", "3t", "3t", "1t+L"]
    assert [list(plan.schedule.stages_of(r)) for r in range(2)] == [[0, 3], [1, 2]]


@pytest.mark.parametrize("flags, words", [
    # Megatron's own rules, in Megatron's words
    (PP4 + ["--decoder-first-pipeline-num-layers", "9", "--decoder-last-pipeline-num-layers",
            "8"], "Megatron-Core refuses this layer split: number of layers at middle stage: 15 "
     "must be divisible"),
    (PP4 + ["--pipeline-model-parallel-layout", "Et*2|t*10|t*10|t*9L"],
     "Megatron-Core refuses this layer split: Number of decoder layers 31"),
    (PP4 + ["--pipeline-model-parallel-layout", "Et*2|t*10|t*20L"], "has 3 stages, not a "
     "multiple of --pipeline-model-parallel-size 4"),
])
def test_a_layout_megatron_refuses_is_refused_with_its_rule(flags, words):
    with pytest.raises(ValueError, match=words):
        plan_pretrain(LLAMA_70B + flags, schedule="1f1b", world_size=128)


def test_the_v_layout_places_the_loop_flags_on_its_first_and_last_stage():
    """Under zb-v (8 stages at pp 4, stages 0 and 7 on rank 0) --decoder-first/last-pipeline-
    num-layers give stage 0 and stage 7 their layers and the other six share the rest; a rest
    that does not divide is refused with the numbers."""
    flags = PP4 + ["--num-virtual-stages-per-pipeline-rank", "2"]
    plan = plan_pretrain(LLAMA_70B + flags + ["--decoder-first-pipeline-num-layers", "8",
                                              "--decoder-last-pipeline-num-layers", "6"],
                         schedule="zb-v", world_size=128)
    assert [stage.decoder for stage in plan.stages] == [8] + [3] * 6 + [6]
    assert [list(plan.schedule.stages_of(r)) for r in (0, 3)] == [[0, 7], [3, 4]]
    assert plan.to_dict()["pipeline_model_parallel_layout"] == "Et*8|(t*3|)*6,t*6L"
    with pytest.raises(ValueError, match="the other 6 stages must share the remaining 14 of "
                       "--num-layers 32 evenly"):
        plan_pretrain(LLAMA_70B + flags + ["--decoder-first-pipeline-num-layers", "9",
                                           "--decoder-last-pipeline-num-layers", "9"],
                      schedule="zb-v", world_size=128)


# ------------------------------------------------------------------ measured bytes

PROBE_ARGS = [  # the probe's GPT (support.activation_probe.SIZES) as pretrain_gpt.py flags
    "--hidden-size", "128", "--num-attention-heads", "8", "--seq-length", "64",
    "--max-position-embeddings", "64", "--micro-batch-size", "2", "--vocab-size", "1024",
    "--transformer-impl", "local", "--attention-dropout", "0", "--hidden-dropout", "0",
    "--tokenizer-type", "NullTokenizer", "--mock-data", "--train-iters", "1", "--lr", "1e-4",
]
# (Megatron's flags, the same as TransformerConfig overrides for the probe)
KINDS = {
    "gelu": ([], {}),
    "gqa-swiglu": (["--group-query-attention", "--num-query-groups", "2", "--swiglu",
                    "--ffn-hidden-size", "352", "--no-bias-swiglu-fusion"],
                   dict(num_query_groups=2, gated_linear_unit=True, ffn_hidden_size=352,
                        activation_func="silu")),
    "selective": (["--recompute-granularity", "selective"],
                  dict(recompute_granularity="selective")),
    "full": (["--recompute-granularity", "full", "--recompute-method", "uniform",
              "--recompute-num-layers", "1"],
             dict(recompute_granularity="full", recompute_method="uniform",
                  recompute_num_layers=1)),
}


@pytest.fixture(scope="module")
def measured_bytes():
    """{kind: (bytes of one F of a 2-layer GPT, of a 4-layer one)}, measured on the CPU
    (Megatron's GPT, local layers, fp32): the saved tensors' unique storages."""
    from megatron_pp_ext.train.processes import spawn
    from support.activation_probe import saved_bytes

    settings = [dict(overrides, layers=layers) for _, overrides in KINDS.values()
                for layers in (2, 4)]
    (result,) = spawn(1, saved_bytes, settings, timeout_s=120)
    sizes = [r["bytes"] for r in result]
    return {kind: (sizes[2 * i], sizes[2 * i + 1]) for i, kind in enumerate(KINDS)}


@pytest.mark.parametrize("kind", list(KINDS))
def test_the_activation_formula_matches_measured_bytes(measured_bytes, kind):
    """Per layer (the 4-layer model minus the 2-layer one, halved) and per stage (the whole
    2-layer model: embedding, layers, output layer and loss), within 10% (the issue's bound;
    they agree within 2%: the gap is the token indices and norms' statistics, not modelled)."""
    two, four = measured_bytes[kind]
    flags = KINDS[kind][0]
    for layers, measured in ((2, two), (4, four)):
        args = parse_pretrain_args(PROBE_ARGS + ["--num-layers", str(layers)] + flags)
        estimate = plan_activation(args)
        assert estimate.stage_bytes[0] == pytest.approx(measured, rel=0.02), (kind, layers)
    per_layer = (four - two) / 2
    assert estimate.bytes_per_layer == pytest.approx(per_layer, rel=0.02), kind


def plan_activation(args):
    from megatron_pp_ext.planner.activation_model import activation_estimate

    return activation_estimate(args, stage_layers(args, 1, 1))


# ------------------------------------------------------------------ plan --format json


def _plan_json(capsys, *plan_args, argv=LLAMA_70B):
    import json

    from megatron_pp_ext.cli import main

    assert main(["plan", *plan_args, "--format", "json", "--", *argv]) == 0
    return json.loads(capsys.readouterr().out)


def test_plan_json_of_a_70b_model_on_h100s(capsys):
    """The issue's 70B-class model on 512 H100s under zb-v (vpp 2): per stage its layers and
    costs in seconds (the output layer makes the last stage heavier), per rank activation,
    static and total bytes and whether they fit in 80 GB; selective recompute changes
    nothing here (flash attention keeps no scores to drop)."""
    argv = LLAMA_70B + ["--num-virtual-stages-per-pipeline-rank", "2",
                        "--use-distributed-optimizer"]
    plan = _plan_json(capsys, "--schedule", "zb-v", "--world-size", "512", "--gpu", "H100",
                      argv=argv)
    assert (plan["p"], plan["v"], plan["m"], plan["dp"]) == (8, 2, 64, 8)
    stages = plan["stages"]
    assert [s["layers"] for s in stages] == ["E+5t"] + ["5t"] * 14 + ["5t+L"]
    assert [s["rank"] for s in stages] == list(range(8)) + list(range(7, -1, -1))
    # the embedding's stage: its 5 layers and the vocab-parallel embedding's reduce-scatter
    assert stages[15]["t_f_s"] > 1.15 * stages[1]["t_f_s"]
    assert stages[1]["t_f_s"] < stages[0]["t_f_s"] < 1.02 * stages[1]["t_f_s"]
    assert plan["gpu"] == "H100" and plan["gpu_memory_bytes"] == 80 * 10**9
    total = [a + s for a, s in zip(plan["peak_activation_bytes"], plan["static_bytes"])]
    # fits: the model's bytes and the reserve (the CUDA context, NCCL, the allocator) in 80 GB
    reserve = plan["reserve_bytes"]
    assert reserve == 4 * 2**30 and plan["total_bytes"] == total
    assert plan["fits"] == [t + reserve <= 80 * 10**9 for t in total]
    assert plan["headroom_bytes"] == [80 * 10**9 - reserve - t for t in total]
    # rank 0 holds the embedding and the output layer (V layout): the most static bytes
    assert plan["static_bytes"][0] > max(plan["static_bytes"][1:])
    assert plan["unit"] == "s" and 1 < plan["predicted_step"] < 60
    selective = _plan_json(capsys, "--schedule", "zb-v", "--world-size", "512", "--gpu", "H100",
                           argv=argv + ["--recompute-granularity", "selective"])
    assert selective["peak_activation_bytes"] == plan["peak_activation_bytes"]
    unfused = _plan_json(capsys, "--schedule", "zb-v", "--world-size", "512", "--gpu", "H100",
                         argv=argv + ["--attention-backend", "unfused"])
    assert all(u > 1.5 * a for u, a in zip(unfused["peak_activation_bytes"],
                                           plan["peak_activation_bytes"]))
    assert not any(unfused["fits"])  # the scores of 8192 tokens do not fit


def test_plan_json_of_an_uneven_layout(capsys):
    argv = LLAMA_70B + PP4 + ["--decoder-first-pipeline-num-layers", "9",
                              "--decoder-last-pipeline-num-layers", "9"]
    plan = _plan_json(capsys, "--schedule", "zb-h1", "--world-size", "128", "--gpu", "B200",
                      "--gpu-memory", "100GiB", argv=argv)
    assert [s["layers"] for s in plan["stages"]] == ["E+9t", "7t", "7t", "9t+L"]
    t_f = [s["t_f_s"] for s in plan["stages"]]
    # 9 layers for 7 (and the embedding's reduce-scatter)
    assert t_f[0] == pytest.approx(9 / 7 * t_f[1], rel=0.02) and t_f[3] > t_f[0]
    assert plan["gpu_memory_bytes"] == 100 * 2**30
    assert plan["activation_bytes_per_stage"][0] == pytest.approx(
        9 / 7 * plan["activation_bytes_per_stage"][1], rel=0.01)


def test_select_ranks_the_schedules_that_fit_a_70b_model(capsys):
    """``select -- ARGS``: every schedule planned on the model (each chunked as it needs),
    ranked by predicted step among those whose every rank fits in the H100's 80 GB; gpipe's
    64 microbatches in flight do not fit. Under an uneven loop split the V schedules are
    excluded with Megatron's reason, the loop ones still ranked."""
    import json

    from megatron_pp_ext.cli import main

    argv = LLAMA_70B + ["--use-distributed-optimizer"]
    assert main(["select", "--gpu", "h100", "--world-size", "512", "--format", "json", "--",
                 *argv]) == 0
    data = json.loads(capsys.readouterr().out)
    ranked = [row["schedule"] for row in data["ranked"]]
    assert set(ranked) == {"1f1b", "zb-h1", "zb-h2", "interleaved", "zb-v", "dualpipev",
                           "dualpipe", "v-half", "v-min", "zb-auto"}
    steps = [row["predicted_step_s"] for row in data["ranked"]]
    step = {(row["schedule"], row["v"]): row["predicted_step_s"] for row in data["ranked"]}
    # zb-auto, built for the stages' FLOPs and what each rank's memory leaves (planned in
    # both layouts), beats every fixed order of its layouts: the V one ahead of zb-v, the loop
    # one at least zb-h2's (the fastest fixed loop order that fits). dualpipe, which holds
    # every part twice, is ahead of all: each of its loss ranks (0 and p-1) computes the
    # output layer for half the microbatches, where the V layouts' rank 0 computes it for all
    # (7774 ms against zb-auto's 8232; 42.3 GiB on its busiest rank against zb-v's 34.2)
    assert steps == sorted(steps) and ranked[:2] == ["dualpipe", "zb-auto"]
    dual = next(row for row in data["ranked"] if row["schedule"] == "dualpipe")
    zbv = next(row for row in data["ranked"] if row["schedule"] == "zb-v")
    assert min(dual["total_bytes"]) > max(zbv["total_bytes"])  # every part twice
    assert step[("zb-auto", 2)] < step[("zb-v", 2)] and step[("zb-auto", 1)] <= step[("zb-h2", 1)]
    assert all(all(row["fits"]) for row in data["ranked"])
    assert [row["schedule"] for row in data["too_big"]] == ["gpipe"]
    assert {row["schedule"]: row["v"] for row in data["ranked"]}["interleaved"] == 2

    uneven = argv + PP4 + ["--decoder-first-pipeline-num-layers", "9",
                           "--decoder-last-pipeline-num-layers", "9"]
    assert main(["select", "--gpu", "H100", "--world-size", "128", "--schedules",
                 "1f1b,zb-h1,zb-v", "--", *uneven]) == 0
    text = capsys.readouterr().out
    assert "1  zb-h1" in text and "2  1f1b" in text
    assert "excluded:\n  zb-v: --pipeline-schedule zb-v (V layout" in text


def test_simulate_takes_the_model_and_its_uneven_stages(capsys):
    """``simulate -- ARGS``: p, m, v and the stages from Megatron's arguments, each stage
    priced from its FLOPs: the same prediction as ``plan``'s; -p with the arguments is
    refused."""
    import json

    from megatron_pp_ext.cli import main

    argv = LLAMA_70B + PP4 + ["--decoder-first-pipeline-num-layers", "9",
                              "--decoder-last-pipeline-num-layers", "9"]
    assert main(["simulate", "--schedule", "zb-h1", "--gpu", "H100", "--world-size", "128",
                 "--format", "json", "--", *argv]) == 0
    data = json.loads(capsys.readouterr().out)
    plan = plan_pretrain(argv, schedule="zb-h1", world_size=128, gpu="H100")
    assert (data["ranks"], data["microbatches"], data["unit"]) == (4, plan.m, "s")
    assert data["makespan"] == pytest.approx(plan.timeline.makespan)
    assert main(["simulate", "--schedule", "zb-h1", "--gpu", "H100", "--world-size", "128",
                 "--", *argv]) == 0
    assert "stages E+9t | 7t | 7t | 9t+L" in capsys.readouterr().out
    assert main(["simulate", "--schedule", "zb-h1", "-p", "4", "--", *argv]) == 2
    assert "p, m and v come from them" in capsys.readouterr().err


def test_compare_draws_every_schedule_on_the_model(capsys, tmp_path):
    """``compare -- ARGS``: the candidates side by side on the model (the one that does not
    fit too, marked), every timeline on one page."""
    from megatron_pp_ext.cli import main

    page = tmp_path / "compare.html"
    assert main(["compare", "--gpu", "H100", "--world-size", "512", "--schedules",
                 "1f1b,zb-v,gpipe", "--out", str(page), "--", *LLAMA_70B,
                 "--use-distributed-optimizer"]) == 0
    out = capsys.readouterr().out
    rows = [line.split()[:3] for line in out.splitlines() if line[:2] in ("1 ", "2 ", "- ")]
    # zb-v's smaller bubble beats 1f1b by 0.2%: at m=64 per p=8 most of either step is the
    # stages' own work and the data-parallel exchange after it
    assert rows == [["1", "zb-v", "2"], ["2", "1f1b", "1"], ["-", "gpipe", "1"]]
    assert page.read_text().count("<svg") == 3


def test_plan_json_on_stdout_is_only_json_with_megatrons_layout_log_on_stderr():
    """``plan --format json`` with ``--pipeline-model-parallel-layout``: Megatron's layout
    parser logs through the root handler that ``megatron.training`` puts on stdout; the
    command moves it to stderr, so stdout parses as one JSON document (a subprocess: in
    pytest's process the handler's stream is not the command's stdout)."""
    import json
    import subprocess
    import sys

    argv = LLAMA_70B + PP4 + ["--pipeline-model-parallel-layout", "Et*7|t*8|t*8|t*9L"]
    proc = subprocess.run([sys.executable, "-m", "megatron_pp_ext", "plan", "--schedule",
                           "1f1b", "--world-size", "128", "--format", "json", "--", *argv],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    plan = json.loads(proc.stdout)
    assert [s["decoder_layers"] for s in plan["stages"]] == [7, 8, 8, 9]
    assert plan["largest_stage_decoder_layers"] == 9 and "layers_per_stage" not in plan
    assert "Parse pipeline model parallel layout Et*7|t*8|t*8|t*9L" in proc.stderr


@pytest.mark.parametrize("extra, gpu, expect", [
    ([], None, (2, 4, 12, None)),
    (["--grad-reduce-in-bf16"], None, (2, 2, 12, None)),
    # the precision-aware optimizer: bf16 main gradients and moments; fp32 masters kept as the
    # bf16 weight and a 16-bit remainder (no fp8, so Transformer Engine's FusedAdam holds them)
    (["--use-precision-aware-optimizer", "--main-grads-dtype", "bf16", "--exp-avg-dtype",
      "bf16", "--exp-avg-sq-dtype", "bf16"], None, (2, 2, 2 + 2 + 2, None)),
    (["--use-precision-aware-optimizer", "--exp-avg-dtype", "fp8"], None, (2, 4, 2 + 1 + 4, None)),
    # fp8: Transformer Engine's copies of the GEMM weights (a transpose too on Hopper), or
    # the fp8 parameters in their place
    (["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"], "H100", (2, 4, 12, 4)),
    (["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise", "--fp8-param-gather"], "H100",
     (2, 4, 12, 2)),
    (["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise", "--fp8-param-gather"], "B200",
     (2, 4, 12, 1)),
    (["--fp8-format", "e4m3", "--fp8-recipe", "mxfp8", "--fp8-param-gather"], "B200",
     (2, 4, 12, 2 * 33 / 32)),
], ids=["bf16", "bf16-grads", "precision-aware", "fp8-moment", "fp8", "fp8-params",
        "fp8-params-b200", "mxfp8-params"])
def test_bytes_per_parameter_follow_megatrons_flags(extra, gpu, expect):
    args = parse_pretrain_args(LLAMA_70B + ["--use-distributed-optimizer"] + extra)
    per_param, _ = bytes_per_param(args, GPUS[gpu] if gpu else None)
    assert (per_param.weight, per_param.grad, per_param.optimizer,
            per_param.gemm_weight) == pytest.approx(expect)


@pytest.mark.parametrize("recipe, per_layer", [("tensorwise", 31), ("mxfp8", 31 + 6.5 / 32)])
def test_fp8_keeps_the_gemm_inputs_in_fp8(recipe, per_layer):
    """Under fp8 Transformer Engine keeps QKV's and fc1's inputs (the norms' outputs) and
    fc2's input in fp8, and the output projection an fp8 copy of the attention's output:
    35.5 T h / t in bf16 becomes 31 (MXFP8: and a scale per 32 of those 6.5 T h)."""
    args = parse_pretrain_args(LLAMA_70B + ["--fp8-format", "hybrid", "--fp8-recipe", recipe])
    bf16 = plan_activation(parse_pretrain_args(LLAMA_70B)).bytes_per_layer
    fp8 = plan_activation(args).bytes_per_layer
    th = 8192 * 8192
    assert bf16 == 35.5 * th / 8 and fp8 == pytest.approx(per_layer * th / 8, rel=1e-9)


def test_activation_offload_is_named_as_not_modelled():
    """Megatron's --fine-grained-activation-offloading moves the named modules' saved inputs
    to the CPU; the plan does not model it, and says so next to the bytes it gives."""
    plan = plan_pretrain(LLAMA_70B + ["--fine-grained-activation-offloading",
                                      "--offload-modules", "core_attn"],
                         schedule="1f1b", world_size=128)
    assert any(note.startswith("--fine-grained-activation-offloading (core_attn) is not "
                               "modelled") for note in plan.activations.notes)
    assert plan.activations.bytes_per_layer == plan_pretrain(
        LLAMA_70B, schedule="1f1b", world_size=128).activations.bytes_per_layer


def test_multi_latent_attention_is_refused_not_priced_as_gqa():
    """MLA's low-rank projections change FLOPs, parameters and activations: the planner says it
    does not model them rather than print GQA's figures for the model."""
    args = parse_pretrain_args(LLAMA_70B + ["--multi-latent-attention", "--kv-lora-rank", "512",
                                            "--q-lora-rank", "1536", "--qk-head-dim", "128",
                                            "--qk-pos-emb-head-dim", "64", "--v-head-dim", "128"])
    with pytest.raises(ValueError, match="--multi-latent-attention is not modelled by plan"):
        model_shape(args)
