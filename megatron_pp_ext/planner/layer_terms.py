"""F, I and W of one microbatch through one stage on one rank, in seconds, by term: the GEMMs,
the core attention, the element-wise kernels, and what tensor, context and expert parallelism
send inside the layer (``kernel_time`` prices the kernels, ``comm_terms`` the messages).

Per layer, forward, on one of its tp x cp ranks (T = s b / cp tokens of the microbatch):

* GEMMs: QKV (T x h x (q + 2kv)/tp), the output projection, the MLP's fc1 (2f/tp with SwiGLU)
  and fc2, or a MoE layer's router, its local experts' grouped GEMMs (each of the rank's
  E/ep experts gets T k ep etp / (tp E) tokens when routing is balanced) and its shared
  experts; in fp8 under ``--fp8-format`` (the router and the output layer in 16 bits). The
  backward runs each GEMM twice at the forward's shapes: its input gradient (I) and its weight
  gradient (W).
* Core attention: its FLOPs (``stage_flops``) at Flash-Attention's forward and backward shares.
* Element-wise bytes per token: the two norms and residual adds (10h, on T/tp tokens under
  sequence parallelism), rotary embedding (2(q + kv)/tp), the MLP's activation (3f/tp with
  SwiGLU, 2f/tp without), fp8 casts of the GEMMs' inputs, MoE's permutation and un-permutation
  (4kh); 2 bytes each, twice as many in the backward. The loss: 10 bytes per logit forward, 8
  backward (the vocab-parallel cross entropy's fp32 softmax).
* Messages: ``comm_terms``.

Recompute adds to I what it runs again: the recomputed layers' whole forward (messages
included) under ``full``, the core attention under ``selective``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING

from .comm_terms import LayerComm
from .kernel_time import Kernels

if TYPE_CHECKING:
    from ..integration.stage_layers import StageLayers
    from .model_shape import ModelShape

TERMS = ("gemm", "attention", "elementwise", "tp", "cp", "ep")


@dataclass(frozen=True)
class Terms:
    """Seconds by term."""

    gemm: float = 0.0
    attention: float = 0.0
    elementwise: float = 0.0
    tp: float = 0.0  # tensor parallel all-gathers / reduce-scatters, exposed
    cp: float = 0.0  # context parallel ring exchange, exposed
    ep: float = 0.0  # expert parallel all-to-alls

    def __add__(self, other: "Terms") -> "Terms":
        return Terms(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))

    def times(self, factor: float) -> "Terms":
        return Terms(*(getattr(self, f.name) * factor for f in fields(self)))

    @property
    def total(self) -> float:
        return sum(getattr(self, f.name) for f in fields(self))

    def as_dict(self) -> dict[str, float]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True)
class StageTerms:
    f: Terms
    i: Terms
    w: Terms


def stage_terms(shape: "ModelShape", stage: "StageLayers", kernels: Kernels, comm: LayerComm,
                recompute: str = "none", recomputed_layers: int | None = None) -> StageTerms:
    """F, I, W of one microbatch through ``stage`` on one rank, by term."""
    f = i = w = Terms()
    last_is_moe = bool(shape.moe_layers and shape.moe_layers[-1])
    moe_of = [shape.moe_layers[layer] for layer in stage.layer_ids]
    for k, moe in enumerate(moe_of + [last_is_moe] * stage.mtp):
        lf, li, lw = _layer(shape, moe, kernels, comm)
        f, i, w = f + lf, i + li, w + lw
        mtp = k >= len(moe_of)
        if recompute == "full" and not mtp and (recomputed_layers is None
                                                or k < recomputed_layers):
            i = i + lf
        elif recompute == "selective":
            i = i + Terms(attention=lf.attention)
        if mtp:  # its projection of [h; embedding] (2h -> h) and its own logits
            proj = kernels.gemm(shape.tokens, shape.hidden / shape.tp, 2 * shape.hidden)
            f, i, w = f + Terms(gemm=proj), i + Terms(gemm=proj), w + Terms(gemm=proj)
            lf, li, lw = _loss(shape, kernels)
            f, i, w = f + lf, i + li, w + lw
    if stage.embedding:
        f = f + Terms(tp=comm.embedding_seconds())
        i = i + Terms(tp=comm.embedding_seconds())
    if stage.loss:
        lf, li, lw = _loss(shape, kernels)
        f, i, w = f + lf, i + li, w + lw
    return StageTerms(f, i, w)


def _layer(shape: "ModelShape", moe: bool, kernels: Kernels,
           comm: LayerComm) -> tuple[Terms, Terms, Terms]:
    """(F, I, W) of one decoder layer."""
    tokens, h, t = shape.tokens, shape.hidden, shape.tp
    q, kv = shape.query_size, shape.kv_size
    qkv, proj = kernels.gemm(tokens, (q + 2 * kv) / t, h), kernels.gemm(tokens, h, q / t)
    core = 2 * tokens * shape.seq * q / t  # as stage_flops counts it
    mlp, mlp_bytes = (_moe_mlp(shape, kernels) if moe else _dense_mlp(shape, kernels))
    norm_tokens = tokens / t if shape.sequence_parallel else tokens
    attention_bytes = 2 * (10 * h * norm_tokens + tokens * 2 * (q + kv) / t)
    if kernels.fp8:  # casts of QKV's and the projection's inputs (read 2 bytes, write 1)
        attention_bytes += 3 * tokens * (h + q / t)
    gemm = qkv + proj + mlp
    elementwise = kernels.elementwise(attention_bytes + mlp_bytes)
    attention_f = kernels.attention(core)
    attention_b = kernels.attention(2 * core, backward=True)
    messages = comm.layer(moe, qkv, proj, mlp, attention_f, attention_b)
    forward = Terms(gemm=gemm, attention=attention_f, elementwise=elementwise,
                    tp=messages.tp_f, cp=messages.cp_f, ep=messages.ep_f)
    backward_input = Terms(gemm=gemm, attention=attention_b, elementwise=2 * elementwise,
                           tp=messages.tp_b, cp=messages.cp_b, ep=messages.ep_b)
    return forward, backward_input, Terms(gemm=gemm)


def _dense_mlp(shape: "ModelShape", kernels: Kernels) -> tuple[float, float]:
    """(the MLP's GEMM seconds, its element-wise bytes)."""
    tokens, h, f, t = shape.tokens, shape.hidden, shape.ffn, shape.tp
    up = 2 * f if shape.swiglu else f
    seconds = kernels.gemm(tokens, up / t, h) + kernels.gemm(tokens, h, f / t)
    nbytes = 2 * tokens * (3 if shape.swiglu else 2) * f / t
    if kernels.fp8:
        nbytes += 3 * tokens * (h + f / t)
    return seconds, nbytes


def _moe_mlp(shape: "ModelShape", kernels: Kernels) -> tuple[float, float]:
    """(the MoE block's GEMM seconds, its element-wise bytes), balanced routing."""
    tokens, h, t, k = shape.tokens, shape.hidden, shape.tp, shape.topk
    local = shape.experts / shape.ep
    per_expert = tokens * k * shape.ep * shape.etp / (t * shape.experts)
    ffn, up = shape.moe_ffn / shape.etp, (2 if shape.swiglu else 1) * shape.moe_ffn / shape.etp
    seconds = kernels.gemm(tokens / t, shape.experts, h, fp8=False)  # the router
    seconds += local * (kernels.gemm(per_expert, up, h) + kernels.gemm(per_expert, h, ffn))
    routed = tokens / t * k  # token copies the rank's experts compute
    nbytes = 2 * routed * (4 * h + (3 if shape.swiglu else 2) * ffn)
    if kernels.fp8:
        nbytes += 3 * routed * (h + ffn)
    if shape.shared_ffn:
        shared = replace(shape, ffn=shape.shared_ffn, moe_layers=(), experts=0)
        s_seconds, s_bytes = _dense_mlp(shared, kernels)
        seconds, nbytes = seconds + s_seconds, nbytes + s_bytes
    return seconds, nbytes


def _loss(shape: "ModelShape", kernels: Kernels) -> tuple[Terms, Terms, Terms]:
    """(F, I, W) of the output layer (16-bit, as Megatron's ColumnParallelLinear runs it) and
    the vocab-parallel cross entropy."""
    tokens, vocab = shape.tokens, shape.vocab / shape.tp
    logits = kernels.gemm(tokens, vocab, shape.hidden, fp8=False)
    return (Terms(gemm=logits, elementwise=kernels.elementwise(10 * tokens * vocab)),
            Terms(gemm=logits, elementwise=kernels.elementwise(8 * tokens * vocab)),
            Terms(gemm=logits))


__all__ = ["StageTerms", "TERMS", "Terms", "stage_terms"]
