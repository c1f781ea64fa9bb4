"""Model providers for the V layout (zb-v, dualpipev) in Megatron-LM's training loop.

Megatron-LM builds chunk c of pipeline rank r as loop stage ``c*p + r``, with the embedding on
(rank 0, chunk 0) and the loss on (rank p-1, chunk 1). The V layout wants stage ``2p-1-r`` in
chunk 1 of rank r (embedding and loss both on rank 0). :func:`v_layout_model_provider` wraps a
Megatron-LM model provider so that ``get_model`` builds those chunks:

- each V stage holds the layers Megatron gives that stage (the even split, or the stage of a
  ``--pipeline-model-parallel-layout`` string), numbered as Megatron numbers them;
- every parameter starts with the value Megatron's 1F1B gives it (one chunk per rank, rank q
  holding V stages 2q and 2q+1; a layout string merged pairwise), not the values of
  Megatron's per-rank seeding of *this* rank: see :func:`v_layout_model_provider`;
- tied embeddings and multi-token prediction share no embedding group: the word embedding's
  two copies (the first stage's, and the tied output layer's or the MTP stage's) are both on
  rank 0, where their gradients are summed (:func:`sum_tied_embedding_grads`).

Patches, each made once by the first V chunk built and undone by :func:`undo_patches`
(``megatron_pp_ext.uninstall()`` calls it): ``megatron.training.training.Float16Module``
(casts by the chunk's own pre/post-processing) and
``finalize_model_grads._allreduce_word_embedding_grads`` (the local sum for V chunks).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import random
from typing import Any
from ..schedules import (
    REGISTRY,
    canonical_name,
    is_schedule_file,
    load_schedule_file,
    schedule_layout,
)
from .. import device as device_helper
from .. import megatron_compat
from .model_chunks import model_chunks
from .stage_layers import stage_layers

def uses_v_layout(args: Any) -> bool:
    """Whether ``--pipeline-schedule`` asks for a V-layout schedule (zb-v, dualpipev, v-half,
    v-min; zb-auto when Megatron builds two chunks per rank)."""
    name = getattr(args, "pipeline_schedule", None)
    if not name:
        return False

    if is_schedule_file(name):
        return schedule_layout(load_schedule_file(name)) == "v"
    try:
        spec = REGISTRY[canonical_name(name)]
    except ValueError:  # auto, or not a schedule (install_from_args says so)
        return False
    return spec.layout_for(model_chunks(args)) == "v"  # zb-auto: V on two chunks


def v_chunk_stage(pp_rank: int, pp_size: int, vp_stage: int) -> int:
    """The stage chunk ``vp_stage`` of ``pp_rank`` holds in the V layout: r, then 2p-1-r."""
    return pp_rank if vp_stage == 0 else 2 * pp_size - 1 - pp_rank


def two_chunk_placement(pg_collection, vp_stage, layout: str):
    """For a provider of two chunks per rank (the V layout, dualpipe): the process groups
    its chunks are built with, no embedding group (its all-reduces pair the first and the
    last pipeline rank, and here the tied copies are on one rank), and the pipeline's size and
    this rank; a ValueError unless ``vp_stage`` is 0 or 1."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection

    if pg_collection is None:
        pg_collection = ProcessGroupCollection.use_mpu_process_groups()
    pp_group = getattr(pg_collection, "pp", None)
    if pp_group is None:
        pp_group = parallel_state.get_pipeline_model_parallel_group()
    if vp_stage not in (0, 1):
        raise ValueError(
            f"{layout} builds 2 model chunks per rank, got vp_stage={vp_stage}: add "
            "--num-virtual-stages-per-pipeline-rank 2")
    placed = copy.copy(pg_collection)
    placed.embd = None
    return placed, dist.get_world_size(pp_group), dist.get_rank(pp_group)


def v_layout_model_provider(model_provider, loop_init: bool = True):
    """Wrap a Megatron-LM model provider (``pretrain_gpt.py``'s, or any with its keywords
    ``pre_process, post_process, vp_stage, config, pg_collection``) so that Megatron's
    ``get_model`` builds V-layout chunks with the same spec: chunk c of pipeline rank r is stage
    ``r`` (c = 0) or ``2p-1-r`` (c = 1), so rank 0 holds the embedding *and* the loss.

    ``get_model`` asks for pre/post-processing in Megatron's loop layout; the wrapper replaces
    them with the V layout's. Each V stage s is built at its loop position (pipeline rank
    ``s % p``, virtual stage ``s // p``: Megatron's pipeline-rank override and the pipeline
    group's ``rank()`` both answer that rank while it builds), so a
    ``--pipeline-model-parallel-layout`` string gives each V stage exactly the layers the
    string gives that stage, and the decoder layers' ``layer_number`` are the stage's global
    layers (they place the final layer norm under MTP and set the query-key scaling
    coefficient and checkpoint names).

    ``loop_init`` (default): every parameter starts as Megatron's 1F1B would start it. Megatron
    seeds each pipeline rank with ``seed + 100 * rank`` and draws the parameters in build
    order; under 1F1B rank q holds V stages 2q and 2q+1, so V stage s is built right after
    seeding as rank ``s // 2`` (Megatron's own ``_set_random_seed``), for an odd s after first
    building stage s-1 and dropping it, which draws what 1F1B drew before it. Every random
    state is put back afterwards. Under multi-token prediction 1F1B's last rank builds the MTP
    stage's embedding copy before its first layers, so an even stage 2q whose partner holds
    one starts after the partner's embedding draws (:func:`_draw_partners_embedding`). The
    cost: at start-up, a chunk's build time and memory once more for each odd stage (and up to
    its embedding for such an even stage). ``loop_init=False``: Megatron's seeding of this
    rank, as before.

    Tied embeddings (no ``--untie-embeddings-and-output-weights``) and MTP: the embedding
    (stage 0) and its copy on stage 2p-1 (the output layer's, or the MTP stage's embedding)
    are both on rank 0, so no chunk joins Megatron's embedding group. The copy starts as the
    embedding's values (Megatron's copy on the last stage starts from an all-reduce with the
    first), and :func:`sum_tied_embedding_grads` adds the two gradients on that rank where
    Megatron all-reduces them between ranks. MTP layers on any other stage are refused (their
    copy would be on another rank). Each chunk is annotated with ``pipeline_stage`` /
    ``pipeline_num_stages``."""
    built: dict[int, Any] = {}  # vp_stage -> chunk, on this rank (chunk 0 is built first)

    @functools.wraps(model_provider)
    def provider(pre_process=True, post_process=True, vp_stage=None, config=None,
                 pg_collection=None, **kwargs):
        pg_collection, p, r = two_chunk_placement(pg_collection, vp_stage, "the V layout")

        def build(stage: int):
            with _pipeline_rank_as(stage % p), \
                    _pipeline_group_as(pg_collection, stage % p) as stand_in:
                model = model_provider(
                    pre_process=(stage == 0), post_process=(stage == 2 * p - 1),
                    vp_stage=stage // p, config=config, pg_collection=pg_collection, **kwargs)
            _put_back_group(model, stand_in)
            return model

        stage = v_chunk_stage(r, p, vp_stage)
        if loop_init:
            with _seeded_as_pipeline_rank(stage // 2):
                if stage % 2:
                    build(stage - 1)  # dropped: it draws what 1F1B's rank drew before
                elif stage and _holds_mtp_layers(stage + 1, p):
                    _draw_partners_embedding(lambda: build(stage + 1))
                model = build(stage)
        else:
            model = build(stage)
        if _holds_embedding_copy(model) and stage != 2 * p - 1:
            raise ValueError(
                f"the V layout keeps the word embedding's copies on pipeline rank 0 (stages 0 "
                f"and {2 * p - 1}), but multi-token prediction puts one on stage {stage} "
                f"(rank {r}): put the MTP layers on the last stage (the default, or 'm' "
                f"just before 'L' in --pipeline-model-parallel-layout), or use a loop schedule")
        model.pipeline_stage, model.pipeline_num_stages = stage, 2 * p
        model.pipeline_v_layout = True
        built[vp_stage] = model
        if stage == 2 * p - 1 and _holds_embedding_copy(model):
            _start_tied_copy(built.get(0), model)
        _patch_once()
        return model

    provider.v_layout = True
    return provider


@contextlib.contextmanager
def _pipeline_rank_as(rank: int):
    """Megatron's ``get_pipeline_model_parallel_rank()`` returns ``rank`` inside (its own
    override, ``set_pipeline_model_parallel_rank``), and the previous override after."""
    from megatron.core import parallel_state

    before = megatron_compat.pipeline_rank_override()
    parallel_state.set_pipeline_model_parallel_rank(rank)
    try:
        yield
    finally:
        parallel_state.set_pipeline_model_parallel_rank(before)


@contextlib.contextmanager
def _seeded_as_pipeline_rank(rank: int):
    """Inside: every generator seeded as Megatron seeds pipeline rank ``rank`` at start-up
    (Megatron-LM's ``_set_random_seed`` with the run's arguments, through
    ``megatron_compat.set_random_seed_as_pipeline_rank``). After: every generator as it was
    before (Python, NumPy, torch's CPU and CUDA defaults, the CUDA RNG tracker's named
    states)."""
    from megatron.training import get_args

    saved = _rng_states()
    try:
        megatron_compat.set_random_seed_as_pipeline_rank(get_args(), rank, _pipeline_rank_as)
        yield
    finally:
        _set_rng_states(saved)


def _rng_states() -> tuple:
    """Every generator's state: Python, NumPy, torch's CPU and CUDA defaults, the CUDA RNG
    tracker's named states."""
    import numpy as np
    import torch
    from megatron.core import tensor_parallel

    return (random.getstate(), np.random.get_state(), torch.get_rng_state(),
            device_helper.cuda_rng_state(), tensor_parallel.get_cuda_rng_tracker().get_states())


def _set_rng_states(states: tuple) -> None:
    import numpy as np
    import torch
    from megatron.core import tensor_parallel

    random.setstate(states[0])
    np.random.set_state(states[1])
    torch.set_rng_state(states[2])
    device_helper.set_cuda_rng_state(states[3])
    tensor_parallel.get_cuda_rng_tracker().set_states(states[4])


def _holds_mtp_layers(stage: int, p: int) -> bool:
    """Whether V stage ``stage`` of 2p holds MTP layers (``stage_layers``: Megatron's
    placement of the run's arguments, a layout string's or the last stage by default)."""
    from megatron.training import get_args

    args = get_args()
    if not getattr(args, "mtp_num_layers", None):
        return False
    return stage_layers(args, p, 2)[stage].mtp > 0


class _EmbeddingBuilt(Exception):
    """Ends a build once its word embedding is constructed (:func:`_draw_partners_embedding`)."""


def _draw_partners_embedding(build_partner) -> None:
    """Under multi-token prediction the MTP stage keeps a copy of the word embedding, built
    (and drawn from the generators) before its decoder layers. Under 1F1B the rank that holds
    V stages 2q and 2q+1 builds that copy first, so stage 2q's layers start after its draws:
    start the partner's build (stage 2q+1, which holds the MTP layers), stop it right after
    its embedding and keep the generators' states of that moment; should it build no
    embedding, the build runs out and the states are as before. (The copy's values do not matter: Megatron overwrites them with the
    first stage's, as :func:`_start_tied_copy` does here.)"""
    from megatron.core.models.common.embeddings.language_model_embedding import (
        LanguageModelEmbedding,
    )

    original = LanguageModelEmbedding.__init__

    @functools.wraps(original)
    def init_then_stop(self, *args, **kwargs):
        original(self, *args, **kwargs)
        raise _EmbeddingBuilt

    before = _rng_states()
    LanguageModelEmbedding.__init__ = init_then_stop
    try:
        build_partner()
        _set_rng_states(before)  # the partner builds no embedding: nothing to skip
    except _EmbeddingBuilt:
        pass  # the generators stay past the embedding's draws
    finally:
        LanguageModelEmbedding.__init__ = original


def _holds_embedding_copy(model) -> bool:
    """Whether a chunk keeps a copy of the word embedding that is not the first stage's:
    Megatron's tied output layer, or the embedding of an MTP stage (Megatron's condition in
    ``LanguageModule.setup_embeddings_and_output_layer``)."""
    if getattr(model, "pre_process", False):
        return False
    return bool((getattr(model, "post_process", False)
                 and getattr(model, "share_embeddings_and_output_weights", False))
                or getattr(model, "mtp_process", False))


class _PipelineGroupAsRank:
    """The pipeline group, except that ``rank()`` answers the loop position's rank: what the
    model's modules read while a V stage is built (``get_pg_rank(pg_collection.pp)``: the
    decoder layers' numbers, hence which stage holds the final layer norm under MTP, and the
    layer configs of heterogeneous blocks). Everything else is the group's."""

    def __init__(self, group, rank: int):
        self._group, self._rank = group, rank

    def rank(self) -> int:
        return self._rank

    def __getattr__(self, name):
        return getattr(self._group, name)


@contextlib.contextmanager
def _pipeline_group_as(pg_collection, rank: int):
    """Inside: ``pg_collection.pp.rank()`` is ``rank``; yields the stand-in. After: the
    collection holds the real group again (:func:`_put_back_group` does the same for what the
    modules built inside kept)."""
    group = pg_collection.pp
    stand_in = _PipelineGroupAsRank(group, rank)
    pg_collection.pp = stand_in
    try:
        yield stand_in
    finally:
        pg_collection.pp = group


def _put_back_group(model, stand_in: _PipelineGroupAsRank) -> None:
    """Every module attribute that is the stand-in (Megatron's ``LanguageModule.pp_group``),
    or a process-group collection holding it, gets the real group: after the build nothing
    reads the loop position's rank or communicates through the stand-in."""
    for module in model.modules():
        for name, value in list(vars(module).items()):
            if value is stand_in:
                setattr(module, name, stand_in._group)
            elif getattr(value, "pp", None) is stand_in:
                value.pp = stand_in._group


def _start_tied_copy(embedding_chunk, output_chunk) -> None:
    """The last stage's copy of the word embedding (the tied output layer's, or an MTP
    stage's: Megatron fills it with zeros and expects an all-reduce with the embedding's rank)
    takes the embedding's values, on the one rank that holds both."""
    import torch

    if embedding_chunk is None or not getattr(embedding_chunk, "pre_process", False):
        raise ValueError(
            "tied embeddings or multi-token prediction under the V layout: the last stage's "
            "copy of the word embedding was built before the chunk with the embedding on this "
            "rank; build chunk 0 first (as Megatron's get_model does)")
    source = embedding_chunk.shared_embedding_or_output_weight()
    target = output_chunk.shared_embedding_or_output_weight()
    with torch.no_grad():
        target.copy_(source)


def tied_embedding_copies(model_chunks) -> tuple | None:
    """``(embedding weight, its copy on the last stage)`` when this rank holds both chunks of
    a V-layout model with tied embeddings or MTP (:func:`_holds_embedding_copy`), else None."""
    from megatron.core.utils import get_attr_wrapped_model

    inner = [get_attr_wrapped_model(chunk, "pre_process", return_model_obj=True)
             for chunk in model_chunks]
    v_chunks = [m for m in inner if getattr(m, "pipeline_v_layout", False)]
    first = [m for m in v_chunks if m.pre_process]
    last = [m for m in v_chunks if _holds_embedding_copy(m)]
    if not first or not last:
        return None
    return (first[0].shared_embedding_or_output_weight(),
            last[0].shared_embedding_or_output_weight())


def sum_tied_embedding_grads(model_chunks) -> bool:
    """On the rank that holds both copies of the word embedding (V layout: tied embeddings,
    MTP), give each the sum of both gradients (``main_grad`` under Megatron DDP), as
    Megatron's embedding-group all-reduce does between the first and the last rank; return
    whether this rank holds a pair."""
    pair = tied_embedding_copies(model_chunks)
    if pair is None:
        return False
    grads = [getattr(weight, "main_grad", None) for weight in pair]
    if any(grad is None for grad in grads):
        grads = [weight.grad for weight in pair]
    if all(grad is not None for grad in grads):
        total = grads[0] + grads[1]
        for grad in grads:
            grad.copy_(total)
    return True


def _is_v_layout_model(model_chunks) -> bool:
    from megatron.core.utils import get_attr_wrapped_model

    return any(getattr(get_attr_wrapped_model(chunk, "pre_process", return_model_obj=True),
                       "pipeline_v_layout", False) for chunk in model_chunks)


# --------------------------------------------------------------------------------------------
# Patches of Megatron (made once, by the first V chunk built; undone by undo_patches)
# --------------------------------------------------------------------------------------------

_PATCHED: list[tuple[Any, str, Any]] = []  # (owner, attribute, Megatron's original)


def _patch_once() -> None:
    if _PATCHED:
        return
    from megatron.training import training

    finalize_module = megatron_compat.finalize_grads_module()
    original = getattr(finalize_module, megatron_compat.WORD_EMBEDDING_GRADS)

    @functools.wraps(original)
    def allreduce_word_embedding_grads(model, config, *args, **kwargs):
        """Megatron's, except for V-layout chunks: their tied copies are both on rank 0 and
        none is in the embedding group, so the sum is taken on that rank."""
        if _is_v_layout_model(model):
            sum_tied_embedding_grads(model)
            return None
        return original(model, config, *args, **kwargs)

    for owner, attribute, replacement in (
            (training, "Float16Module", _v_layout_float16_module_class()),
            (finalize_module, megatron_compat.WORD_EMBEDDING_GRADS,
             allreduce_word_embedding_grads)):
        _PATCHED.append((owner, attribute, getattr(owner, attribute)))
        setattr(owner, attribute, replacement)


def undo_patches() -> None:
    """Put back what :func:`_patch_once` replaced (``megatron_pp_ext.uninstall()``)."""
    while _PATCHED:
        owner, attribute, original = _PATCHED.pop()
        setattr(owner, attribute, original)


@functools.lru_cache(maxsize=1)
def _v_layout_float16_module_class():
    """``get_model`` wraps each chunk in ``Float16Module`` for --bf16 / --fp16, which casts the
    inputs of Megatron's first stage and upcasts the outputs of its *last* stage, both found by
    the loop layout (rank p-1's chunk 1 upcasts hidden states it sends on; rank 0's loss chunk
    does not). The V-aware subclass asks a V chunk's own ``pre_process`` / ``post_process``;
    for any other chunk it is Megatron's ``Float16Module``."""
    from megatron.core.transformer.module import Float16Module, float16_to_fp32, fp32_to_float16

    class VLayoutFloat16Module(Float16Module):
        v_layout_aware = True

        def forward(self, *inputs, fp32_output=True, **kwargs):
            if not getattr(self.module, "pipeline_v_layout", False):
                return super().forward(*inputs, fp32_output=fp32_output, **kwargs)
            if self.module.pre_process:
                inputs = fp32_to_float16(inputs, self.float16_convertor)
            outputs = self.module(*inputs, **kwargs)
            if self.module.post_process and fp32_output is True:
                outputs = float16_to_fp32(outputs)
            return outputs

    return VLayoutFloat16Module


def model_provider_from_config(model_config):
    """A Megatron-LM model provider (``pre_process, post_process, vp_stage, config,
    pg_collection``) that builds one chunk with the builder of ``model_config`` (a
    ``megatron.training`` ModelConfig, e.g. ``gpt_config_from_args(args)``: the GPT spec
    ``pretrain_gpt.py`` trains)."""
    builder = model_config.get_builder_cls()(model_config)

    def provider(pre_process=True, post_process=True, vp_stage=None, config=None,
                 pg_collection=None):
        if pg_collection is None:
            from megatron.core.process_groups_config import ProcessGroupCollection

            pg_collection = ProcessGroupCollection.use_mpu_process_groups()
        return builder.build_model(pg_collection, pre_process=pre_process,
                                   post_process=post_process, vp_stage=vp_stage)

    return provider
