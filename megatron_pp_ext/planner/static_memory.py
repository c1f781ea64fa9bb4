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

Bytes per parameter, as Megatron-LM's arguments set them (``validate_args``, the DDP grad
buffer, the distributed optimizer, Transformer Engine's fp8 weights):

* weights: 16-bit 2 (fp32 4). Under fp8 (``--fp8-format``) the transformer layers' GEMM
  weights also have Transformer Engine's fp8 copies, kept from a step's first microbatch to its
  last (``is_first_microbatch``: the weight workspaces), one for the forward (row-wise) and one
  for the input gradient (column-wise, the transpose, on Hopper only; MXFP8 keeps both
  everywhere): 2 more (Blackwell, delayed or tensorwise: 1); with ``--fp8-param-gather`` the
  parameters are themselves fp8 tensors (Transformer Engine's ``fp8_model_init``) holding the
  same copies, with no 16-bit one. MXFP8 adds a scale per 32 elements to each.
* gradients (the DDP grad buffer): fp32 4 when Megatron accumulates in fp32, which
  ``validate_args`` turns on for bf16 unless ``--grad-reduce-in-bf16`` or a bf16
  ``--main-grads-dtype``; fp16 ones only with ``--accumulate-allreduce-grads-in-fp32``;
  else the weights' 2.
* optimizer state: the master copy of 16-bit weights 4 (``--main-params-dtype fp16``: 2) and
  Adam's two moments 4 each (``--exp-avg-dtype`` / ``--exp-avg-sq-dtype``: bf16 or fp16 2, fp8
  1); the dtype flags take effect only with ``--use-precision-aware-optimizer``.
  ``--use-distributed-optimizer`` shards it over the data-parallel ranks (with cp), the expert
  parameters over the expert data-parallel ranks. In fp32 there is no master copy.

Not counted here: the CUDA context, NCCL's and the allocator's buffers (the plan's reserve,
``--reserve``), Transformer Engine's GEMM workspaces, the data loader.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .gpus import Gpu
from .model_shape import ModelShape, fp8_element_bytes, fp8_recipe
from ..integration.stage_layers import StageLayers


@dataclass(frozen=True)
class StageParams:
    """Parameters of one stage held by one of its tp ranks."""

    dense: float  # tp-sharded matrices and the replicated norms and router
    expert: float  # routed experts, sharded over ep x etp (all GEMM weights)
    dense_gemm: float = 0.0  # of dense: the transformer layers' GEMM weights (fp8 under fp8)

    @property
    def total(self) -> float:
        return self.dense + self.expert


def stage_params(shape: ModelShape, stage: StageLayers, shares_tied_copy: bool) -> StageParams:
    """``shares_tied_copy``: the loss stage is also the embedding stage and the embeddings are
    tied, so the output layer has no matrix of its own."""
    dense = expert = gemm = 0.0
    last_is_moe = bool(shape.moe_layers and shape.moe_layers[-1])
    layers = [shape.moe_layers[layer] for layer in stage.layer_ids] + [last_is_moe] * stage.mtp
    for moe in layers:
        d, e, g = _layer_params(shape, moe)
        dense, expert, gemm = dense + d, expert + e, gemm + g
    h, t = shape.hidden, shape.tp
    if stage.embedding:
        dense += shape.vocab * h / t + shape.position_table * h
    if stage.loss:
        dense += shape.norm_params * h
        if shape.untied or not (stage.embedding and shares_tied_copy):
            dense += shape.vocab * h / t
    return StageParams(dense, expert, gemm)


def _layer_params(shape: ModelShape, moe: bool) -> tuple[float, float, float]:
    """(dense, expert, the dense part's GEMM weights) of one layer on one tp rank."""
    h, t, m = shape.hidden, shape.tp, shape.mlp_matrices
    q, kv = shape.query_size, shape.kv_size
    attention = (h * (q + 2 * kv) + q * h) / t
    gemm = attention
    norms = 2 * h * shape.norm_params
    if shape.bias:
        attention += (q + 2 * kv) / t + h
    if not moe:
        gemm += m * h * shape.ffn / t
        mlp = m * h * shape.ffn / t + ((m - 1) * shape.ffn / t + h if shape.bias else 0)
        return attention + norms + mlp, 0.0, gemm
    router = h * shape.experts + (shape.experts if shape.bias else 0)
    shared = m * h * shape.shared_ffn / t
    routed = shape.experts * m * h * shape.moe_ffn / (shape.ep * shape.etp)
    return attention + norms + router + shared, routed, gemm + shared


@dataclass(frozen=True)
class BytesPerParam:
    weight: float
    grad: float
    optimizer: float  # before any sharding
    gemm_weight: float | None = None  # a GEMM weight's (fp8: see the module docstring)

    def of(self, params: StageParams, dp_shards: int, expert_dp_shards: int) -> int:
        """Bytes for ``params`` with the optimizer state split over the given shards."""
        gemm_weight = self.weight if self.gemm_weight is None else self.gemm_weight
        kept = self.weight + self.grad
        gemm_extra = gemm_weight - self.weight  # fp8 copies (or fp8 in place of 16-bit)
        return int(round(params.dense * (kept + self.optimizer / dp_shards)
                         + params.dense_gemm * gemm_extra
                         + params.expert * (kept + gemm_extra
                                            + self.optimizer / expert_dp_shards)))


#: bytes per element of Megatron's dtype names (``--exp-avg-dtype fp8``: uint8, scaled)
DTYPE_BYTES = {"fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2,
               "fp8": 1, "uint8": 1}


def _dtype_bytes(value: Any, default: int = 4) -> int:
    """Bytes of a dtype flag's value: a name (the parser's) or a torch.dtype (validated)."""
    if value is None:
        return default
    name = str(value).replace("torch.", "")
    if name not in DTYPE_BYTES:
        raise ValueError(f"the plan does not know the dtype {value!r}")
    return DTYPE_BYTES[name]


def bytes_per_param(args: Any, gpu: Gpu | None = None) -> tuple[BytesPerParam, str]:
    """Megatron's bytes per parameter for these arguments on ``gpu`` (None: a Hopper, whose
    fp8 weights keep a transposed copy), and the rule in words."""
    bf16, fp16 = bool(getattr(args, "bf16", False)), bool(getattr(args, "fp16", False))
    half = bf16 or fp16
    aware = bool(getattr(args, "use_precision_aware_optimizer", False))
    flag_bytes = lambda flag: _dtype_bytes(getattr(args, flag, None)) if aware else 4  # noqa: E731
    if not half:
        grad = 4
    elif bf16:  # validate_args: fp32 accumulation unless asked for bf16 gradients
        fp32 = (bool(getattr(args, "accumulate_allreduce_grads_in_fp32", False))
                or (not getattr(args, "grad_reduce_in_bf16", False)
                    and flag_bytes("main_grads_dtype") == 4))
        grad = 4 if fp32 else 2
    else:
        grad = 4 if getattr(args, "accumulate_allreduce_grads_in_fp32", False) else 2
    optimizer = str(getattr(args, "optimizer", "adam") or "adam")
    adam = optimizer.startswith("adam")
    states = flag_bytes("exp_avg_dtype") + (flag_bytes("exp_avg_sq_dtype") if adam else 0)
    recipe = fp8_recipe(args)
    master, master_words = (flag_bytes("main_params_dtype") if half else 0), ""
    if (aware and bf16 and master == 4 and recipe in ("", "delayed")
            and getattr(args, "store_param_remainders", True)):
        # Transformer Engine's FusedAdam keeps the fp32 master as the bf16 weight and a
        # 16-bit remainder (store_param_remainders, Megatron's default)
        master, master_words = 2, " (fp32 as the bf16 weight and a 2 B remainder)"
    weight = 2 if half else 4
    gemm_weight, fp8_words = None, ""
    if recipe:
        e = float(fp8_element_bytes(recipe))
        # the forward's row-wise copy, and the input gradient's column-wise one where the
        # GPU keeps it (Hopper; MXFP8 scales the two directions apart, so keeps both)
        copies = 2 if recipe == "mxfp8" or gpu is None or gpu.fp8_transpose else 1
        if getattr(args, "fp8_param_gather", False):
            gemm_weight = copies * e
            fp8_words = (f"; GEMM weights {gemm_weight:g} B: fp8 parameters, {copies} "
                         "cop" + ("ies" if copies > 1 else "y") + " (--fp8-param-gather)")
        else:
            gemm_weight = weight + copies * e
            fp8_words = (f"; GEMM weights {gemm_weight:g} B: {weight} B and Transformer "
                         f"Engine's {copies} fp8 cop" + ("ies" if copies > 1 else "y"))
    result = BytesPerParam(weight, grad, master + states, gemm_weight)
    moments = "two moments" if adam else "momentum"
    words = (f"{result.weight} B weights + {result.grad} B gradients + {result.optimizer:g} B "
             f"optimizer state ({optimizer}: {moments}"
             + (f", {master} B master weights{master_words}" if half else "") + ")" + fp8_words)
    return result, words


__all__ = ["BytesPerParam", "StageParams", "bytes_per_param", "stage_params"]
