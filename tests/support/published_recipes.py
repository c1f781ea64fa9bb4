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

import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

_COMMON = ("--seq-length {s} --max-position-embeddings {s} --position-embedding-type rope "
           "--normalization RMSNorm --disable-bias-linear --untie-embeddings-and-output-weights "
           "--swiglu --group-query-attention --micro-batch-size 1 --bf16 --fp8-format hybrid "
           "--fp8-recipe tensorwise --fp8-param-gather --grad-reduce-in-bf16 "
           "--use-distributed-optimizer --tokenizer-type NullTokenizer --mock-data "
           "--train-iters 10 --lr 1e-4")
LLAMA3_70B = ("--num-layers 80 --hidden-size 8192 --ffn-hidden-size 28672 "
              "--num-attention-heads 64 --num-query-groups 8 --vocab-size 128256 "
              + _COMMON.format(s=8192))
LLAMA31_405B = ("--num-layers 126 --hidden-size 16384 --ffn-hidden-size 53248 "
                "--num-attention-heads 128 --num-query-groups 8 --vocab-size 128256 "
                "--account-for-embedding-in-pipeline-split --account-for-loss-in-pipeline-split "
                + _COMMON.format(s=8192))
QWEN3_30B_A3B = ("--num-layers 48 --hidden-size 2048 --ffn-hidden-size 6144 "
                 "--num-attention-heads 32 --num-query-groups 4 --kv-channels 128 "
                 "--qk-layernorm --num-experts 128 --moe-router-topk 8 --moe-ffn-hidden-size 768 "
                 "--moe-grouped-gemm --vocab-size 151936 " + _COMMON.format(s=4096))


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
                 "--global-batch-size 256", 1633, 734, "26.04 (DGX-H100, FP8-CS)"),
    PublishedRun("Llama3.1 405B", "H100", 1024, "interleaved",
                 LLAMA31_405B + " --tensor-model-parallel-size 8 --sequence-parallel "
                 "--context-parallel-size 2 --pipeline-model-parallel-size 8 "
                 "--num-virtual-stages-per-pipeline-rank 8 --global-batch-size 1536",
                 328, 827, "26.04.01 (DGX-H100, FP8-CS)"),
    PublishedRun("Llama3.1 405B", "B200", 128, "interleaved",
                 LLAMA31_405B + " --tensor-model-parallel-size 4 --sequence-parallel "
                 "--context-parallel-size 2 --pipeline-model-parallel-size 8 "
                 "--num-virtual-stages-per-pipeline-rank 8 --global-batch-size 64",
                 661, 1667, "25.11 (DGX-B200, FP8-CS)"),
    PublishedRun("Qwen3 30B-A3B (MoE)", "H100", 16, "1f1b",
                 QWEN3_30B_A3B + " --tensor-model-parallel-size 1 "
                 "--pipeline-model-parallel-size 1 --expert-model-parallel-size 16 "
                 "--global-batch-size 1024", 8826, 203, "26.06 (DGX-H100, FP8-CS)"),
]


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
