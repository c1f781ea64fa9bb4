"""The activation bytes of a Megatron GPT layer and stage, from Megatron-LM's arguments.

Activation memory, per rank, is estimated from the model's dimensions with the per-layer
formula of Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models" (Table 2; 16-bit activations, 1-byte dropout masks): for one microbatch of b sequences
of s tokens through one transformer layer of hidden size h with a attention heads,

=================================  ===========================  ============================
                                   tensor parallel t,           tensor parallel t,
                                   sequence parallel            no sequence parallel
=================================  ===========================  ============================
no recompute                       s b h (34 + 5 a s / h) / t   s b h (10 + 24/t + 5 a s/(h t))
selective recompute                s b h 34 / t                 s b h (10 + 24/t)
full recompute (a layer's input)   2 s b h / t                  2 s b h
=================================  ===========================  ============================

(t = 1: s b h (34 + 5 a s / h), s b h 34, 2 s b h.) ``--attention-backend flash`` or ``fused``
keep no attention scores, so the 5 a s / h term is dropped; ``--context-parallel-size c`` gives
each rank s / c of the tokens; without ``--bf16`` / ``--fp16`` (fp32 activations) the figure is
doubled. Full recompute with ``--recompute-method uniform`` and ``--recompute-num-layers n``
keeps one input per group of n layers; ``block`` recomputes the first n layers of each chunk
and keeps the others whole. A rank's peak is that per-layer figure x the layers per stage
(chunk) x the simulator's peak count of microbatch activations alive at once on the rank
(``validate.activation_trace``: F to B, or to W under a split backward). Transformer layers
only: embedding, output layer and loss, weights, gradients and optimizer state are not in it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from .pretrain_args import required_arg


@dataclass
class ActivationEstimate:
    """Activation bytes one microbatch leaves on one rank, per transformer layer."""

    bytes_per_layer: int
    formula: str  # the formula with the values put in
    recompute: str  # "none", "selective" or "full"
    notes: list[str] = field(default_factory=list)
    bytes_per_stage: int = 0  # one stage (chunk) of layers_per_stage layers


def activation_estimate(args: Any, layers_per_stage: int) -> ActivationEstimate:
    """Activation bytes of one microbatch through one transformer layer, and through one stage
    of ``layers_per_stage`` layers (see the module docstring), from Megatron's arguments."""
    s, b = required_arg(args, "seq_length", "--seq-length"), int(args.micro_batch_size)
    h = required_arg(args, "hidden_size", "--hidden-size")
    a = required_arg(args, "num_attention_heads", "--num-attention-heads")
    t = int(args.tensor_model_parallel_size or 1)
    cp = int(getattr(args, "context_parallel_size", 1) or 1)
    sp = bool(getattr(args, "sequence_parallel", False)) and t > 1
    notes = []
    if cp > 1:
        if s % cp:
            raise ValueError(f"--seq-length {s} is not a multiple of --context-parallel-size "
                             f"{cp}")
        s //= cp
        notes.append(f"context parallel {cp}: s = {s} tokens per rank")
    granularity = getattr(args, "recompute_granularity", None)
    if getattr(args, "recompute_activations", False):
        granularity = "selective"
    backend = getattr(args, "attention_backend", None)
    backend = getattr(backend, "name", backend)
    scores = str(backend) not in ("flash", "fused")
    if not scores:
        notes.append(f"--attention-backend {backend}: no attention scores kept (no 5as/h term)")
    dims = _Dims(s, b, h, a, t, sp, scores, f"/{t}" if t > 1 else "")
    if granularity == "full":
        per_layer, per_stage, formula = _full_recompute(args, dims, layers_per_stage, notes)
    elif granularity == "selective":
        per_layer, formula = _selective(dims)
        per_stage = per_layer * layers_per_stage
    else:
        per_layer, formula = _no_recompute(dims)
        per_stage = per_layer * layers_per_stage
    if not (getattr(args, "bf16", False) or getattr(args, "fp16", False)):
        per_layer, per_stage = 2 * per_layer, 2 * per_stage
        formula = f"2 x ({formula}) (fp32 activations)"
        notes.append("no --bf16 / --fp16: fp32 activations, the 16-bit formula x 2")
    if t > 1:
        notes.append(f"tensor parallel {t}, "
                     + ("sequence parallel" if sp else "no sequence parallel"))
    recompute = granularity if granularity in ("full", "selective") else "none"
    return ActivationEstimate(_whole(per_layer), formula, recompute, notes,
                              bytes_per_stage=_whole(per_stage))


@dataclass(frozen=True)
class _Dims:
    s: int
    b: int
    h: int
    a: int
    t: int
    sp: bool  # sequence parallel (with t > 1)
    scores: bool  # attention scores kept (not flash / fused attention)
    div: str  # "/t" in a formula, or ""


def _full_recompute(args: Any, d: _Dims, layers_per_stage: int, notes: list[str]):
    """(per layer, per stage, formula): a layer's input kept, per recompute group."""
    s, b, h, t = d.s, d.b, d.h, d.t
    sharded = d.sp or bool(getattr(args, "distribute_saved_activations", False))
    per_layer = Fraction(2 * s * b * h, t if sharded else 1)
    formula = (f"2*s*b*h{d.div} = 2*{s}*{b}*{h}{d.div}" if sharded else
               f"2*s*b*h = 2*{s}*{b}*{h}")
    method = getattr(args, "recompute_method", None) or "uniform"
    n = int(getattr(args, "recompute_num_layers", None) or 1)
    if method == "block":
        whole = _layer_bytes(s, b, h, d.a, t, d.sp, d.scores)
        kept = min(n, layers_per_stage)
        per_stage = per_layer * kept + whole * (layers_per_stage - kept)
        if kept < layers_per_stage:
            notes.append(f"full recompute, block: {kept} of {layers_per_stage} layers per "
                         f"chunk recomputed, {layers_per_stage - kept} kept whole "
                         f"({_whole(whole)} bytes each)")
        return per_layer, per_stage, formula
    groups = math.ceil(layers_per_stage / n)
    if n > 1:
        notes.append(f"full recompute, uniform: one input kept per {n} layers "
                     f"({groups} per chunk)")
    return per_layer, per_layer * groups, formula


def _selective(d: _Dims):
    s, b, h, t = d.s, d.b, d.h, d.t
    if d.sp or t == 1:
        return Fraction(34 * s * b * h, t), f"s*b*h*34{d.div} = {s}*{b}*{h}*34{d.div}"
    return (Fraction(s * b * h) * (10 + Fraction(24, t)),
            f"s*b*h*(10 + 24/t) = {s}*{b}*{h}*(10 + 24/{t})")


def _no_recompute(d: _Dims):
    s, b, h, a, t = d.s, d.b, d.h, d.a, d.t
    per_layer = _layer_bytes(s, b, h, a, t, d.sp, d.scores)
    if d.sp or t == 1:
        attn, attn_v = (" + 5*a*s/h", f" + 5*{a}*{s}/{h}") if d.scores else ("", "")
        return per_layer, f"s*b*h*(34{attn}){d.div} = {s}*{b}*{h}*(34{attn_v}){d.div}"
    attn, attn_v = ((" + 5*a*s/(h*t)", f" + 5*{a}*{s}/({h}*{t})") if d.scores else ("", ""))
    return per_layer, f"s*b*h*(10 + 24/t{attn}) = {s}*{b}*{h}*(10 + 24/{t}{attn_v})"


def _whole(value: Fraction) -> int:
    return int(value) if value.denominator == 1 else int(round(value))


def _layer_bytes(s, b, h, a, t, sp, scores) -> Fraction:
    """A layer without recompute: s b h (34 + 5 a s/h) / t with sequence parallel (or t = 1),
    s b h (10 + 24/t + 5 a s/(h t)) without; the 5 a s / h term only when scores are kept."""
    attention = Fraction(5 * a * s, h) if scores else Fraction(0)
    sbh = Fraction(s * b * h)
    if sp or t == 1:
        return sbh * (34 + attention) / t
    return sbh * (10 + Fraction(24, t) + attention / t)


__all__ = ["ActivationEstimate", "activation_estimate"]
