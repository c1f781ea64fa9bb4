"""NVIDIA's published Megatron-Core pretraining runs, as Megatron-LM command lines for ``plan``.

Each row is a run from Megatron-Bridge's performance summary (NVIDIA-NeMo/Megatron-Bridge,
``docs/performance-summary-archive.md`` at 067f987df03b, the release named per row), with the
configuration its recipe sets (``scripts/performance/configs/...`` at the tag of that
release), written as the ``pretrain_gpt.py`` flags that set the same: FP8 with current
(tensorwise) scaling and ``fp8_param_gather``, bf16 gradient reduction (the performance
scripts' ``grad_reduce_in_fp32=False``: ``--grad-reduce-in-bf16``), the distributed optimizer,
sequence parallelism where tp > 1, micro batch 1, no recompute, no offload. These runs fit on
their GPUs: they are what ``plan``'s "fits" is held to (``tests/test_published_recipes.py``).

    .venv/bin/python tests/support/published_recipes.py     # the table in docs/planning.md

prints, per row, the published tokens/s and TFLOP/s per GPU beside ``plan``'s FLOPs per token
(Megatron's count, which the summary's TFLOP/s divided by its tokens/s also is) and its most
loaded rank's bytes.
"""

from __future__ import annotations

import contextlib
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

_BASE = ("--seq-length {s} --max-position-embeddings {s} --position-embedding-type rope "
         "--normalization RMSNorm --untie-embeddings-and-output-weights --swiglu "
         "--group-query-attention --micro-batch-size {b} --bf16 --use-distributed-optimizer "
         "--grad-reduce-in-bf16 --overlap-grad-reduce --overlap-param-gather "
         "--tokenizer-type NullTokenizer --mock-data --train-iters 10 --lr 1e-4")
_FP8 = "--fp8-format hybrid --fp8-recipe {recipe} --fp8-param-gather"
_COMMON = "--disable-bias-linear " + _BASE + " " + _FP8.format(recipe="tensorwise")
_MXFP8 = "--disable-bias-linear " + _BASE + " " + _FP8.format(recipe="mxfp8")
LLAMA3_70B = ("--num-layers 80 --hidden-size 8192 --ffn-hidden-size 28672 "
              "--num-attention-heads 64 --num-query-groups 8 --vocab-size 128256 "
              + _COMMON.format(s=8192, b=1))
LLAMA31_405B = ("--num-layers 126 --hidden-size 16384 --ffn-hidden-size 53248 "
                "--num-attention-heads 128 --num-query-groups 8 --vocab-size 128256 "
                "--account-for-embedding-in-pipeline-split --account-for-loss-in-pipeline-split "
                + _COMMON.format(s=8192, b=1))
LLAMA3_8B = ("--num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 "
             "--num-attention-heads 32 --num-query-groups 8 --vocab-size 128256 "
             + _COMMON.format(s=8192, b=2))
_QWEN3 = ("--num-attention-heads {a} --num-query-groups 4 --kv-channels 128 --qk-layernorm "
          "--num-experts 128 --moe-router-topk 8 --moe-grouped-gemm --vocab-size 151936 ")
QWEN3_30B_A3B = ("--num-layers 48 --hidden-size 2048 --ffn-hidden-size 6144 "
                 "--moe-ffn-hidden-size 768 " + _QWEN3.format(a=32))
QWEN3_235B_A22B = ("--num-layers 94 --hidden-size 4096 --ffn-hidden-size 12288 "
                   "--moe-ffn-hidden-size 1536 --account-for-embedding-in-pipeline-split "
                   "--account-for-loss-in-pipeline-split " + _QWEN3.format(a=64))
#: biases, a 128-token sliding window on every other layer, bf16, selective recompute of the
#: norms and the experts' activation
GPT_OSS_120B = ("--num-layers 36 --hidden-size 2880 --ffn-hidden-size 2880 "
                "--num-attention-heads 64 --num-query-groups 8 --kv-channels 64 "
                "--num-experts 128 --moe-router-topk 4 --moe-ffn-hidden-size 2880 "
                "--moe-grouped-gemm --vocab-size 201088 --window-size 127,0 "
                "--window-attn-skip-freq 2 --recompute-granularity selective "
                "--recompute-modules layernorm moe_act " + _BASE.format(s=4096, b="{b}"))
_TP_OVERLAP = " --tp-comm-overlap"


@dataclass(frozen=True)
class PublishedRun:
    name: str
    gpu: str
    world_size: int
    schedule: str  # the plugin's name for what Megatron runs (vp > 1: interleaved)
    argv: str
    tokens_per_s_per_gpu: float
    tflops_per_gpu: float
    source: str  # the summary's release

    @property
    def flops_per_token(self) -> float:
        """The summary's model FLOPs per token: its TFLOP/s over its tokens/s per GPU."""
        return self.tflops_per_gpu * 1e12 / self.tokens_per_s_per_gpu

    @property
    def args(self) -> list[str]:
        return shlex.split(self.argv)


RUNS = [
    PublishedRun("Llama3 70B", "H100", 64, "interleaved",
                 LLAMA3_70B + " --tensor-model-parallel-size 4 --sequence-parallel "
                 "--pipeline-model-parallel-size 8 --num-virtual-stages-per-pipeline-rank 5 "
                 "--global-batch-size 256" + _TP_OVERLAP, 1633, 734, "26.04 (DGX-H100, FP8-CS)"),
    PublishedRun("Llama3.1 405B", "H100", 1024, "interleaved",
                 LLAMA31_405B + " --tensor-model-parallel-size 8 --sequence-parallel "
                 "--context-parallel-size 2 --pipeline-model-parallel-size 8 "
                 "--num-virtual-stages-per-pipeline-rank 8 --global-batch-size 1536"
                 + _TP_OVERLAP, 328, 827, "26.04.01 (DGX-H100, FP8-CS)"),
    PublishedRun("Llama3.1 405B", "B200", 128, "interleaved",
                 LLAMA31_405B + " --tensor-model-parallel-size 4 --sequence-parallel "
                 "--context-parallel-size 2 --pipeline-model-parallel-size 8 "
                 "--num-virtual-stages-per-pipeline-rank 8 --global-batch-size 64"
                 + _TP_OVERLAP, 661, 1667, "25.11 (DGX-B200, FP8-CS)"),
    PublishedRun("Qwen3 30B-A3B (MoE)", "H100", 16, "1f1b",
                 QWEN3_30B_A3B + _COMMON.format(s=4096, b=1)
                 + " --tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 "
                 "--expert-model-parallel-size 16 --global-batch-size 1024", 8826, 203,
                 "26.06 (DGX-H100, FP8-CS)"),
]

#: The models of the summary's rows the planner can express, without the precision and
#: parallelism flags (``_speed_row`` adds those)
_MODELS = {
    "Llama3 8B": (LLAMA3_8B.split(" --disable-bias-linear")[0], 8192),
    "Llama3 70B": (LLAMA3_70B.split(" --disable-bias-linear")[0], 8192),
    "Llama3.1 405B": (LLAMA31_405B.split(" --disable-bias-linear")[0], 8192),
    "Qwen3 30B-A3B": (QWEN3_30B_A3B.strip(), 4096),
    "Qwen3 235B-A22B": (QWEN3_235B_A22B.strip(), 4096),
}
#: Every H100 and B200 pretraining row of the summary and its archive (at 067f987df03b) whose
#: model the planner can express: (id as docs/planning.md numbers the archive's rows, release,
#: model, GPU, GPUs, FP8 recipe ("cs" tensorwise, "mx" MXFP8), global batch, micro batch, tp, pp,
#: cp, vp, ep, --tp-comm-overlap, published tokens/s/GPU, TFLOP/s/GPU). The release's recipe
#: sets the rest: distributed optimizer, overlapped gradient reduce and parameter gather, no
#: recompute, dropless force-balanced experts. R32 is written as its release's configuration
#: (pp 1, ep 16: the summary prints R41's, and its speed is R10's, not R41's); R49 and R54 as
#: printed (their release's files say vp 4, and mbs 1 / vp 12).
SPEED_ROWS = [
    ("R01", "26.06", "Llama3.1 405B", "H100", 1024, "cs", 1536, 1, 8, 8, 2, 8, 1, True, 326, 822),
    ("R02", "26.06", "Qwen3 30B-A3B", "H100", 16, "cs", 1024, 1, 1, 1, 1, 1, 16, False, 8826, 203),
    ("R04", "26.04.01", "Llama3 70B", "H100", 64, "cs", 256, 1, 4, 8, 1, 5, 1, True, 1664, 731),
    ("R05", "26.04.01", "Llama3.1 405B", "H100", 1024, "cs", 1536, 1, 8, 8, 2, 8, 1, True, 328,
     827),
    ("R09", "26.04.01", "Qwen3 30B-A3B", "B200", 8, "mx", 512, 4, 1, 1, 1, 1, 8, False, 27136, 619),
    ("R10", "26.04.01", "Qwen3 30B-A3B", "H100", 16, "cs", 1024, 1, 1, 1, 1, 1, 16, False, 8960,
     206),
    ("R11", "26.04.01", "Qwen3 235B-A22B", "B200", 256, "mx", 8192, 1, 1, 8, 1, 1, 8, False, 3776,
     560),
    ("R12", "26.04.01", "Qwen3 235B-A22B", "H100", 256, "cs", 8192, 1, 2, 8, 1, 4, 32, False, 1712,
     253),
    ("R17", "26.04", "Llama3 70B", "H100", 64, "cs", 256, 1, 4, 8, 1, 5, 1, True, 1633, 734),
    ("R21", "26.04", "Qwen3 30B-A3B", "B200", 8, "mx", 512, 4, 1, 1, 1, 1, 8, False, 26859, 618),
    ("R22", "26.04", "Qwen3 30B-A3B", "H100", 16, "cs", 1024, 1, 1, 1, 1, 1, 16, False, 8901, 205),
    ("R23", "26.04", "Qwen3 235B-A22B", "H100", 256, "cs", 8192, 1, 2, 8, 1, 4, 32, False, 1686,
     250),
    ("R27", "26.02.01", "Llama3 70B", "H100", 64, "cs", 256, 1, 4, 8, 1, 5, 1, True, 1639, 736),
    ("R31", "26.02.01", "Qwen3 30B-A3B", "B200", 8, "mx", 512, 4, 1, 1, 1, 1, 8, False, 26695, 614),
    ("R32", "26.02.01", "Qwen3 30B-A3B", "H100", 16, "cs", 1024, 1, 1, 1, 1, 1, 16, False, 9058,
     208),
    ("R33", "26.02.01", "Qwen3 235B-A22B", "H100", 256, "cs", 8192, 1, 2, 8, 1, 4, 32, False, 1611,
     238),
    ("R35", "26.02", "Llama3 70B", "H100", 64, "cs", 256, 1, 4, 8, 1, 5, 1, True, 1621, 728),
    ("R36", "26.02", "Llama3.1 405B", "H100", 1024, "cs", 1536, 1, 8, 8, 2, 8, 1, True, 311, 784),
    ("R40", "26.02", "Qwen3 30B-A3B", "B200", 8, "mx", 512, 1, 1, 1, 1, 1, 8, False, 9691, 223),
    ("R41", "26.02", "Qwen3 30B-A3B", "H100", 16, "cs", 1024, 1, 1, 2, 1, 12, 8, False, 5113, 118),
    ("R42", "26.02", "Qwen3 235B-A22B", "B200", 256, "mx", 8192, 1, 1, 8, 1, 1, 8, False, 3805,
     563),
    ("R43", "26.02", "Qwen3 235B-A22B", "H100", 256, "cs", 8192, 1, 2, 8, 1, 4, 32, False, 1633,
     242),
    ("R44", "25.11", "Llama3 8B", "B200", 8, "cs", 128, 2, 1, 1, 1, 1, 1, False, 30624, 1576),
    ("R45", "25.11", "Llama3.1 405B", "B200", 128, "cs", 64, 1, 4, 8, 2, 8, 1, True, 661, 1667),
    ("R48", "25.11", "Qwen3 30B-A3B", "B200", 8, "mx", 512, 1, 1, 1, 1, 1, 8, False, 9299, 214),
    ("R49", "25.11", "Qwen3 235B-A22B", "B200", 64, "mx", 1024, 1, 1, 8, 1, 2, 8, False, 3269, 484),
    ("R51", "25.11", "Llama3 70B", "H100", 64, "cs", 128, 1, 4, 8, 1, 5, 1, True, 1602, 719),
    ("R52", "25.11", "Llama3.1 405B", "H100", 1024, "cs", 512, 1, 8, 8, 2, 8, 1, True, 292, 737),
    ("R54", "25.11", "Qwen3 30B-A3B", "H100", 16, "cs", 512, 2, 1, 2, 1, 24, 8, False, 5275, 121),
    ("R55", "25.11", "Qwen3 235B-A22B", "H100", 256, "cs", 2048, 1, 2, 8, 1, 4, 32, False, 1575,
     233),
    ("R56", "25.09", "Llama3 8B", "B200", 8, "cs", 128, 2, 1, 1, 1, 1, 1, False, 29994, 1544),
    ("R57", "25.09", "Llama3.1 405B", "B200", 128, "cs", 64, 1, 4, 8, 2, 8, 1, True, 664, 1676),
    ("R62", "25.09", "Llama3 70B", "H100", 64, "cs", 128, 1, 4, 8, 1, 5, 1, True, 1619, 727),
    ("R63", "25.09", "Llama3.1 405B", "H100", 1024, "cs", 512, 1, 8, 8, 2, 8, 1, True, 302, 763),
]
#: The row each GPU kind's GEMM share is fitted on (``step_terms.CALIBRATION``)
CALIBRATION_ROWS = {"H100": "R17", "B200": "R45"}


def _speed_row(row: tuple) -> PublishedRun:
    (rid, release, model, gpu, gpus, recipe, gbs, mbs, tp, pp, cp, vp, ep, overlap, tokens,
     tflops) = row
    arch, seq = _MODELS[model]
    precision = _COMMON if recipe == "cs" else _MXFP8
    argv = (f"{arch} {precision.format(s=seq, b=mbs)} --tensor-model-parallel-size {tp} "
            f"--pipeline-model-parallel-size {pp} --context-parallel-size {cp} "
            f"--expert-model-parallel-size {ep} --global-batch-size {gbs}")
    argv += " --sequence-parallel" if tp > 1 else ""
    argv += f" --num-virtual-stages-per-pipeline-rank {vp}" if vp > 1 else ""
    argv += _TP_OVERLAP if overlap else ""
    return PublishedRun(f"{rid} {model}", gpu, gpus, "interleaved" if vp > 1 else "1f1b", argv,
                        tokens, tflops, f"{release} (DGX-{gpu}, {'MX' if recipe == 'mx' else ''}"
                        f"FP8{'-CS' if recipe == 'cs' else ''})")


SPEED_RUNS = [_speed_row(row) for row in SPEED_ROWS]


def planned(run: PublishedRun):
    """(``plan``'s plan of the run, its FLOPs per token as Megatron counts them)."""
    from megatron_pp_ext.planner.model_shape import model_shape
    from megatron_pp_ext.planner.pretrain_args import parse_pretrain_args
    from megatron_pp_ext.planner.pretrain_plan import plan_pretrain
    from megatron_pp_ext.planner.stage_flops import step_flops

    plan = plan_pretrain(run.args, schedule=run.schedule, world_size=run.world_size,
                         gpu=run.gpu)
    shape = model_shape(parse_pretrain_args(run.args))
    tokens = plan.global_batch * shape.seq
    return plan, step_flops(shape, plan.stages, plan.m, plan.dp) / tokens


def predicted_speed(run: PublishedRun) -> tuple[float, object]:
    """(``plan``'s tokens/s per GPU for the run on its GPU's DGX, the plan)."""
    from megatron_pp_ext.planner.pretrain_plan import plan_pretrain

    plan = plan_pretrain(run.args, schedule=run.schedule, world_size=run.world_size,
                         gpu=run.gpu)
    return plan.tokens_per_s_per_gpu, plan


@contextlib.contextmanager
def gemm_share_of(run: PublishedRun, share: float):
    """The planner priced with ``share`` as the run's GPU kind and precision's constant."""
    from megatron_pp_ext.planner import step_terms

    key = calibration_key(run)
    kept = step_terms.CALIBRATION[key]
    step_terms.CALIBRATION[key] = (share, f"a trial share for {run.name}")
    try:
        yield
    finally:
        step_terms.CALIBRATION[key] = kept


def calibration_key(run: PublishedRun) -> str:
    from megatron_pp_ext.planner.step_terms import calibration_kind

    return calibration_kind(run.gpu)


def fitted_share(run: PublishedRun) -> float:
    """The GEMMs' share of the peak at which ``plan`` predicts the run's published tokens/s
    (bisection: the prediction grows with the share)."""
    low, high = 0.05, 1.0
    for _ in range(40):
        middle = (low + high) / 2
        with gemm_share_of(run, middle):
            speed, _ = predicted_speed(run)
        low, high = (middle, high) if speed < run.tokens_per_s_per_gpu else (low, middle)
    return (low + high) / 2


_PREDICTED: dict = {}


def predicted(run: PublishedRun) -> tuple[float, object]:
    """``predicted_speed`` once per configuration and calibration (rows of several releases
    share one)."""
    from megatron_pp_ext.planner.step_terms import CALIBRATION

    key = (run.argv, run.gpu, run.world_size, run.schedule,
           CALIBRATION[calibration_key(run)])
    if key not in _PREDICTED:
        _PREDICTED[key] = predicted_speed(run)
    return _PREDICTED[key]


def speed_error(run: PublishedRun) -> float:
    """The plan's tokens/s per GPU over the published, less one."""
    return predicted(run)[0] / run.tokens_per_s_per_gpu - 1


def speed_table() -> str:
    """Per row: its configuration, published and predicted tokens/s per GPU, the error, the
    busiest rank's step by term."""
    rows = ["| row | GPUs | tp/pp/cp/vp/ep, GBS/MBS | published tokens/s/GPU | plan's | off by "
            "| busiest rank's step, s |", "|---|---|---|---|---|---|---|"]
    for run in SPEED_RUNS:
        speed, plan = predicted(run)
        terms = plan.step_terms()
        shown = ", ".join(f"{k} {v:.3g}" for k, v in terms.items()
                          if k != "rank" and v >= 0.005)
        ep = _flag(run.args, "--expert-model-parallel-size", "1")
        rows.append(f"| {run.name} ({run.source}) | {run.world_size} {run.gpu} | "
                    f"{plan.tp}/{plan.pp}/{plan.cp}/{plan.v}/{ep}, {plan.global_batch}/"
                    f"{_flag(run.args, '--micro-batch-size', '1')} | "
                    f"{run.tokens_per_s_per_gpu:g} | {speed:.0f} | "
                    f"{100 * speed_error(run):+.1f}% | {shown} |")
    return "\n".join(rows)


def _flag(args: list[str], flag: str, default: str) -> str:
    return args[args.index(flag) + 1] if flag in args else default


def table() -> str:
    from megatron_pp_ext.units import human_bytes

    rows = ["| run | GPUs | tp/pp/cp/vp/ep | published tokens/s/GPU, TFLOP/s/GPU | their FLOPs "
            "per token | plan's | plan's most loaded rank (of the GPU's memory, "
            "4 GiB reserve) | fits |", "|---|---|---|---|---|---|---|---|"]
    for run in RUNS:
        plan, per_token = planned(run)
        worst = max(plan.memory, key=lambda rank: rank.total + rank.reserve)
        ep = _flag(run.args, "--expert-model-parallel-size", "1")
        rows.append(
            f"| {run.name} ({run.source}) | {run.world_size} {run.gpu} | {plan.tp}/{plan.pp}/"
            f"{plan.cp}/{plan.v}/{ep} | {run.tokens_per_s_per_gpu:g}, {run.tflops_per_gpu:g} | "
            f"{run.flops_per_token:.4g} | {per_token:.4g} "
            f"({100 * (per_token / run.flops_per_token - 1):+.2f}%) | "
            f"{human_bytes(worst.total)} + reserve of {human_bytes(worst.budget)} | "
            f"{'yes' if all(rank.fits for rank in plan.memory) else 'NO'} |")
    return "\n".join(rows)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    print(table())
    print()
    print(speed_table())
