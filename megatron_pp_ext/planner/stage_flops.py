"""F, I and W of each pipeline stage from the model's FLOPs, and seconds from a GPU's peak.

Counted as Megatron-LM counts a step's FLOPs (``megatron.training.training.
num_floating_point_operations``, which ``tests/test_model_costs.py`` holds these to): per
token, 2 FLOPs per weight of every GEMM (QKV with the query groups, the output projection, the
MLP's 2 or 3 matrices with SwiGLU, the k routed experts and the shared ones of a MoE layer,
the output layer over the padded vocabulary, an MTP layer's projection), and the core
attention (QK^T and softmax V) at 2 s d a FLOPs per token (causal: half of the s x s scores).
Split as the GEMMs split: a backward computes each GEMM's input gradient (I) and its weight
gradient (W) at the forward's cost each; the core attention has no weight, so its backward (2x
its forward) is all I. Recompute adds to I what it runs again: the whole forward under
``--recompute-granularity full``, the core attention under ``selective``.

Per rank: GEMMs and attention heads split over tp (with balanced routing a rank's share of
the routed experts' work is 1/tp too, whatever ep and etp), tokens over cp. Seconds = FLOPs /
(the GPU's dense peak x an assumed efficiency); fp8 (``--fp8-format``) runs the GEMMs at the
fp8 peak.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from .gpus import Gpu

if TYPE_CHECKING:  # the shape's module reads Megatron's arguments: not loaded to price stages
    from .model_shape import ModelShape
    from ..integration.stage_layers import StageLayers


@dataclass(frozen=True)
class StageFlops:
    """One microbatch through one stage on one rank, in FLOPs."""

    f: float
    i: float
    w: float
    gemm: float  # of f: the weight GEMMs (the fp8 part under --fp8-format)
    recomputed_gemm: float = 0.0  # of i: the weight GEMMs of a recomputed forward

    @property
    def total(self) -> float:
        return self.f + self.i + self.w


def stage_flops(shape: "ModelShape", stage: "StageLayers", recompute: str = "none",
                recomputed_layers: int | None = None) -> StageFlops:
    """F, I, W FLOPs of one microbatch through ``stage`` on one of its tp x cp ranks.
    ``recomputed_layers``: under full recompute, how many of the stage's decoder layers run
    their forward again before the backward (``--recompute-method block``: the first n of
    each chunk; None: all of them, as ``uniform`` does)."""
    gemm = core = 0.0
    recomputed_gemm = recomputed_core = 0.0  # what full recompute runs again
    for k, layer in enumerate(stage.layer_ids):
        g, c = _layer_flops(shape, shape.moe_layers[layer])
        gemm, core = gemm + g, core + c
        if recomputed_layers is None or k < recomputed_layers:
            recomputed_gemm, recomputed_core = recomputed_gemm + g, recomputed_core + c
    t, tokens, h = shape.tp, shape.tokens, shape.hidden
    last_is_moe = bool(shape.moe_layers and shape.moe_layers[-1])
    for _ in range(stage.mtp):  # a transformer layer, its norms and projection, its logits
        g, c = _layer_flops(shape, last_is_moe)
        gemm += g + 2 * tokens * (3 * h + 2 * h * h) / t + 2 * tokens * h * shape.vocab / t
        core += c
    if stage.loss:
        gemm += 2 * tokens * h * shape.vocab / t
    forward = gemm + core
    backward_input = gemm + 2 * core
    if recompute != "full":
        recomputed_gemm = 0.0
        recomputed_core = core if recompute == "selective" else 0.0
    # full: the decoder layers' forward again (the output layer is not in it)
    backward_input += recomputed_gemm + recomputed_core
    return StageFlops(f=forward, i=backward_input, w=gemm, gemm=gemm,
                      recomputed_gemm=recomputed_gemm)


def _layer_flops(shape: "ModelShape", moe: bool) -> tuple[float, float]:
    """(weight-GEMM FLOPs, core-attention FLOPs) of one layer's forward on one rank."""
    tokens, h, t = shape.tokens, shape.hidden, shape.tp
    q, kv = shape.query_size, shape.kv_size
    attention = 2 * tokens * (h * (q + 2 * kv) + q * h) / t
    core = 2 * tokens * shape.seq * q / t  # QK^T and softmax V, causal half: 2 x 2 x s q / 2
    if moe:
        # balanced routing: a rank computes its tokens' k expert MLPs, however ep and etp
        # spread the experts (a tp group's tokens are dispatched together)
        routed = 2 * tokens * h * shape.moe_ffn * shape.mlp_matrices * shape.topk / t
        mlp = routed + 2 * tokens * h * shape.shared_ffn * shape.mlp_matrices / t
    else:
        mlp = 2 * tokens * h * shape.ffn * shape.mlp_matrices / t
    return attention + mlp, core


def stage_seconds(flops: StageFlops, gpu: Gpu, efficiency: float, fp8: bool) -> tuple:
    """(t_F, t_I, t_W) in seconds: the GEMMs at the fp8 or bf16 peak, the rest at bf16."""
    if not 0 < efficiency <= 1:
        raise ValueError(f"--efficiency {efficiency}: give the share of the GPU's peak a step "
                         "reaches, 0 < e <= 1 (e.g. 0.5)")
    gemm_rate = (gpu.fp8_flops if fp8 else gpu.bf16_flops) * efficiency
    other_rate = gpu.bf16_flops * efficiency

    def seconds(total: float, gemm: float) -> float:
        return gemm / gemm_rate + (total - gemm) / other_rate

    # a recomputed forward runs its GEMMs at the forward's rate (fp8 under --fp8-format)
    return (seconds(flops.f, flops.gemm), seconds(flops.i, flops.gemm + flops.recomputed_gemm),
            seconds(flops.w, flops.w))


def per_stage_seconds(shape: "ModelShape", stages: Sequence["StageLayers"], recompute: str,
                      gpu: Gpu, efficiency: float,
                      recomputed_layers: int | None = None) -> dict[str, list[float]]:
    """``{"t_f": [...], "t_i": [...], "t_w": [...]}``, one number per stage, in seconds (what
    ``CostModel.for_stages`` takes)."""
    costs: dict[str, list[float]] = {"t_f": [], "t_i": [], "t_w": []}
    for stage in stages:
        f, i, w = stage_seconds(stage_flops(shape, stage, recompute, recomputed_layers), gpu,
                                efficiency, shape.fp8)
        costs["t_f"].append(f)
        costs["t_i"].append(i)
        costs["t_w"].append(w)
    return costs


def step_flops(shape: "ModelShape", stages: Sequence["StageLayers"], num_microbatches: int,
               dp: int) -> float:
    """The whole step's FLOPs over every rank (no recompute), comparable with Megatron's
    ``num_floating_point_operations(args, global_batch)``."""
    per_rank = sum(stage_flops(shape, stage).total for stage in stages)
    return per_rank * shape.tp * shape.cp * num_microbatches * dp


__all__ = ["StageFlops", "per_stage_seconds", "stage_flops", "stage_seconds", "step_flops"]
