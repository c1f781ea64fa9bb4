"""Measured activation bytes of Megatron's GPT (the local layers, fp32, on the CPU) for one
microbatch, per layer kind and recompute setting, as a :func:`spawn` target (pp = 1)."""

from __future__ import annotations

from typing import Any

import torch

from megatron_pp_ext.models import tiny_gpt
from megatron_pp_ext.runtime.memory import ActivationMemory
from megatron_pp_ext.train.processes import init_megatron

#: the probe's GPT: wide enough that per-token terms dominate the small ones (masks, indices)
SIZES = dict(hidden_size=128, num_attention_heads=8, vocab_size=1024, seq_length=64,
             micro_batch_size=2)


def saved_bytes(rank: int, world_size: int, settings: list[dict[str, Any]]) -> list[dict]:
    """For each settings dict (TransformerConfig overrides, plus ``layers``): the bytes one F
    of the whole model (embedding, layers, output layer and loss) saves for its backward."""
    init_megatron(1)
    _checkpoint_without_cuda()
    out = []
    for overrides in settings:
        overrides = dict(overrides)
        layers = overrides.pop("layers")
        if overrides.get("activation_func") == "silu":  # picklable by name
            overrides["activation_func"] = torch.nn.functional.silu
        cfg = tiny_gpt.TinyGPTConfig(num_layers=layers, ffn_hidden_size=overrides.pop(
            "ffn_hidden_size", None), **SIZES)
        config = tiny_gpt.make_transformer_config(cfg, 1, None, **overrides)
        (model,) = tiny_gpt.build_model_chunks(cfg, pp_rank=0, pp_size=1, config=config)
        model.train()
        batch = tiny_gpt.mock_batches(cfg, 1)[0]
        memory = ActivationMemory()
        output = model(batch["tokens"], batch["position_ids"], batch["attention_mask"],
                       labels=batch["labels"])
        out.append({"bytes": memory.record_forward(0, 0, output)})
    return out


def _checkpoint_without_cuda() -> None:
    """Megatron's activation checkpointing saves and restores the CUDA RNG state around the
    recomputed part; there is no CUDA here. A mock of CUDA only: the forward, whose saved
    tensors are measured, is Megatron's."""
    from megatron.core.tensor_parallel import random

    random._get_cuda_rng_state = lambda *args, **kwargs: torch.empty(0, dtype=torch.uint8)
    random._set_cuda_rng_state = lambda *args, **kwargs: None
