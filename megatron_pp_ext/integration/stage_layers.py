"""Which layers each pipeline stage holds, as Megatron-Core builds them.

Megatron decides it, not the plugin: a ``TransformerConfig`` made from the arguments' layout
flags (``--decoder-first-pipeline-num-layers``, ``--decoder-last-pipeline-num-layers``,
``--account-for-embedding-in-pipeline-split``, ``--account-for-loss-in-pipeline-split``,
``--pipeline-model-parallel-layout``) runs Megatron's own checks, and Megatron's
``get_num_layers_to_build`` (or the parsed layout string) gives each (pipeline rank, virtual
stage) its decoder layers. A layout Megatron would refuse is refused with Megatron's message.

Stage ``s`` (model order, as the schedule IR numbers stages) is Megatron's loop position
(pipeline rank ``s mod p``, virtual stage ``s // p``). That holds for the V layout too: the
plugin builds V stage ``s`` at that loop position (``v_layout_models``), so a layout string's
stage ``s`` is V stage ``s``; the schedule places the stage on its rank.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Sequence

#: Megatron's flags that make the split uneven (the attribute, the flag).
UNEVEN_FLAGS = (
    ("decoder_first_pipeline_num_layers", "--decoder-first-pipeline-num-layers"),
    ("decoder_last_pipeline_num_layers", "--decoder-last-pipeline-num-layers"),
    ("pipeline_model_parallel_layout", "--pipeline-model-parallel-layout"),
    ("account_for_embedding_in_pipeline_split", "--account-for-embedding-in-pipeline-split"),
    ("account_for_loss_in_pipeline_split", "--account-for-loss-in-pipeline-split"),
)


@dataclass(frozen=True)
class StageLayers:
    """The layers of one pipeline stage, in model order."""

    first_layer: int  # global index of its first decoder layer
    decoder: int  # transformer (decoder) layers
    embedding: bool = False  # the word (and position) embeddings
    loss: bool = False  # the final norm, the output layer and the loss
    mtp: int = 0  # multi-token-prediction layers

    @property
    def layer_ids(self) -> range:
        return range(self.first_layer, self.first_layer + self.decoder)

    def describe(self) -> str:
        """Megatron's layout letters: ``E`` embedding, ``t`` a decoder layer, ``m`` an MTP
        layer, ``L`` the loss: ``E+4t``, ``4t``, ``4t+L``."""
        parts = (["E"] if self.embedding else []) + (
            [f"{self.decoder}t"] if self.decoder else []) + (
            [f"{self.mtp}m"] if self.mtp else []) + (["L"] if self.loss else [])
        return "+".join(parts) or "(empty)"


def uneven_flags(args: Any) -> list[str]:
    """The uneven-split flags the arguments set, as the user spelled them."""
    return [flag for attr, flag in UNEVEN_FLAGS if getattr(args, attr, None) not in (None, False)]


def stage_layers(args: Any, pp: int, chunks: int) -> list[StageLayers]:
    """Per stage ``s`` of ``pp * chunks`` (model order), the layers Megatron builds there.
    ValueError with Megatron's rule when Megatron would refuse the layout."""
    config = _layout_config(args, pp, chunks)
    layout = config.pipeline_model_parallel_layout
    stages = []
    first = 0
    for s in range(pp * chunks):
        rank, vp = s % pp, s // pp
        if layout is not None:
            kinds = [kind.name for kind in layout.layout[rank][vp]]
            stage = StageLayers(first, kinds.count("decoder"), "embedding" in kinds,
                                "loss" in kinds, kinds.count("mtp"))
        else:
            stage = StageLayers(first, _decoder_layers(config, rank, vp if chunks > 1 else None),
                                embedding=s == 0, loss=s == pp * chunks - 1,
                                mtp=int(getattr(args, "mtp_num_layers", None) or 0)
                                if s == pp * chunks - 1 else 0)
        stages.append(stage)
        first += stage.decoder
    if first != config.num_layers:  # Megatron's own checks leave pp <= 2 unchecked
        raise ValueError(f"the stages hold {first} decoder layers ({describe(stages)}), but "
                         f"--num-layers is {config.num_layers}: make the layout flags add up "
                         "to --num-layers")
    return stages


def describe(stages: Sequence[StageLayers]) -> str:
    """``E+4t | 4t | 4t+L``: the stages in model order."""
    return " | ".join(stage.describe() for stage in stages)


def _decoder_layers(config, rank: int, vp_stage: int | None) -> int:
    from megatron.core.transformer.transformer_block import get_num_layers_to_build

    try:
        return int(get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=rank))
    except AssertionError as exc:
        raise ValueError(f"Megatron-Core refuses this layer split: {exc}") from None


def _layout_config(args: Any, pp: int, chunks: int):
    """Megatron's ``TransformerConfig`` with the arguments' layout flags: its ``__post_init__``
    applies Megatron's rules for them (the same checks as at ``pretrain_gpt.py`` start-up)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    layout = getattr(args, "pipeline_model_parallel_layout", None)
    try:
        with warnings.catch_warnings():  # its deprecation notes on options the plan never sets
            warnings.simplefilter("ignore")
            return _config(TransformerConfig, args, pp, chunks, layout)
    except (AssertionError, ValueError) as exc:
        raise ValueError(f"Megatron-Core refuses this layer split: {exc}") from None


def _config(TransformerConfig, args: Any, pp: int, chunks: int, layout):
    import torch

    return TransformerConfig(
        num_layers=int(args.num_layers), hidden_size=int(args.hidden_size),
        num_attention_heads=int(args.num_attention_heads),
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=chunks if chunks > 1 else None,
        # Megatron needs a dtype to send between stages when pp > 1; it does not change which
        # layers a stage holds
        pipeline_dtype=torch.bfloat16,
        num_layers_in_first_pipeline_stage=getattr(args, "decoder_first_pipeline_num_layers",
                                                   None),
        num_layers_in_last_pipeline_stage=getattr(args, "decoder_last_pipeline_num_layers",
                                                  None),
        account_for_embedding_in_pipeline_split=bool(
            getattr(args, "account_for_embedding_in_pipeline_split", False)),
        account_for_loss_in_pipeline_split=bool(
            getattr(args, "account_for_loss_in_pipeline_split", False)),
        pipeline_model_parallel_layout=str(layout) if layout else None,
        mtp_num_layers=getattr(args, "mtp_num_layers", None),
    )


__all__ = ["StageLayers", "UNEVEN_FLAGS", "describe", "stage_layers", "uneven_flags"]
