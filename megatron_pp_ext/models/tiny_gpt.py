"""A tiny, real Megatron-Core ``GPTModel`` (local layer spec, fp32) that trains on the CPU, split
into pipeline stages the way Megatron does it, plus its data and its ``forward_step_func``.

Stages and layouts
------------------
With ``p`` pipeline ranks and ``v`` model chunks per rank there are ``S = p * v`` stages; stage
``s`` holds the decoder layers ``[s * L/S, (s+1) * L/S)``; stage 0 also holds the embeddings
(``pre_process``) and stage ``S-1`` the final layernorm, the output layer and the loss
(``post_process``).

* ``layout="loop"`` (Megatron's interleaved placement): chunk ``c`` of rank ``r`` is stage
  ``c*p + r``. This is exactly what Megatron builds from ``vp_stage=c`` and
  ``parallel_state.is_pipeline_first_stage / is_pipeline_last_stage(ignore_virtual=False,
  vp_stage=c)``, and what we build here through Megatron's own machinery.
* ``layout="v"`` (ZB-V, DualPipeV; ``v = 2``): rank ``r`` holds stages ``r`` and ``2p-1-r``, so
  rank 0 has both the first stage (chunk 0, ``pre_process``) and the last (chunk 1,
  ``post_process``). Megatron-Core 0.19.2 cannot express this: its
  ``pipeline_model_parallel_layout`` and ``get_transformer_layer_offset`` always number stages
  ``vp_stage * p + pp_rank``. How to build V chunks anyway (what :func:`build_model_chunks`
  does, and what a user has to do for their own model):

  1. initialize Megatron with ``virtual_pipeline_model_parallel_size=2`` and give the
     ``TransformerConfig`` ``virtual_pipeline_model_parallel_size=2``, so that each chunk builds
     ``L / 2p`` layers (every stage has the same number of layers in both placements);
  2. build chunk ``c`` with ``GPTModel(..., vp_stage=c, pre_process=(stage == 0),
     post_process=(stage == 2p-1))`` where ``stage = r if c == 0 else 2p-1-r`` -- pass
     ``pre_process`` / ``post_process`` explicitly, never from ``is_pipeline_first_stage``;
  3. Megatron numbers the layers of chunk 1 as loop stage ``p + r``; renumber them
     (``layer_number`` of each layer and of its attention modules; only used for the
     ``apply_query_key_layer_scaling`` softmax coefficient and in checkpoint naming) and load
     the weights of *global* layers ``[stage * L/S, (stage+1) * L/S)`` into it;
  4. keep the word embeddings untied (``share_embeddings_and_output_weights=False``):
     Megatron's embedding group is {first pp rank, last pp rank}, which is wrong for V.
     Megatron's ``sharded_state_dict`` still uses loop offsets: distributed checkpoints of V
     chunks need a remap.
  5. a schedule driving V chunks must pass ``is_last_stage`` (and ``vp_stage``) to Megatron's
     ``forward_step`` explicitly; ``forward_step_calc_loss``'s fallback asks
     ``parallel_state.is_pipeline_last_stage``, which answers for the loop placement.
* ``layout="dual"`` (dualpipe; ``v = 2``): the model is split into ``p`` parts as for 1F1B, and
  rank ``r`` holds part ``r`` (chunk 0) and a copy of part ``p-1-r`` (chunk 1; its parameters
  marked ``shared``, so Megatron's grad norm counts each part once). Each chunk is built as a
  one-chunk 1F1B stage (the config and Megatron's parallel state say no virtual stages while
  it builds); ``pipeline_stage`` is the part.

Same weights whatever the split: every parameter is initialized from its *global* name (e.g.
``decoder.layers.5.mlp.linear_fc1.weight``) with a generator seeded by (seed, name), so the
pp=1 model and any (p, v, layout) split hold identical weights, and gradients can be compared
per global parameter name.
"""

from __future__ import annotations

import dataclasses
import re
import zlib
from functools import partial
from typing import Any, Iterable, Optional, Sequence

import torch

from .. import megatron_compat
from ..integration.stage_copies import mark_copies

__all__ = [
    "TinyGPTConfig",
    "make_transformer_config",
    "num_stages",
    "chunk_stages",
    "stage_owner",
    "stage_layers",
    "build_model_chunks",
    "init_weights",
    "global_param_name",
    "named_global_parameters",
    "global_grads",
    "unwrap",
    "mock_batches",
    "forward_step_func",
    "forward_step_func_per_token",
    "loss_func",
    "loss_func_per_token",
    "configure_hooks",
    "LAYOUTS",
]

LAYOUTS = ("loop", "v", "dual")


@dataclasses.dataclass(frozen=True)
class TinyGPTConfig:
    """Sizes of the tiny GPT. ``num_layers`` must divide by ``pp * vp`` (8 serves p in {1,2,4},
    v in {1,2}, and the V layout with p in {1,2,4})."""

    num_layers: int = 8
    hidden_size: int = 32
    num_attention_heads: int = 4
    ffn_hidden_size: Optional[int] = None  # default 4 * hidden_size
    vocab_size: int = 128
    seq_length: int = 16
    micro_batch_size: int = 2
    seed: int = 1234
    init_std: float = 0.02
    # Fraction of label positions masked out of the loss (exercises loss_mask).
    loss_mask_drop: float = 0.125


def make_transformer_config(
    cfg: TinyGPTConfig = TinyGPTConfig(),
    pp_size: int = 1,
    vp_size: Optional[int] = None,
    tp_size: int = 1,
    sequence_parallel: bool = False,
    **overrides: Any,
):
    """Megatron ``TransformerConfig`` for the tiny GPT: fp32 everywhere (params, pipeline),
    no dropout, deterministic, no fusions, CPU initialization. ``overrides`` go straight to
    ``TransformerConfig`` (e.g. ``deallocate_pipeline_outputs=True``).

    ``tp_size`` / ``sequence_parallel``: Megatron's tensor parallelism (its column/row parallel
    linears, the vocabulary-parallel embedding and loss) and sequence parallelism; Megatron's
    parallel state must have the same tensor-parallel size (``init_megatron(..., tp=tp_size)``).
    With sequence parallelism :func:`build_model_chunks` uses :class:`SequenceParallelTorchNorm`
    (Megatron's torch norm refuses it; apex and TE are GPU-only).

    P2P flags follow ``megatron.training``'s defaults rather than ``TransformerConfig``'s:
    interleaved (vp set) -> ``overlap_p2p_comm=True, batch_p2p_comm=False``; otherwise
    ``overlap_p2p_comm=False, batch_p2p_comm=True``. This matters at pp=2: there the previous
    and the next rank are the same peer, and Megatron's interleaved schedule with
    ``batch_p2p_comm=True`` posts send_prev, recv_prev, send_next, recv_next in one batch;
    gloo pairs same-peer same-tag messages in posting order, so activations arrive as
    gradients and vice versa (silently: same shapes). Megatron-LM's argument check forbids
    that combination ("pipeline-model-parallel size should be greater than 2 ...");
    ``TransformerConfig`` does not."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    if vp_size is not None and vp_size < 2:
        vp_size = None
    interleaved = vp_size is not None
    kwargs: dict[str, Any] = dict(
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        ffn_hidden_size=cfg.ffn_hidden_size,
        pipeline_model_parallel_size=pp_size,
        virtual_pipeline_model_parallel_size=vp_size,
        tensor_model_parallel_size=tp_size,
        sequence_parallel=sequence_parallel,
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
        fp16=False,
        bf16=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        deterministic_mode=True,
        use_cpu_initialization=True,
        perform_initialization=False,  # init_weights() sets every parameter
        gradient_accumulation_fusion=False,
        masked_softmax_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        init_method_std=cfg.init_std,
        overlap_p2p_comm=interleaved,
        batch_p2p_comm=not interleaved,
    )
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


# --------------------------------------------------------------------------------------------
# Stage placement
# --------------------------------------------------------------------------------------------


def _check_layout(pp_size: int, vp_size: Optional[int], layout: str) -> int:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    v = vp_size or 1
    if layout in ("v", "dual") and v != 2:
        raise ValueError(f"layout={layout!r} needs exactly 2 chunks per rank (vp_size=2), got "
                         f"{vp_size}")
    if layout == "dual" and pp_size % 2:
        raise ValueError(f"layout='dual' pairs rank r with rank p-1-r: pp_size must be even, "
                         f"got {pp_size}")
    if pp_size < 1 or v < 1:
        raise ValueError(f"pp_size and vp_size must be >= 1, got {pp_size}, {vp_size}")
    return v


def num_stages(pp_size: int, vp_size: Optional[int] = None) -> int:
    """Total number of pipeline stages, ``pp * vp``."""
    return pp_size * (vp_size or 1)


def chunk_stages(
    pp_rank: int, pp_size: int, vp_size: Optional[int] = None, layout: str = "loop"
) -> list[int]:
    """The stage held by each model chunk of ``pp_rank`` (chunk order = ``vp_stage`` order)."""
    v = _check_layout(pp_size, vp_size, layout)
    if layout in ("v", "dual"):  # dual: the IR's stages, part r and (stage p + k = part k)
        return [pp_rank, 2 * pp_size - 1 - pp_rank]
    return [c * pp_size + pp_rank for c in range(v)]


def stage_owner(
    stage: int, pp_size: int, vp_size: Optional[int] = None, layout: str = "loop"
) -> tuple[int, int]:
    """(pp_rank, chunk index) that holds ``stage``."""
    for rank in range(pp_size):
        stages = chunk_stages(rank, pp_size, vp_size, layout)
        if stage in stages:
            return rank, stages.index(stage)
    raise ValueError(f"stage {stage} out of range for pp={pp_size}, vp={vp_size}")


def stage_layers(cfg: TinyGPTConfig, stage: int, n_stages: int) -> range:
    """Global (0-based) decoder layer indices of ``stage``."""
    if cfg.num_layers % n_stages != 0:
        raise ValueError(
            f"num_layers={cfg.num_layers} must divide by the number of stages {n_stages}"
        )
    per = cfg.num_layers // n_stages
    return range(stage * per, (stage + 1) * per)


# --------------------------------------------------------------------------------------------
# Building
# --------------------------------------------------------------------------------------------


class SequenceParallelTorchNorm(torch.nn.LayerNorm):
    """torch's ``LayerNorm`` with Megatron's norm signature whose parameters carry
    ``sequence_parallel`` (as Megatron's apex ``FusedLayerNorm`` and ``TENorm`` mark theirs), so
    ``finalize_model_grads`` all-reduces their gradients over the tensor-parallel group. For
    sequence parallelism on the CPU: Megatron's ``WrappedTorchNorm`` asserts it is off."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_unused: Any):
        super().__init__(hidden_size, eps=eps)
        for param in self.parameters():
            setattr(param, "sequence_parallel", bool(config.sequence_parallel))


def transformer_layer_spec(config, layer_spec=None):
    """The layer spec the tiny GPT is built from: ``layer_spec`` (default Megatron's
    ``get_gpt_layer_local_spec()``), its norms swapped for :class:`SequenceParallelTorchNorm`
    when ``config.sequence_parallel``."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = layer_spec if layer_spec is not None else get_gpt_layer_local_spec()
    if not config.sequence_parallel:
        return spec
    submodules = dataclasses.replace(spec.submodules, input_layernorm=SequenceParallelTorchNorm,
                                     pre_mlp_layernorm=SequenceParallelTorchNorm)
    return dataclasses.replace(spec, submodules=submodules)


def _chunk_sizes(parallel_state, pp_rank: Optional[int], pp_size: Optional[int],
                 vp_size: Optional[int], layout: str) -> tuple[int, int, Optional[int]]:
    """``(pp_rank, pp_size, vp_size)`` with the defaults filled in: pp from Megatron's
    ``parallel_state`` (the module, passed by the caller that imported it), vp None for one
    chunk per rank, 2 for the V layout."""
    if pp_rank is None:
        pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    if pp_size is None:
        pp_size = parallel_state.get_pipeline_model_parallel_world_size()
    if vp_size is not None and vp_size < 2:
        vp_size = None
    if layout in ("v", "dual") and vp_size is None:
        vp_size = 2
    return pp_rank, pp_size, vp_size


def _check_sizes_agree(parallel_state, config, pp_size: int, vp_size: Optional[int],
                       v: int) -> None:
    """The ``TransformerConfig`` and, once initialized, Megatron's parallel state must have the
    pp and vp sizes the chunks are built for: else Megatron would build other layers."""
    if config.pipeline_model_parallel_size != pp_size or (
        config.virtual_pipeline_model_parallel_size or 1
    ) != v:
        raise ValueError(
            f"config has pp={config.pipeline_model_parallel_size}, "
            f"vp={config.virtual_pipeline_model_parallel_size}; expected pp={pp_size}, vp={vp_size}"
        )
    if parallel_state.model_parallel_is_initialized():
        mp_pp = parallel_state.get_pipeline_model_parallel_world_size()
        mp_vp = parallel_state.get_virtual_pipeline_model_parallel_world_size() or 1
        if (mp_pp, mp_vp) != (pp_size, v):
            raise ValueError(
                f"Megatron's parallel state has pp={mp_pp}, vp={mp_vp}; asked for pp={pp_size}, "
                f"vp={v}: call launch.init_megatron({pp_size}, {vp_size}) first"
            )


def _pre_post_process(parallel_state, layout: str, stage: int, n_stages: int,
                      vp_stage: Optional[int]) -> tuple[bool, bool]:
    """``(pre_process, post_process)`` of ``stage``: whether it holds the embeddings, and the
    output layer and loss. In the loop layout, once Megatron is initialized, Megatron's own
    answer (checked against ours); the V layout's cannot come from Megatron (module notes)."""
    pre_process = stage == 0
    post_process = stage == n_stages - 1
    if layout == "loop" and parallel_state.model_parallel_is_initialized():
        # The loop placement is Megatron's own: take pre/post from it and check our map.
        mg_pre = parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
        mg_post = parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
        assert (mg_pre, mg_post) == (pre_process, post_process), (stage, mg_pre, mg_post)
        pre_process, post_process = mg_pre, mg_post
    return pre_process, post_process


def _finish_chunk(model: torch.nn.Module, cfg: TinyGPTConfig, stage: int, n_stages: int,
                  init: bool) -> None:
    """Check that Megatron built ``stage``'s layers, give them their global numbers, annotate
    the chunk with its stage and, with ``init``, fill its weights from their global names."""
    layers = stage_layers(cfg, stage, n_stages)
    if len(model.decoder.layers) != len(layers):
        raise AssertionError(
            f"Megatron built {len(model.decoder.layers)} layers for stage {stage}, "
            f"expected {len(layers)}"
        )
    _renumber_layers(model, layers.start)
    model.pipeline_stage = stage  # our annotation: the global stage index of this chunk
    model.pipeline_num_stages = n_stages
    if init:
        init_weights(model, cfg)


def build_model_chunks(
    cfg: TinyGPTConfig = TinyGPTConfig(),
    pp_rank: Optional[int] = None,
    pp_size: Optional[int] = None,
    vp_size: Optional[int] = None,
    layout: str = "loop",
    config=None,
    wrap_ddp: bool = False,
    ddp_config=None,
    init: bool = True,
    layer_spec=None,
) -> list[torch.nn.Module]:
    """This rank's model chunks (a list, chunk ``c`` has ``vp_stage=c``), built with Megatron's
    own ``GPTModel`` and ``get_gpt_layer_local_spec``. Megatron's parallel state must be
    initialized with the same pp (and vp) sizes (see ``launch.init_megatron``).

    ``pp_rank`` / ``pp_size`` default to Megatron's parallel state; ``config`` to
    :func:`make_transformer_config`. With ``wrap_ddp`` each chunk is wrapped in Megatron's
    ``DistributedDataParallel`` like ``megatron.training.get_model`` does (bucketing disabled
    for chunks after the first); grads then land in ``param.main_grad``. ``init`` fills every
    parameter from its global name (see the module doc; under tensor parallelism each rank's
    shard is filled from the name too, so the shards of one weight are equal, not slices of a
    pp=1 weight: compare runs of the same tp). ``layer_spec``: a ``TransformerLayer`` spec to
    build from instead of Megatron's local one (e.g. other linear modules; see
    :func:`transformer_layer_spec`)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    pp_rank, pp_size, vp_size = _chunk_sizes(parallel_state, pp_rank, pp_size, vp_size, layout)
    v = _check_layout(pp_size, vp_size, layout)
    n_stages = num_stages(pp_size, vp_size)
    stage_layers(cfg, 0, n_stages)  # validates divisibility
    if config is None:
        config = make_transformer_config(cfg, pp_size, vp_size)
    _check_sizes_agree(parallel_state, config, pp_size, vp_size, v)

    if layout == "dual":
        chunks = _dual_chunks(cfg, pp_rank, pp_size, config, layer_spec, init)
        return wrap_with_ddp(chunks, config, ddp_config) if wrap_ddp else chunks
    stages = chunk_stages(pp_rank, pp_size, vp_size, layout)
    chunks: list[torch.nn.Module] = []
    for chunk_id, stage in enumerate(stages):
        vp_stage = chunk_id if vp_size is not None else None
        pre_process, post_process = _pre_post_process(parallel_state, layout, stage, n_stages,
                                                      vp_stage)
        spec = transformer_layer_spec(config, layer_spec)
        if config.sequence_parallel:  # the block's final norm too
            spec = TransformerBlockSubmodules(
                layer_specs=[spec] * len(stage_layers(cfg, stage, n_stages)),
                layer_norm=SequenceParallelTorchNorm)
        model = GPTModel(
            config=config,
            transformer_layer_spec=spec,
            vocab_size=cfg.vocab_size,
            max_sequence_length=cfg.seq_length,
            pre_process=pre_process,
            post_process=post_process,
            share_embeddings_and_output_weights=False,
            position_embedding_type="learned_absolute",
            vp_stage=vp_stage,
        )
        _finish_chunk(model, cfg, stage, n_stages, init)
        chunks.append(model)

    if wrap_ddp:
        chunks = wrap_with_ddp(chunks, config, ddp_config)
    return chunks


def _dual_chunks(cfg: TinyGPTConfig, pp_rank: int, pp_size: int, config, layer_spec,
                 init: bool) -> list[torch.nn.Module]:
    """dualpipe's two chunks: part r and a copy of part p-1-r, each built as 1F1B's stage (no
    virtual stages while it builds), the copy's parameters marked ``shared``."""
    import copy

    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel


    one_chunk = copy.copy(config)
    one_chunk.virtual_pipeline_model_parallel_size = None
    stage_layers(cfg, 0, pp_size)  # validates divisibility
    chunks = []
    for chunk_id, part in enumerate((pp_rank, pp_size - 1 - pp_rank)):
        before = parallel_state.get_virtual_pipeline_model_parallel_world_size()
        override = megatron_compat.pipeline_rank_override()
        parallel_state.set_virtual_pipeline_model_parallel_world_size(None)
        parallel_state.set_pipeline_model_parallel_rank(part)
        try:
            model = GPTModel(
                config=one_chunk, transformer_layer_spec=transformer_layer_spec(one_chunk,
                                                                                layer_spec),
                vocab_size=cfg.vocab_size, max_sequence_length=cfg.seq_length,
                pre_process=part == 0, post_process=part == pp_size - 1,
                share_embeddings_and_output_weights=False,
                position_embedding_type="learned_absolute", vp_stage=None)
        finally:
            parallel_state.set_virtual_pipeline_model_parallel_world_size(before)
            parallel_state.set_pipeline_model_parallel_rank(override)
        _finish_chunk(model, cfg, part, pp_size, init)
        model.pipeline_part = part
        if chunk_id == 1:
            mark_copies(model)
        chunks.append(model)
    return chunks


def _renumber_layers(model: torch.nn.Module, first_global_layer: int) -> None:
    """Make each layer's ``layer_number`` (1-based, global) match its stage: identity for the
    loop layout, a shift for chunk 1 of the V layout. Applied to every submodule of the layer
    that keeps a ``layer_number`` (the layer, its attention, its core attention)."""
    for i, layer in enumerate(model.decoder.layers):
        want = first_global_layer + i + 1
        delta = want - layer.layer_number
        if delta == 0:
            continue
        for mod in layer.modules():
            n = getattr(mod, "layer_number", None)
            if isinstance(n, int) and not isinstance(n, bool):
                mod.layer_number = n + delta


def wrap_with_ddp(chunks: Sequence[torch.nn.Module], config, ddp_config=None):
    """Wrap each chunk in Megatron's ``DistributedDataParallel`` as ``megatron.training`` does
    (one config for all chunks, bucketing disabled for chunks after the first)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    if ddp_config is None:
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=False, overlap_grad_reduce=False, use_distributed_optimizer=False
        )
    return [
        DistributedDataParallel(
            config=config, ddp_config=ddp_config, module=chunk, disable_bucketing=(i > 0)
        )
        for i, chunk in enumerate(chunks)
    ]


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel inside DDP / Float16Module wrappers."""
    while hasattr(model, "module") and not hasattr(model, "pipeline_stage"):
        model = model.module
    return model


# --------------------------------------------------------------------------------------------
# Global names, weights and gradients
# --------------------------------------------------------------------------------------------

_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.")


def global_param_name(local_name: str, first_global_layer: int) -> str:
    """Map a chunk-local parameter name to the name it has in the pp=1 model."""
    local_name = re.sub(r"^(module\.)+", "", local_name)
    m = _LAYER_RE.match(local_name)
    if m is None:
        return local_name
    return f"decoder.layers.{int(m.group(1)) + first_global_layer}." + local_name[m.end():]


def named_global_parameters(
    chunks: Iterable[torch.nn.Module], cfg: TinyGPTConfig = TinyGPTConfig()
) -> dict[str, torch.nn.Parameter]:
    """{global name: parameter} over this rank's chunks (built by :func:`build_model_chunks`)."""
    out: dict[str, torch.nn.Parameter] = {}
    for chunk in chunks:
        model = unwrap(chunk)
        first = stage_layers(cfg, model.pipeline_stage, model.pipeline_num_stages).start
        for name, param in model.named_parameters():
            gname = global_param_name(name, first)
            if gname in out:
                raise AssertionError(f"parameter {gname} held by two chunks of one rank")
            out[gname] = param
    return out


def _name_seed(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63 - 1)


@torch.no_grad()
def init_weights(model: torch.nn.Module, cfg: TinyGPTConfig = TinyGPTConfig()) -> None:
    """Fill every parameter of one chunk from its global name: layernorm weights 1 + N(0, 0.1),
    biases and layernorm biases N(0, 0.02), matrices N(0, init_std). Deterministic per
    (cfg.seed, global name): the same values whatever pp / vp / layout."""
    model = unwrap(model)
    first = stage_layers(cfg, model.pipeline_stage, model.pipeline_num_stages).start
    for name, param in model.named_parameters():
        gname = global_param_name(name, first)
        gen = torch.Generator(device="cpu").manual_seed(_name_seed(cfg.seed, gname))
        values = torch.randn(param.shape, generator=gen, dtype=torch.float32)
        if "layernorm" in gname and gname.endswith(".weight"):
            values = 1.0 + 0.1 * values
        elif gname.endswith(".bias"):
            values = 0.02 * values
        else:
            values = cfg.init_std * values
        param.copy_(values.to(dtype=param.dtype, device=param.device))


def global_grads(
    chunks: Iterable[torch.nn.Module], cfg: TinyGPTConfig = TinyGPTConfig()
) -> dict[str, torch.Tensor]:
    """{global name: gradient} over this rank's chunks: ``param.main_grad`` under Megatron DDP,
    else ``param.grad`` (zeros if None). Detached CPU clones, safe to return from a rank."""
    out = {}
    for gname, param in named_global_parameters(chunks, cfg).items():
        grad = getattr(param, "main_grad", None)
        if grad is None:
            grad = param.grad
        if grad is None:
            grad = torch.zeros_like(param)
        out[gname] = grad.detach().to("cpu", copy=True)
    return out


# --------------------------------------------------------------------------------------------
# Data and the forward step
# --------------------------------------------------------------------------------------------


def mock_batches(
    cfg: TinyGPTConfig = TinyGPTConfig(), num_microbatches: int = 8, seed: int = 0
) -> list[dict[str, torch.Tensor]]:
    """``num_microbatches`` deterministic microbatches (dicts, like Megatron's ``get_batch``):
    tokens / labels [b, s] int64 (labels = tokens shifted by one), loss_mask [b, s] float32
    (a few zeros), position_ids [b, s], attention_mask [1, 1, s, s] bool, True = masked
    (causal, as ``get_ltor_masks_and_position_ids`` makes it)."""
    gen = torch.Generator(device="cpu").manual_seed(int(seed))
    b, s = cfg.micro_batch_size, cfg.seq_length
    attention_mask = torch.tril(torch.ones(1, 1, s, s)) < 0.5
    position_ids = torch.arange(s, dtype=torch.int64).unsqueeze(0).expand(b, s).contiguous()
    batches = []
    for _ in range(num_microbatches):
        text = torch.randint(0, cfg.vocab_size, (b, s + 1), generator=gen, dtype=torch.int64)
        loss_mask = (torch.rand(b, s, generator=gen) >= cfg.loss_mask_drop).float()
        loss_mask[:, 0] = 1.0  # never an all-zero mask
        batches.append(
            dict(
                tokens=text[:, :-1].contiguous(),
                labels=text[:, 1:].contiguous(),
                loss_mask=loss_mask,
                position_ids=position_ids.clone(),
                attention_mask=attention_mask.clone(),
            )
        )
    return batches


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Megatron's 2-tuple loss contract: (masked mean loss, {'lm loss': detached loss}). The
    schedule divides the returned loss by the number of microbatches."""
    losses = output_tensor.float().view(-1)
    mask = loss_mask.float().view(-1)
    loss = torch.sum(losses * mask) / mask.sum()
    return loss, {"lm loss": loss.detach().clone()}


def loss_func_per_token(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Megatron's 3-tuple contract (as ``pretrain_gpt``): (summed loss, number of tokens,
    {'lm loss': [sum, tokens]}). Use with ``config.calculate_per_token_loss=True``."""
    losses = output_tensor.float().view(-1)
    mask = loss_mask.float().view(-1)
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().clone().detach().to(torch.int)
    report = torch.cat([loss.clone().detach().view(1), num_tokens.float().view(1)])
    return loss, num_tokens, {"lm loss": report}


def _run_model(data_iterator, model):
    batch = next(data_iterator)
    output = model(
        batch["tokens"],
        batch["position_ids"],
        batch["attention_mask"],
        labels=batch["labels"],
    )
    return output, batch["loss_mask"]


def forward_step_func(data_iterator, model):
    """Megatron-style forward step: one microbatch from ``data_iterator`` through ``model``;
    returns (output_tensor, partial(loss_func, loss_mask)). On a chunk without
    ``post_process`` the output is the hidden state and the loss function is not called."""
    output, loss_mask = _run_model(data_iterator, model)
    return output, partial(loss_func, loss_mask)


def forward_step_func_per_token(data_iterator, model):
    """As :func:`forward_step_func`, with the 3-tuple :func:`loss_func_per_token`."""
    output, loss_mask = _run_model(data_iterator, model)
    return output, partial(loss_func_per_token, loss_mask)


# --------------------------------------------------------------------------------------------
# Hooks
# --------------------------------------------------------------------------------------------


def configure_hooks(config, model_chunks: Sequence[torch.nn.Module], align_grad_reduce: bool = True):
    """Set ``config.no_sync_func`` / ``grad_sync_func`` / ``finalize_model_grads_func`` the way
    ``megatron.training.training.train`` does (``overlap_grad_reduce`` taken from the chunks'
    ``ddp_config``). Without DDP-wrapped chunks nothing is set (Megatron's
    ``finalize_model_grads`` needs DDP's ``finish_grad_sync``). Returns ``config``."""
    from megatron.core.distributed import DistributedDataParallel, finalize_model_grads

    chunks = list(model_chunks)
    if not chunks or not all(isinstance(c, DistributedDataParallel) for c in chunks):
        return config
    if chunks[0].ddp_config.overlap_grad_reduce:
        config.no_sync_func = [c.no_sync for c in chunks]
        if len(chunks) == 1:
            config.no_sync_func = config.no_sync_func[0]
        if align_grad_reduce:
            config.grad_sync_func = [c.start_grad_sync for c in chunks]
            if len(chunks) == 1:
                config.grad_sync_func = config.grad_sync_func[0]
    if config.finalize_model_grads_func is None:
        config.finalize_model_grads_func = finalize_model_grads
    return config
