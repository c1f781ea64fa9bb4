"""What a rank holds for the whole step, whatever the schedule: its stages' weights, their
gradients and the optimizer state, in bytes.

Parameters per stage are counted as Megatron-LM's ``theoretical_memory_usage.
compute_weight_and_optimizer_memory`` counts them (``tests/test_model_costs.py`` holds the first
stage to it), per stage rather than per average stage: a layer's QKV (with the query groups)
and output projection, its MLP (3 matrices with SwiGLU) or its MoE block (routed experts over
ep x etp, shared experts, the router), two norms; linear biases with ``--add-bias-linear``
(Megatron's default, which its estimate leaves out); the word embeddings (and a learned
position table) on the embedding stage, the final norm and the output layer on the loss stage
(its own matrix, or the copy of the tied embeddings that Megatron keeps there when the two
are on different stages); MTP layers as transformer layers. tp shards the matrices, not the
norms or the router.

Bytes per parameter (Megatron's mixed precision, Adam): 16-bit weights 2, fp32 main
gradients 4 (Megatron accumulates bf16 gradients in fp32; fp16 ones only with
``--accumulate-allreduce-grads-in-fp32``), fp32 master weights 4 and Adam's two moments 8;
``--use-distributed-optimizer`` shards the last 12 over the data-parallel ranks (with cp), the
expert parameters over the expert data-parallel ranks. In fp32 there is no master copy.
Not counted: the CUDA context, NCCL's and the allocator's buffers, Transformer Engine's
workspaces, the data loader.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .model_shape import ModelShape
from .stage_layers import StageLayers


@dataclass(frozen=True)
class StageParams:
    """Parameters of one stage held by one of its tp ranks."""

    dense: float  # tp-sharded matrices and the replicated norms and router
    expert: float  # routed experts, sharded over ep x etp

    @property
    def total(self) -> float:
        return self.dense + self.expert


def stage_params(shape: ModelShape, stage: StageLayers, shares_tied_copy: bool) -> StageParams:
    """``shares_tied_copy``: the loss stage is also the embedding stage and the embeddings are
    tied, so the output layer has no matrix of its own."""
    dense = expert = 0.0
    for layer in stage.layer_ids:
        d, e = _layer_params(shape, shape.moe_layers[layer])
        dense, expert = dense + d, expert + e
    h, t = shape.hidden, shape.tp
    last_is_moe = bool(shape.moe_layers and shape.moe_layers[-1])
    for _ in range(stage.mtp):
        d, e = _layer_params(shape, last_is_moe)
        dense, expert = dense + d, expert + e
    if stage.embedding:
        dense += shape.vocab * h / t + shape.position_table * h
    if stage.loss:
        dense += shape.norm_params * h
        if shape.untied or not (stage.embedding and shares_tied_copy):
            dense += shape.vocab * h / t
    return StageParams(dense, expert)


def _layer_params(shape: ModelShape, moe: bool) -> tuple[float, float]:
    h, t, m = shape.hidden, shape.tp, shape.mlp_matrices
    q, kv = shape.query_size, shape.kv_size
    attention = (h * (q + 2 * kv) + q * h) / t
    norms = 2 * h * shape.norm_params
    if shape.bias:
        attention += (q + 2 * kv) / t + h
    if not moe:
        mlp = m * h * shape.ffn / t + ((m - 1) * shape.ffn / t + h if shape.bias else 0)
        return attention + norms + mlp, 0.0
    router = h * shape.experts + (shape.experts if shape.bias else 0)
    shared = m * h * shape.shared_ffn / t
    routed = shape.experts * m * h * shape.moe_ffn / (shape.ep * shape.etp)
    return attention + norms + router + shared, routed


@dataclass(frozen=True)
class BytesPerParam:
    weight: int
    grad: int
    optimizer: int  # before any sharding

    def of(self, params: StageParams, dp_shards: int, expert_dp_shards: int) -> int:
        """Bytes for ``params`` with the optimizer state split over the given shards."""
        kept = self.weight + self.grad
        return int(round(params.dense * (kept + self.optimizer / dp_shards)
                         + params.expert * (kept + self.optimizer / expert_dp_shards)))


def bytes_per_param(args: Any) -> tuple[BytesPerParam, str]:
    """Megatron's bytes per parameter for these arguments, and the rule in words."""
    half = bool(getattr(args, "bf16", False) or getattr(args, "fp16", False))
    fp32_grads = (not half or bool(getattr(args, "bf16", False))
                  or bool(getattr(args, "accumulate_allreduce_grads_in_fp32", False)))
    optimizer = str(getattr(args, "optimizer", "adam") or "adam")
    states = 2 if optimizer.startswith("adam") else 1  # Adam: two moments; SGD: momentum
    opt = 4 * states + (4 if half else 0)  # + the fp32 master copy of 16-bit weights
    result = BytesPerParam(2 if half else 4, 4 if fp32_grads else 2, opt)
    words = (f"{result.weight} B weights + {result.grad} B gradients + {result.optimizer} B "
             f"optimizer state ({optimizer}{', fp32 master weights' if half else ''})")
    return result, words


__all__ = ["BytesPerParam", "StageParams", "bytes_per_param", "stage_params"]
