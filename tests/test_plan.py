"""``plan``: a Megatron-LM pretrain_gpt.py command line, parsed by Megatron-LM's own parser, turned
into the plugin's p, m, v, dp and layout, checked, and its activation memory estimated from the
model's dimensions (Korthikanti et al. 2022, Table 2)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_pp_ext.schedules.validate import peak_activations
from megatron_pp_ext.planner.pretrain_plan import plan_pretrain, split_launcher
from megatron_pp_ext.runtime.memory import predicted_peak_bytes
from megatron_pp_ext.schedules import build_schedule
from support.cli_run import cli_in_process

ROOT = Path(__file__).resolve().parents[1]

# A GPT of 32 layers, hidden 4096, 32 heads, 2048 tokens, on 64 GPUs: tp=2, pp=4 (so dp=8),
# global batch 512 of micro batches of 2 (so m = 512 / (2 x 8) = 32), zb-v's two chunks.
S, B, H, A, TP, PP, L, GPUS = 2048, 2, 4096, 32, 2, 4, 32, 64
PRETRAIN_ARGS = [
    "--tensor-model-parallel-size", str(TP), "--pipeline-model-parallel-size", str(PP),
    "--sequence-parallel", "--num-layers", str(L), "--hidden-size", str(H),
    "--num-attention-heads", str(A), "--seq-length", str(S), "--max-position-embeddings", str(S),
    "--micro-batch-size", str(B), "--global-batch-size", "512", "--bf16",
    "--num-virtual-stages-per-pipeline-rank", "2", "--untie-embeddings-and-output-weights",
    "--train-iters", "100", "--lr", "3e-4", "--mock-data", "--tokenizer-type", "NullTokenizer",
    "--vocab-size", "32000",
]


def replaced(args: list[str], flag: str, value: str | None) -> list[str]:
    """``args`` with ``flag``'s value replaced (``value=None``: the flag and its value gone)."""
    i = args.index(flag)
    return args[:i] + ([flag, value] if value is not None else []) + args[i + 2:]


T, V = S * B, 32000  # tokens of a microbatch; the vocabulary (a multiple of 128 x tp already)
PER_LAYER = S * B * H * 34 // TP  # Korthikanti et al. 2022, Table 2: tp and sp, no scores
EMBEDDING_EXTRA = T * H // TP  # the embedding's dropout mask (1 byte), sequence parallel
LOSS_EXTRA = 4 * T * H // TP + 4 * T * V // TP  # final norm and output-layer inputs; fp32 softmax


def test_plan_derives_p_m_v_dp_and_the_activation_bytes():
    plan = plan_pretrain(PRETRAIN_ARGS, schedule="zb-v", world_size=GPUS)
    assert (plan.p, plan.m, plan.v, plan.dp, plan.tp) == (4, 32, 2, 8, 2)
    assert plan.layout == "v" and plan.layers_per_stage == L // (2 * PP) == 4 and plan.even
    assert [list(plan.schedule.stages_of(r)) for r in range(PP)] == [[0, 7], [1, 6], [2, 5],
                                                                      [3, 4]]
    assert [s.describe() for s in plan.stages] == ["E+4t"] + ["4t"] * 6 + ["4t+L"]
    # Transformer Engine's default attention (flash or fused) keeps no scores:
    # s*b*h*34/t bytes per layer per microbatch with tensor and sequence parallelism
    assert PER_LAYER == 285_212_672
    assert plan.activations.bytes_per_layer == PER_LAYER
    assert plan.activations.stage_bytes == (
        [4 * PER_LAYER + EMBEDDING_EXTRA] + [4 * PER_LAYER] * 6 + [4 * PER_LAYER + LOSS_EXTRA])
    # the count the simulator walks: zb-v holds 2p chunk activations at p=4, m=32
    peaks = peak_activations(build_schedule("zb-v", PP, 32))
    assert peaks == [8, 8, 8, 8] and plan.peak_in_flight == peaks
    # in bytes: ranks 1-3 hold 8 of their two middle stages; rank 0's stages are 0 and 7
    assert plan.peak_bytes[1:] == [8 * 4 * PER_LAYER] * 3
    assert plan.peak_bytes[0] == predicted_peak_bytes(
        plan.schedule, dict(enumerate(plan.activations.stage_bytes)))[0]
    assert 8 * 4 * PER_LAYER < plan.peak_bytes[0] <= 8 * (4 * PER_LAYER + LOSS_EXTRA)
    assert plan.timeline.unit == "t" and plan.timeline.makespan > 0


def test_the_launcher_gives_the_world_size():
    launch = ["torchrun", "--nnodes", "8", "--nproc-per-node=8", "--rdzv-backend", "c10d",
              "pretrain_gpt.py", *PRETRAIN_ARGS]
    assert split_launcher(launch)[1:] == (64, "the launcher: 8 node(s) x 8 process(es) per node")
    plan = plan_pretrain(launch, schedule="zb-v")
    assert (plan.dp, plan.m, plan.world_size) == (8, 32, 64)
    assert split_launcher(["srun", "--ntasks", "16", "python", "pretrain_gpt.py", "--x"]) == (
        ["--x"], 16, "the launcher's --ntasks 16")
    # no launcher and no --world-size: dp = 1, said so
    plan = plan_pretrain(replaced(PRETRAIN_ARGS, "--global-batch-size", "64"), schedule="zb-v")
    assert (plan.dp, plan.m, plan.world_size) == (1, 32, 8) and "dp = 1" in plan.world_from
    with pytest.raises(ValueError, match="disagrees with the launcher"):
        plan_pretrain(launch, schedule="zb-v", world_size=32)


@pytest.mark.parametrize("extra, per_layer", [
    # selective recompute (--recompute-activations is Megatron's shorthand): s*b*h*34/t
    (["--recompute-activations"], S * B * H * 34 / TP),
    # full recompute keeps each layer's input: 2*s*b*h, sharded over tp with sequence parallel
    (["--recompute-granularity", "full", "--recompute-method", "uniform",
      "--recompute-num-layers", "1"], 2 * S * B * H / TP),
    # unfused attention keeps the scores: the 5*a*s/h term, Korthikanti's full formula
    (["--attention-backend", "unfused"], S * B * H * (34 + 5 * A * S / H) / TP),
    (["--transformer-impl", "local"], S * B * H * (34 + 5 * A * S / H) / TP),
    # ... and selective recompute drops them again
    (["--attention-backend", "unfused", "--recompute-activations"], S * B * H * 34 / TP),
])
def test_activation_bytes_follow_recompute_and_attention(extra, per_layer):
    plan = plan_pretrain(PRETRAIN_ARGS + extra, schedule="zb-v", world_size=GPUS)
    assert plan.activations.bytes_per_layer == per_layer
    assert plan.activations.stage_bytes[1:7] == [4 * per_layer] * 6  # the middle stages
    assert plan.peak_bytes[1:] == [8 * 4 * per_layer] * 3


def test_activation_bytes_without_sequence_parallel_and_in_fp32():
    args = [a for a in replaced(PRETRAIN_ARGS, "--num-virtual-stages-per-pipeline-rank", None)
            if a not in ("--sequence-parallel", "--bf16")]
    plan = plan_pretrain(args, schedule="1f1b", world_size=GPUS)
    # tensor parallel without sequence parallel: s*b*h*(10 + 24/t) (no scores: flash), and
    # fp32 activations (no --bf16 / --fp16) twice the 16-bit figure
    per_layer = 2 * S * B * H * (10 + 24 / TP)
    assert plan.activations.bytes_per_layer == per_layer
    assert (plan.p, plan.m, plan.v, plan.layers_per_stage) == (4, 32, 1, 8)
    assert plan.peak_in_flight == [4, 3, 2, 1]  # 1F1B: p - r
    # the first stage adds its unsharded dropout mask, the last its fp32 softmax and inputs
    stage = [8 * per_layer + T * H, 8 * per_layer, 8 * per_layer,
             8 * per_layer + 2 * 4 * T * H + 4 * T * V // TP]
    assert plan.activations.stage_bytes == stage
    assert plan.peak_bytes == [c * b for c, b in zip((4, 3, 2, 1), stage)]


def test_megatron_own_schedule_when_none_is_named():
    no_v = replaced(PRETRAIN_ARGS, "--num-virtual-stages-per-pipeline-rank", None)
    plan = plan_pretrain(no_v, world_size=GPUS)
    assert (plan.name, plan.v) == ("1f1b", 1) and "Megatron's own" in plan.how_chosen
    plan = plan_pretrain(PRETRAIN_ARGS, world_size=GPUS)  # 2 virtual stages per rank
    assert (plan.name, plan.v, plan.layout) == ("interleaved", 2, "loop")
    assert [list(plan.schedule.stages_of(r)) for r in range(PP)][0] == [0, 4]
    named = plan_pretrain(PRETRAIN_ARGS + ["--pipeline-schedule", "dualpipev"], world_size=GPUS)
    assert named.name == "dualpipev"


def test_a_bad_combination_names_the_values_and_the_fix():
    with pytest.raises(ValueError) as error:
        plan_pretrain(replaced(PRETRAIN_ARGS, "--num-layers", "30"), schedule="zb-v",
                      world_size=GPUS)
    text = str(error.value)
    assert "zb-v with p=4" in text and "2p = 8 stages" in text
    assert "--num-layers 30 is not a multiple of 8" in text
    assert "use --num-layers 32 or 24" in text and "p = 3, 5, 15" in text

    no_v = replaced(PRETRAIN_ARGS, "--num-virtual-stages-per-pipeline-rank", None)
    with pytest.raises(ValueError, match="add --num-virtual-stages-per-pipeline-rank 2"):
        plan_pretrain(no_v, schedule="zb-v", world_size=GPUS)
    with pytest.raises(ValueError, match=r"--global-batch-size 512 is not a multiple of "
                       r"--micro-batch-size 2 x dp 6 = 12 .*use --global-batch-size 516 or 504"):
        plan_pretrain(PRETRAIN_ARGS, schedule="zb-v", world_size=48)
    with pytest.raises(ValueError, match=r"world size 60 .* not a multiple of tp x pp x cp"):
        plan_pretrain(PRETRAIN_ARGS, schedule="zb-v", world_size=60)
    with pytest.raises(ValueError, match="unrecognized arguments: --no-such-flag"):
        plan_pretrain(PRETRAIN_ARGS + ["--no-such-flag"], schedule="zb-v", world_size=GPUS)


def test_a_schedule_file_is_planned_as_it_is_written(tmp_path):
    """A CSV schedule (PyTorch's format) is checked against the arguments like a name: its p,
    its m against global batch / (micro batch x dp), its layout against the chunks."""
    path = tmp_path / "my_zbv.csv"
    path.write_text(build_schedule("zb-v", PP, 32).to_csv())
    plan = plan_pretrain(PRETRAIN_ARGS, schedule=str(path), world_size=GPUS)
    assert (plan.name, plan.p, plan.m, plan.v, plan.layout) == (str(path), 4, 32, 2, "v")
    assert plan.peak_bytes == plan_pretrain(PRETRAIN_ARGS, schedule="zb-v",
                                            world_size=GPUS).peak_bytes  # as the built-in zb-v
    with pytest.raises(ValueError, match=r"m=32 microbatches.* is 64 microbatches per step: "
                       r"set --global-batch-size 512"):
        plan_pretrain(replaced(PRETRAIN_ARGS, "--global-batch-size", "1024"),
                      schedule=str(path), world_size=GPUS)


def cli(*args) -> subprocess.CompletedProcess:
    """The command in a fresh interpreter, as a user runs it."""
    return subprocess.run([sys.executable, "-m", "megatron_pp_ext", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


def test_cli_plan_prints_the_plan_and_writes_the_timeline(tmp_path):
    page = tmp_path / "out" / "plan.html"  # --out's folder is made as needed
    result = cli("plan", "--schedule", "zb-v", "--world-size", "64", "--out", str(page), "--",
                 *PRETRAIN_ARGS)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""  # Megatron's import warnings kept out
    out = result.stdout
    assert "world 64 = tp 2 x pp 4 x cp 1 x dp 8" in out
    assert "global 512 = micro batch 2 x dp 8 x m 32 microbatches" in out
    assert "p=4, m=32, v=2 chunk(s) per rank" in out and "V layout" in out
    assert "= 285,212,672 bytes" in out
    assert "stages (Megatron's split; " in out and ": E+4t | 4t | 4t | 4t | 4t | 4t | 4t | 4t+L" in out
    rows = re.findall(r"^ +(\d)  (\d,\d) +(\S+) +\d+ +8 +([\d,]+) +\(([\d.]+) GiB\)", out, re.M)
    assert rows[1:] == [(str(r), f"{r},{7 - r}", "4t,4t", "9,126,805,504", "8.50")
                        for r in range(1, 4)]
    assert rows[0][:3] == ("0", "0,7", "E+4t,4t+L")
    assert re.search(r"^predicted step: [\d.]+ t, bubble [\d.]+% \(unit costs", out, re.M)
    assert out.rstrip().endswith(f"wrote {page}")
    html = page.read_text()
    assert "zb-v — predicted (p=4, m=32, v=2)" in html and ">time (t)</text>" in html


def test_cli_plan_with_costs_in_seconds_and_errors():
    result = cli_in_process(
        "plan", "--schedule", "1f1b", "--t-f", "0.01", "--t-b", "0.02", "--", "torchrun",
        "--nproc-per-node", "8", "pretrain_gpt.py",
        *replaced(PRETRAIN_ARGS, "--num-virtual-stages-per-pipeline-rank", None))
    bad = cli_in_process("plan", "--schedule", "zb-v", "--world-size", "64", "--",
                         *replaced(PRETRAIN_ARGS, "--num-layers", "30"))
    assert result.returncode == 0, result.stderr
    # m = 512 / (2 x 1) = 256 on 8 GPUs (dp 1): 1F1B's step is (m + p - 1) x 30 ms
    assert "predicted step: 7770 ms" in result.stdout
    assert "given costs in seconds" in result.stdout

    assert bad.returncode == 2 and bad.stdout == ""
    lines = bad.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --pipeline-schedule zb-v with p=4")
