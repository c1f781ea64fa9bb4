"""A GPT's dimensions as Megatron-LM derives them from its arguments (``validate_args`` is not
run: it asks the GPU and the job's environment): the FFN size (4h, or 2/3 of it rounded down
to 64 with SwiGLU), the query groups (GQA), the vocabulary padded as Megatron pads it
(``megatron_compat.padded_vocab_size``), MoE layers and experts,
MTP layers, and the parallel sizes that split a layer (tp, sequence parallel, cp, ep, etp)."""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from .. import megatron_compat
from .pretrain_args import required_arg


@dataclass(frozen=True)
class ModelShape:
    num_layers: int
    hidden: int  # h
    heads: int  # a
    query_groups: int  # g (= a without GQA)
    kv_channels: int  # d, the head dimension
    ffn: int  # f, the dense MLP's hidden size
    swiglu: bool
    fused_swiglu: bool  # --bias-swiglu-fusion (Megatron's default): one saved input
    vocab: int  # V, padded as Megatron pads it (0: unknown, see vocab_note)
    vocab_note: str  # where V came from, or why it is unknown
    seq: int  # s, tokens per sequence
    micro_batch: int  # b
    tp: int
    sequence_parallel: bool  # with tp > 1
    cp: int
    bias: bool  # --add-bias-linear (Megatron's default) and not --disable-bias-linear
    norm_params: int  # per hidden unit: 2 for LayerNorm, 1 for RMSNorm
    position_table: int  # rows of a learned absolute position table, else 0
    untied: bool  # --untie-embeddings-and-output-weights
    moe_layers: tuple[bool, ...]  # per decoder layer: is it a MoE layer
    experts: int  # routed experts (0: a dense model)
    topk: int
    moe_ffn: int
    shared_ffn: int  # shared experts' hidden size (0: none)
    ep: int
    etp: int
    mtp_layers: int
    hidden_dropout: bool  # dropout masks are stored (p > 0)
    attention_dropout: bool
    bf16_or_fp16: bool
    fp8: bool
    fp8_recipe: str = ""  # --fp8-recipe: delayed, tensorwise, mxfp8, blockwise ("": no fp8)

    @property
    def fp8_element_bytes(self) -> Fraction:
        """Bytes per element of a tensor Transformer Engine keeps in fp8 (0 without fp8)."""
        return fp8_element_bytes(self.fp8_recipe) if self.fp8 else Fraction(0)

    @property
    def tokens(self) -> int:
        """Tokens of one microbatch on one rank before sequence parallelism: s b / cp."""
        return self.seq * self.micro_batch // self.cp

    @property
    def query_size(self) -> int:
        return self.heads * self.kv_channels

    @property
    def kv_size(self) -> int:
        return self.query_groups * self.kv_channels

    @property
    def mlp_activation_width(self) -> int:
        """Bytes per token per MLP hidden unit its activations keep (16-bit): GELU 4 (its
        input, fc2's input); SwiGLU 6 fused (fc1's 2f-wide output, fc2's input), 10 unfused
        (also the SiLU's output and the linear half, copied)."""
        if not self.swiglu:
            return 4
        return 6 if self.fused_swiglu else 10

    @property
    def mlp_matrices(self) -> int:
        """Weight matrices of h x f in an MLP: 3 with SwiGLU (gate, up, down), else 2."""
        return 3 if self.swiglu else 2


def model_shape(args: Any) -> ModelShape:
    """The dimensions of the GPT ``args`` describe (Megatron's parser's namespace)."""
    if getattr(args, "multi_latent_attention", False):
        # its low-rank Q and KV projections and rope heads change the FLOPs, the parameters
        # and the saved tensors; priced as GQA the plan would be wrong, not approximate
        raise ValueError(
            "--multi-latent-attention is not modelled by plan, simulate and select (its "
            "FLOPs, parameters and activations differ from the GQA the planner counts): "
            "without the flag the model is planned with standard attention, an "
            "approximation; the drop-in itself trains MLA models under every schedule")
    h = required_arg(args, "hidden_size", "--hidden-size")
    a = required_arg(args, "num_attention_heads", "--num-attention-heads")
    layers = required_arg(args, "num_layers", "--num-layers")
    tp = int(args.tensor_model_parallel_size or 1)
    swiglu = bool(getattr(args, "swiglu", False))
    ffn = getattr(args, "ffn_hidden_size", None)
    if ffn is None:  # as validate_args derives it
        ffn = int((4 * h * 2 / 3) / 64) * 64 if swiglu else 4 * h
    groups = (int(args.num_query_groups) if getattr(args, "group_query_attention", False)
              and getattr(args, "num_query_groups", None) else a)
    vocab, vocab_note = _vocab(args)
    if vocab and not getattr(args, "padded_vocab_size", None):
        vocab = megatron_compat.padded_vocab_size(
            int(vocab), int(args.make_vocab_size_divisible_by), tp)
    experts = int(getattr(args, "num_experts", None) or 0)
    return ModelShape(
        num_layers=layers, hidden=h, heads=a, query_groups=groups,
        kv_channels=int(getattr(args, "kv_channels", None) or h // a), ffn=int(ffn),
        swiglu=swiglu, fused_swiglu=bool(getattr(args, "bias_swiglu_fusion", True)),
        vocab=int(vocab), vocab_note=vocab_note,
        seq=required_arg(args, "seq_length", "--seq-length"),
        micro_batch=int(args.micro_batch_size), tp=tp,
        sequence_parallel=bool(getattr(args, "sequence_parallel", False)) and tp > 1,
        cp=int(getattr(args, "context_parallel_size", 1) or 1),
        bias=bool(getattr(args, "add_bias_linear", True)),
        norm_params=1 if getattr(args, "normalization", "LayerNorm") == "RMSNorm" else 2,
        position_table=(int(getattr(args, "max_position_embeddings", 0) or 0)
                        if getattr(args, "position_embedding_type", "learned_absolute")
                        == "learned_absolute" else 0),
        untied=bool(getattr(args, "untie_embeddings_and_output_weights", False)),
        moe_layers=_moe_pattern(args, layers, experts),
        experts=experts, topk=int(getattr(args, "moe_router_topk", 2) or 2) if experts else 0,
        moe_ffn=int(getattr(args, "moe_ffn_hidden_size", None) or ffn) if experts else 0,
        shared_ffn=int(getattr(args, "moe_shared_expert_intermediate_size", None) or 0),
        ep=int(getattr(args, "expert_model_parallel_size", 1) or 1),
        etp=int(getattr(args, "expert_tensor_parallel_size", None) or tp),
        mtp_layers=int(getattr(args, "mtp_num_layers", None) or 0),
        hidden_dropout=float(getattr(args, "hidden_dropout", 0.1) or 0) > 0,
        attention_dropout=float(getattr(args, "attention_dropout", 0.1) or 0) > 0,
        bf16_or_fp16=bool(getattr(args, "bf16", False) or getattr(args, "fp16", False)),
        fp8=getattr(args, "fp8", None) is not None,
        fp8_recipe=fp8_recipe(args),
    )


def fp8_recipe(args: Any) -> str:
    """``--fp8-recipe`` under ``--fp8-format`` (Megatron's default: delayed), else ""."""
    if getattr(args, "fp8", None) is None:
        return ""
    return str(getattr(args, "fp8_recipe", None) or "delayed")


def fp8_element_bytes(recipe: str) -> Fraction:
    """Bytes per element of a tensor Transformer Engine keeps in fp8 under ``recipe``: 1, and
    under MXFP8 one e8m0 scale per block of 32 elements (the blockwise recipe: one fp32 scale
    per 128 x 128 tile, negligible)."""
    return Fraction(33, 32) if recipe == "mxfp8" else Fraction(1)


#: Vocabulary sizes of the tokenizers whose size needs no file (Megatron's GPT-2 BPE: 50257).
TOKENIZER_VOCAB = {"GPT2BPETokenizer": 50257}


def _vocab(args: Any) -> tuple[int, str]:
    """(the vocabulary before padding, where it came from); 0 when only a tokenizer's files
    could tell (the embedding and the output layer then go uncounted, said so)."""
    if getattr(args, "padded_vocab_size", None):
        return int(args.padded_vocab_size), "the padded vocabulary"
    if getattr(args, "vocab_size", None):
        return int(args.vocab_size), "--vocab-size"
    tokenizer = getattr(args, "tokenizer_type", None)
    if tokenizer in TOKENIZER_VOCAB:
        return TOKENIZER_VOCAB[tokenizer], f"--tokenizer-type {tokenizer}"
    return 0, ("no --vocab-size (the tokenizer's size is in its files): the embedding, the "
               "output layer and the loss are not counted; give --vocab-size N")


def _moe_pattern(args: Any, layers: int, experts: int) -> tuple[bool, ...]:
    """Per layer, MoE or dense: ``--moe-layer-freq`` n (every n-th layer, from layer 0, as
    Megatron counts) or its list."""
    if not experts:
        return (False,) * layers
    freq = getattr(args, "moe_layer_freq", 1)
    if isinstance(freq, int):
        return tuple(i % freq == 0 for i in range(layers))
    pattern = [bool(x) for x in freq]
    if len(pattern) != layers:
        raise ValueError(f"--moe-layer-freq gives {len(pattern)} layers, --num-layers is "
                         f"{layers}: give one 0/1 per layer")
    return tuple(pattern)


__all__ = ["ModelShape", "fp8_element_bytes", "fp8_recipe", "model_shape"]
