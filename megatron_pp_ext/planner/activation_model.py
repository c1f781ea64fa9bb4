"""The activation bytes a Megatron GPT stage keeps for one microbatch, from the model's shape.

Per transformer layer, the tensors Megatron saves for the backward (Korthikanti et al. 2022,
"Reducing Activation Recomputation in Large Transformer Models", Table 2, generalized to
query groups and gated MLPs), for T = s b / cp tokens of hidden size h, q = a d query and
kv = g d key/value channels, MLP size f, 16-bit activations, 1-byte dropout masks:

* split over tp always: Q, K, V and the attention output, 4 T q + 4 T kv (4 T q + 4 T q
  where attention is unfused: it repeats K and V to every head); the MLP's activations, 4 T f
  (GELU: its input and fc2's) or 6 T f (SwiGLU with Megatron's default --bias-swiglu-fusion:
  fc1's 2f-wide output and fc2's input; 10 T f unfused: also the SiLU's output and the linear
  half); the attention scores, 5 a s T (softmax output, its dropout mask and output; 2 a s T
  without attention dropout), only where they are kept;
* split over tp only with sequence parallelism: the two norms' inputs, QKV's and fc1's
  inputs, 8 T h, and two dropout masks, 2 T h (when --hidden-dropout > 0).

With a = g, f = 4h that is Korthikanti's s b h (34 + 5 a s/h)/t (sequence parallel) and
s b h (10 + 24/t + 5 a s/(h t)) (without). The scores are kept only by unfused attention
(``--attention-backend unfused`` or ``local``, or ``--transformer-impl local``): the default,
Transformer Engine with ``auto``, runs flash or fused attention, which keeps no scores.
``--recompute-granularity selective`` (``--recompute-activations``) drops the scores; ``full``
keeps a layer's input, 2 T h (/t with sequence parallelism or --distribute-saved-activations),
per ``--recompute-num-layers`` group (``uniform``) or for the first n layers of each chunk
(``block``). A MoE layer's MLP part is its router's input 2 T h, the k token copies its
experts receive (2 k T h + k (4 or 6) T f_moe) and its shared experts', all over tp with
balanced routing (an estimate: not checked against measured bytes).

Per stage: the layers it holds; the loss stage adds the final norm's and the output layer's
inputs (4 T h) and the cross entropy's fp32 softmax over its share of the vocabulary,
4 T V / t; the embedding stage its dropout mask, T h; an MTP layer is a layer plus its
projection's input (4 T h), norms (4 T h) and its own softmax. Without ``--bf16`` / ``--fp16``
the 16-bit terms double. A rank's peak is these stage bytes walked through the schedule
(``runtime.memory.predicted_peak_bytes``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, Sequence

from .model_shape import ModelShape, model_shape
from ..integration.stage_layers import StageLayers


@dataclass
class ActivationEstimate:
    """Activation bytes one microbatch leaves on one rank."""

    bytes_per_layer: int  # a dense transformer layer
    formula: str  # the per-layer formula with the values put in
    recompute: str  # "none", "selective" or "full"
    notes: list[str] = field(default_factory=list)
    stage_bytes: list[int] = field(default_factory=list)  # per stage (model order)

    @property
    def bytes_per_stage(self) -> int:
        """The largest stage's bytes (what an even split gives every stage)."""
        return max(self.stage_bytes, default=0)


def activation_estimate(args: Any, stages: Sequence[StageLayers],
                        shape: ModelShape | None = None) -> ActivationEstimate:
    """Activation bytes of one microbatch per dense layer and per stage, from Megatron's
    arguments (see the module docstring)."""
    shape = shape or model_shape(args)
    if shape.seq % shape.cp:
        raise ValueError(f"--seq-length {shape.seq} is not a multiple of "
                         f"--context-parallel-size {shape.cp}")
    notes = []
    if shape.cp > 1:
        notes.append(f"context parallel {shape.cp}: {shape.seq // shape.cp} tokens per "
                     "sequence per rank")
    if getattr(args, "fine_grained_activation_offloading", False):
        modules = ", ".join(getattr(args, "offload_modules", None) or []) or "none named"
        notes.append(f"--fine-grained-activation-offloading ({modules}) is not modelled: the "
                     "bytes below include what it moves to the CPU (an upper bound)")
    granularity = getattr(args, "recompute_granularity", None)
    if getattr(args, "recompute_activations", False):
        granularity = "selective"
    recompute = granularity if granularity in ("full", "selective") else "none"
    scores = _keeps_scores(args)
    if not scores:
        notes.append("flash / fused attention (Transformer Engine's default): no attention "
                     "scores kept")
    if recompute == "selective":
        scores = False
    layer = _Layer(shape, scores)
    per_layer, formula = layer.dense_bytes(), layer.formula()
    if recompute == "full":
        per_layer, formula = layer.input_bytes(args), layer.input_formula(args)
    scale = 1 if shape.bf16_or_fp16 else 2
    if scale == 2:
        formula = f"2 x ({formula}) (fp32 activations)"
        notes.append("no --bf16 / --fp16: fp32 activations, the 16-bit terms x 2")
    if shape.tp > 1:
        notes.append(f"tensor parallel {shape.tp}, "
                     + ("sequence parallel" if shape.sequence_parallel else
                        "no sequence parallel"))
    stage_bytes = [_whole(scale * _stage_layers_bytes(args, layer, stage, recompute, notes)
                          + _stage_extra_bytes(layer, stage, scale)) for stage in stages]
    return ActivationEstimate(_whole(scale * per_layer), formula, recompute, notes,
                              stage_bytes=stage_bytes)


def _keeps_scores(args: Any) -> bool:
    backend = getattr(args, "attention_backend", None)
    backend = str(getattr(backend, "name", backend))
    return backend in ("unfused", "local") or getattr(args, "transformer_impl", None) == "local"


@dataclass(frozen=True)
class _Layer:
    shape: ModelShape
    scores: bool

    @property
    def sharded_always(self) -> Fraction:
        """Bytes split over tp in every case, times tp (see the module docstring)."""
        s = self.shape
        e = s.fp8_element_bytes
        # unfused attention repeats K and V to every head (GQA) before its matmuls save them;
        # under fp8 the output projection also keeps its input (the attention's output, which
        # the attention keeps in 16 bits for its own backward) in fp8
        attention = 4 * s.query_size + 4 * (s.query_size if self.scores else s.kv_size) \
            + e * s.query_size
        mlp = self._mlp_width() * s.ffn
        return s.tokens * (attention + mlp) + self.score_bytes

    def _mlp_width(self) -> Fraction:
        """Bytes per token per MLP hidden unit: under fp8, fc2's input is kept in fp8 (the
        activation's own saved input stays 16-bit)."""
        s = self.shape
        width = Fraction(s.mlp_activation_width)
        return width - 2 + s.fp8_element_bytes if s.fp8 else width

    @property
    def score_bytes(self) -> Fraction:
        s = self.shape
        if not self.scores:
            return Fraction(0)
        return Fraction((5 if s.attention_dropout else 2) * s.heads * s.seq * s.tokens)

    @property
    def sharded_with_sp(self) -> Fraction:
        """The two norms' inputs (16-bit), QKV's and fc1's inputs (the norms' outputs: fp8
        under fp8), the dropout masks."""
        s = self.shape
        gemm_input = s.fp8_element_bytes if s.fp8 else 2
        return s.tokens * s.hidden * (4 + 2 * gemm_input + (2 if s.hidden_dropout else 0))

    def _split(self, always: Fraction, with_sp: Fraction) -> Fraction:
        t = self.shape.tp
        return (always + with_sp) / t if self.shape.sequence_parallel else always / t + with_sp

    def dense_bytes(self) -> Fraction:
        return self._split(self.sharded_always, self.sharded_with_sp)

    def moe_bytes(self) -> Fraction:
        s = self.shape
        e = s.fp8_element_bytes
        width = self._mlp_width()
        # the k token copies the experts receive are their fc1's inputs (fp8 under fp8)
        copy = e if s.fp8 else 2
        mlp = s.tokens * (s.topk * (copy * s.hidden + width * s.moe_ffn) + width * s.shared_ffn)
        dense_mlp = s.tokens * width * s.ffn
        always = self.sharded_always - dense_mlp + mlp
        with_sp = self.sharded_with_sp
        if s.fp8:  # the router's input (fc1's place) stays 16-bit: the router runs no fp8
            with_sp += s.tokens * s.hidden * (2 - e + (e if s.shared_ffn else 0))
        return self._split(always, with_sp)

    def input_bytes(self, args: Any) -> Fraction:
        s = self.shape
        sharded = s.sequence_parallel or bool(getattr(args, "distribute_saved_activations",
                                                      False))
        return Fraction(2 * s.tokens * s.hidden, s.tp if sharded else 1)

    def input_formula(self, args: Any) -> str:
        s = self.shape
        sharded = s.sequence_parallel or bool(getattr(args, "distribute_saved_activations",
                                                      False))
        div = f"/{s.tp}" if sharded and s.tp > 1 else ""
        return f"2*T*h{div} = 2*{s.tokens}*{s.hidden}{div}"

    def formula(self) -> str:
        """The per-layer formula in units of T h (T = s b / cp tokens), values put in."""
        s = self.shape
        always = self.sharded_always - self.score_bytes
        a = always / (s.tokens * s.hidden)
        b = self.sharded_with_sp / (s.tokens * s.hidden)
        coeff = lambda x: f"{float(x):g}"  # noqa: E731
        scores = (f" + {5 if s.attention_dropout else 2}*a*s/h" if self.scores else "")
        div = f"/{s.tp}" if s.tp > 1 else ""
        if s.sequence_parallel or s.tp == 1:
            terms = f"({coeff(a + b)}{scores})" if scores else coeff(a + b)
            return (f"T*h*{terms}{div}, T*h = {s.tokens}*{s.hidden}"
                    f"{f', a*s/h = {s.heads}*{s.seq}/{s.hidden}' if scores else ''}")
        scores = f" + ({scores[3:]}){div}" if scores else ""
        return (f"T*h*({coeff(b)} + {coeff(a)}{div}{scores}), T*h = {s.tokens}*{s.hidden}")


def _stage_layers_bytes(args: Any, layer: _Layer, stage: StageLayers, recompute: str,
                        notes: list[str]) -> Fraction:
    """The transformer layers' bytes of one stage (16-bit)."""
    shape = layer.shape
    moe = [shape.moe_layers[i] for i in stage.layer_ids] + [
        bool(shape.moe_layers and shape.moe_layers[-1])] * stage.mtp
    whole = [layer.moe_bytes() if is_moe else layer.dense_bytes() for is_moe in moe]
    if recompute != "full" or not whole:
        return sum(whole, Fraction(0))
    kept = layer.input_bytes(args)
    method = getattr(args, "recompute_method", None) or "uniform"
    n = int(getattr(args, "recompute_num_layers", None) or 1)
    if method == "block":
        recomputed = min(n, len(whole))
        return kept * recomputed + sum(whole[recomputed:], Fraction(0))
    groups = math.ceil(len(whole) / n)
    note = f"full recompute, uniform: one input kept per {n} layers"
    if n > 1 and note not in notes:
        notes.append(note)
    return kept * groups


def _stage_extra_bytes(layer: _Layer, stage: StageLayers, scale: int) -> Fraction:
    """What a stage keeps besides its transformer layers: the embedding's dropout mask, the
    loss's norm and output-layer inputs and fp32 softmax, MTP's projections and softmax."""
    s = layer.shape
    th = Fraction(s.tokens * s.hidden)
    sp = s.tp if s.sequence_parallel else 1
    softmax = Fraction(4 * s.tokens * s.vocab, s.tp)  # fp32 whatever the activations' dtype
    extra = Fraction(0)
    if stage.embedding and s.hidden_dropout:
        extra += th / sp
    if stage.loss:
        extra += scale * 4 * th / sp + softmax
    extra += stage.mtp * (scale * 8 * th / sp + softmax)
    return extra


def _whole(value: Fraction) -> int:
    return int(value) if value.denominator == 1 else int(round(value))


__all__ = ["ActivationEstimate", "activation_estimate"]
