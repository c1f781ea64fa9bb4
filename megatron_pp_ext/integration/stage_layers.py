"""Which layers each pipeline stage holds, as Megatron-Core builds them.

Megatron decides it, not the plugin: a ``TransformerConfig`` made from the arguments' layout
flags (``--decoder-first-pipeline-num-layers``, ``--decoder-last-pipeline-num-layers``,
``--account-for-embedding-in-pipeline-split``, ``--account-for-loss-in-pipeline-split``,
``--pipeline-model-parallel-layout``) runs Megatron's own checks, and Megatron's
``get_num_layers_to_build`` (or the parsed layout string) gives each (pipeline rank, virtual
stage) its decoder layers. A layout Megatron would refuse is refused with Megatron's message.

Under the V layout (stages r and 2p-1-r on rank r) Megatron's split flags keep their intent,
applied to the first and the last *stage* (:func:`v_split_layout`): the plugin turns them into
the equivalent ``--pipeline-model-parallel-layout`` string, which Megatron then builds.

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


#: Megatron's splits that name the first and the last pipeline stage's share (the attribute,
#: the flag); under the V layout they apply to V stages 0 and 2p-1 (:func:`v_split_layout`).
STAGE_SPLIT_FLAGS = tuple(flag for flag in UNEVEN_FLAGS
                          if flag[0] != "pipeline_model_parallel_layout")


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


def stage_split_flags(args: Any) -> list[str]:
    """The first/last-stage split flags the arguments set, with their values."""
    given = []
    for attr, flag in STAGE_SPLIT_FLAGS:
        value = getattr(args, attr, None)
        if value not in (None, False):
            given.append(flag if value is True else f"{flag} {value}")
    return given


def v_split_layout(args: Any, pp: int) -> str | None:
    """The ``--pipeline-model-parallel-layout`` string that applies the arguments' first and
    last-stage split flags to the V layout's 2p stages, or None when none is set.

    The flags keep the meaning Megatron gives them for the first and the last stage, applied to
    V stage 0 (the embedding's) and V stage 2p-1 (the loss's), both on rank 0:

    - ``--account-for-embedding-in-pipeline-split`` / ``--account-for-loss-in-pipeline-split``:
      the embedding (the loss) counts as one layer of its stage, and the decoder layers plus
      those fill the 2p stages evenly (Megatron's rule at v chunks, with 2p stages);
    - ``--decoder-first-pipeline-num-layers F`` / ``--decoder-last-pipeline-num-layers L``:
      stage 0 holds F decoder layers, stage 2p-1 holds L, the others share the rest evenly.

    MTP layers stay on the last stage, before the loss (where Megatron puts them without a
    string). ValueError with the numbers and the fix when the layers do not divide."""
    given = stage_split_flags(args)
    if not given:
        return None
    stages, layers = 2 * pp, int(args.num_layers)
    first = getattr(args, "decoder_first_pipeline_num_layers", None)
    last = getattr(args, "decoder_last_pipeline_num_layers", None)
    embedding = bool(getattr(args, "account_for_embedding_in_pipeline_split", False))
    loss = bool(getattr(args, "account_for_loss_in_pipeline_split", False))
    fix = ("change --num-layers or the flags, or give every stage's layers with "
           "--pipeline-model-parallel-layout (stage s of the string is V stage s)")
    if (first or last) and (embedding or loss):
        raise ValueError(f"{' '.join(given)}: Megatron takes either the first/last stage's "
                         "layer counts or the account-for flags, not both: keep one kind")
    if first is not None or last is not None:
        middle_stages = stages - (first is not None) - (last is not None)
        middle = layers - (first or 0) - (last or 0)
        if middle <= 0 or middle % middle_stages:  # Megatron's rule for its middle stages
            raise ValueError(
                f"{' '.join(given)} under the V layout ({stages} stages at pp {pp}): the "
                f"first and the last stage hold those layers, and the other {middle_stages} "
                f"stages must share the remaining {middle} of --num-layers {layers} evenly: "
                f"{fix}")
        counts = [middle // middle_stages] * stages
        if first is not None:
            counts[0] = first
        if last is not None:
            counts[-1] = last
    else:
        slots = layers + embedding + loss
        if slots % stages:
            raise ValueError(
                f"{' '.join(given)} under the V layout ({stages} stages at pp {pp}): "
                f"--num-layers {layers} plus the embedding and the loss counted as layers "
                f"({slots}) must divide evenly over the {stages} stages: {fix}")
        counts = [slots // stages] * stages
        counts[0] -= embedding
        counts[-1] -= loss
    mtp = int(getattr(args, "mtp_num_layers", None) or 0)
    return layout_string([StageLayers(sum(counts[:s]), n, embedding=s == 0,
                                      loss=s == stages - 1, mtp=mtp if s == stages - 1 else 0)
                          for s, n in enumerate(counts)])


def layout_string(stages: Sequence[StageLayers]) -> str:
    """Megatron's ``--pipeline-model-parallel-layout`` string for ``stages`` (model order),
    with its shorthand: ``t*7`` for seven decoder layers, ``(t*8|)*14`` for 14 equal stages
    in a row: ``Et*7|(t*8|)*14,t*7L``."""
    def one(stage: StageLayers) -> str:
        decoder = "t" * stage.decoder if stage.decoder < 3 else f"t*{stage.decoder}"
        mtp = "m" * stage.mtp if stage.mtp < 3 else f"m*{stage.mtp}"
        return ("E" if stage.embedding else "") + decoder + mtp + ("L" if stage.loss else "")

    parts = [one(stage) for stage in stages]
    out, i = [], 0
    while i < len(parts):
        run = 1
        while i + run < len(parts) and parts[i + run] == parts[i]:
            run += 1
        if run >= 3 and i + run < len(parts):  # a run before the last stage: (x|)*n,
            out.append(f"({parts[i]}|)*{run},")
        else:
            out.extend(p + "|" for p in parts[i:i + run])
        i += run
    return "".join(out)[:-1] if out[-1].endswith("|") else "".join(out)


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


__all__ = ["STAGE_SPLIT_FLAGS", "StageLayers", "UNEVEN_FLAGS", "describe", "layout_string",
           "stage_layers", "stage_split_flags", "uneven_flags", "v_split_layout"]
