"""Model providers for dualpipe (bidirectional) in Megatron-LM's training loop.

dualpipe holds every model part twice: rank r's chunk 0 is part r of p, exactly the chunk
Megatron's 1F1B builds on rank r, and its chunk 1 is a copy of part p-1-r (rank p-1-r's 1F1B
chunk). Megatron-LM builds two chunks per rank when asked for
``--num-virtual-stages-per-pipeline-rank 2``; :func:`dual_layout_model_provider` wraps a
model provider so that ``get_model``'s two calls build those parts:

- a part is built at its 1F1B position: pipeline rank ``part`` (Megatron's rank override and
  the pipeline group's ``rank()``), no virtual stages (the model's config and Megatron's
  parallel state say one chunk per rank while it builds; the config keeps saying so: each
  chunk holds p parts' worth of layers, 1F1B's split), embedding on part 0, loss on part p-1;
- each part starts as 1F1B starts it: built right after seeding as pipeline rank ``part``
  (Megatron's ``_set_random_seed``), every random state put back afterwards, so both copies
  start equal;
- the copies (chunk 1) are marked ``shared`` (``stage_copies.mark_copies``): Megatron's grad
  norm counts each part once; the drop-in sums the two copies' gradients each step
  (``stage_copies.sum_stage_copies``);
- tied embeddings and MTP: ranks 0 and p-1 both hold part 0 and part p-1, so each holds the
  word embedding and its copy; no chunk joins Megatron's embedding group, the copy starts
  from the embedding's values and the two gradients are summed on the rank
  (``v_layout_models.sum_tied_embedding_grads``, through the same patch as the V layout's),
  before the pair sum adds the other rank's.

Layout strings (``--pipeline-model-parallel-layout``) are refused: they place layers per
(rank, virtual stage) of Megatron's loop layout, and a dualpipe part is a 1F1B stage.
"""

from __future__ import annotations

import copy
import functools
from typing import Any

from ..schedules import DUAL_LAYOUT, REGISTRY, canonical_name
from .model_chunks import model_chunks
from .stage_copies import mark_copies
from .v_layout_models import (
    _holds_embedding_copy,
    _patch_once,
    _pipeline_group_as,
    _pipeline_rank_as,
    _put_back_group,
    _seeded_as_pipeline_rank,
    two_chunk_placement,
)


def uses_dual_layout(args: Any) -> bool:
    """Whether ``--pipeline-schedule`` asks for dualpipe."""
    name = getattr(args, "pipeline_schedule", None)
    if not name:
        return False
    try:
        return REGISTRY[canonical_name(name)].layout == DUAL_LAYOUT
    except ValueError:
        return False


def dual_part(pp_rank: int, pp_size: int, vp_stage: int) -> int:
    """The model part chunk ``vp_stage`` of ``pp_rank`` holds: r, then p-1-r."""
    return pp_rank if vp_stage == 0 else pp_size - 1 - pp_rank


def check_dual_args(args: Any) -> None:
    """What dualpipe cannot build, refused before the model is (a ValueError naming the fix)."""
    pp = getattr(args, "pipeline_model_parallel_size", 1) or 1
    if pp % 2:
        raise ValueError(
            f"--pipeline-schedule dualpipe with --pipeline-model-parallel-size {pp}: DualPipe "
            "pairs rank r with rank p-1-r, so the pipeline size must be even; use an even "
            "size, or --pipeline-schedule dualpipev")
    if getattr(args, "pipeline_model_parallel_layout", None):
        raise ValueError(
            "--pipeline-schedule dualpipe does not take --pipeline-model-parallel-layout: a "
            "layout string places layers per (rank, virtual stage) of Megatron's loop layout, "
            "and a dualpipe part is a 1F1B stage; split with --decoder-first/last-pipeline-"
            "num-layers, or use zb-v / dualpipev with the string")
    if model_chunks(args) != 2:
        raise ValueError(
            f"--pipeline-schedule dualpipe builds 2 model chunks per rank (part r and a copy "
            f"of part p-1-r), but Megatron builds {model_chunks(args)}: add "
            "--num-virtual-stages-per-pipeline-rank 2")


def dual_layout_model_provider(model_provider, transformer_config=None):
    """Wrap a Megatron-LM model provider (keywords ``pre_process, post_process, vp_stage,
    config, pg_collection``) so that ``get_model`` builds dualpipe's chunks (see the module).
    ``transformer_config``: the TransformerConfig the provider builds from when it ignores
    ``config=`` (a ModelConfig's builder): it is set to one chunk per rank."""
    built: dict[int, Any] = {}  # vp_stage -> chunk, on this rank

    @functools.wraps(model_provider)
    def provider(pre_process=True, post_process=True, vp_stage=None, config=None,
                 pg_collection=None, **kwargs):
        from megatron.training import get_args

        check_dual_args(get_args())
        pg_collection, p, r = two_chunk_placement(pg_collection, vp_stage, "dualpipe")
        one_chunk = _one_chunk_config(config if config is not None
                                      else _config_from_args(get_args(), transformer_config),
                                      built)
        if transformer_config is not None:
            transformer_config.virtual_pipeline_model_parallel_size = None
        part = dual_part(r, p, vp_stage)
        with _seeded_as_pipeline_rank(part), _pipeline_rank_as(part), \
                _no_virtual_stages(), _pipeline_group_as(pg_collection, part) as stand_in:
            model = model_provider(pre_process=(part == 0), post_process=(part == p - 1),
                                   vp_stage=None, config=one_chunk,
                                   pg_collection=pg_collection, **kwargs)
        _put_back_group(model, stand_in)
        model.pipeline_stage = part if vp_stage == 0 else 2 * p - 1 - r
        model.pipeline_num_stages, model.pipeline_part = 2 * p, part
        # its chunk's own pre/post-processing decides (Float16Module's casts, the tied sum),
        # as for the V layout's chunks
        model.pipeline_v_layout = model.pipeline_dual_layout = True
        if vp_stage == 1:
            mark_copies(model)
            _checkpoint_as_replica(model)
        built[vp_stage] = model
        _start_tied_copies(built)
        _patch_once()
        return model

    provider.dual_layout = True
    return provider


def _checkpoint_as_replica(model) -> None:
    """A copy's distributed-checkpoint entries are replicas of its partner's chunk 0 (same
    keys, same global offsets): saved once, by the main replica, and loadable into 1F1B or
    back into dualpipe (each copy loads the same values)."""
    original = model.sharded_state_dict

    @functools.wraps(original)
    def sharded_state_dict(*args, **kwargs):
        from megatron.core.dist_checkpointing.dict_utils import nested_values

        state = original(*args, **kwargs)
        for entry in nested_values(state):
            replica_id = getattr(entry, "replica_id", None)
            if replica_id is None:
                continue
            entry.replica_id = ((replica_id[0] + 1, *replica_id[1:])
                                if isinstance(replica_id, tuple) else replica_id + 1)
        return state

    model.sharded_state_dict = sharded_state_dict


def _config_from_args(args, transformer_config):
    """The TransformerConfig Megatron-LM's GPT builder makes from the arguments where
    ``get_model`` passes none (0.17, 0.18), so that the chunks are built from a copy with no
    virtual stages (a config made from the arguments with none fails its own checks:
    ``--overlap-moe-expert-parallel-comm`` needs virtual stages). ``None`` where the provider
    builds from ``transformer_config`` (a ModelConfig's builder)."""
    if transformer_config is not None:
        return None
    from megatron.training.arguments import core_transformer_config_from_args

    if getattr(args, "yaml_cfg", None) is not None:
        from megatron.training.yaml_arguments import core_transformer_config_from_yaml

        return core_transformer_config_from_yaml(args, "language_model")
    return core_transformer_config_from_args(args)


def _one_chunk_config(config, built: dict):
    """``config`` with no virtual stages, one copy for both chunks (they share a config, as
    Megatron's chunks do, so the hooks Megatron-LM sets on chunk 0's reach both)."""
    if config is None:
        return None
    for model in built.values():
        if getattr(model, "config", None) is not None:
            return model.config
    one = copy.copy(config)
    one.virtual_pipeline_model_parallel_size = None
    return one


@functools.lru_cache(maxsize=None)
def _virtual_size_setter():
    from megatron.core import parallel_state

    return (parallel_state.get_virtual_pipeline_model_parallel_world_size,
            parallel_state.set_virtual_pipeline_model_parallel_world_size)


class _no_virtual_stages:
    """Inside: Megatron's parallel state reports no virtual stages (a 1F1B chunk is built)."""

    def __enter__(self):
        get, put = _virtual_size_setter()
        self.before = get()
        put(None)

    def __exit__(self, *exc):
        _virtual_size_setter()[1](self.before)
        return False


def _start_tied_copies(built: dict) -> None:
    """Once both chunks are built: the word embedding's copy (tied output layer, MTP stage)
    takes the embedding's values, on the rank that holds both (ranks 0 and p-1)."""
    import torch

    if len(built) < 2:
        return
    first = [m for m in built.values() if getattr(m, "pre_process", False)]
    copies = [m for m in built.values() if _holds_embedding_copy(m)]
    if not first or not copies:
        return
    with torch.no_grad():
        copies[0].shared_embedding_or_output_weight().copy_(
            first[0].shared_embedding_or_output_weight())
