"""The drop-in ``forward_backward_func``: Megatron-Core 0.19.2's keyword signature, return
value, loss scaling and hooks, running whichever schedule is installed."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
from megatron.core import parallel_state
from megatron.core.pipeline_parallel.schedules import (
    _build_default_pg_collection,
    clear_embedding_activation_buffer,
    finish_embedding_wgrad_compute,
    get_tensor_shapes,
)
from megatron.core.utils import get_model_config

from .. import device as device_helper
from ..ir import Schedule
from ..runtime.executor import Executor, StepResult
from ..runtime.transport import TorchDistTransport
from ..schedules import build_schedule, get_spec
from .loss_relay import needs_relay, relay_losses
from .megatron_stage import GradSync, MegatronStageWork
from .options import PipelineOptions


@dataclass
class RunState:
    """What the plugin remembers between steps: the active options and the last step."""

    options: PipelineOptions = field(default_factory=PipelineOptions.from_kwargs)
    last_step: StepResult | None = None
    last_schedule: Schedule | None = None
    steps_run: int = 0


STATE = RunState()


@functools.lru_cache(maxsize=64)
def _cached_schedule(name: str, p: int, m: int, v: int, forward_only: bool,
                     options: tuple) -> Schedule:
    """Built and validated once per (schedule, p, m, v, options)."""
    return build_schedule(name, p, m, chunks=v, forward_only=forward_only, **dict(options))


@functools.lru_cache(maxsize=8)
def _transport_for(group) -> TorchDistTransport:
    return TorchDistTransport(group)


def schedule_for(options: PipelineOptions, p: int, m: int, num_chunks: int, forward_only: bool,
                 config=None) -> Schedule:
    """This step's schedule; checks the model chunks against what the schedule needs."""
    if not isinstance(m, int) or m < 1:
        raise ValueError(f"num_microbatches={m!r} must be an integer >= 1")
    spec = get_spec(options.schedule)
    v = options.chunks or (num_chunks if spec.layout != "v" else 2)
    if v != num_chunks:
        raise ValueError(
            f"schedule {options.schedule!r} runs v={v} model chunks per rank, but `model` holds "
            f"{num_chunks}; build the model with {v} chunk(s) per rank (vp_stage 0..{v - 1}) "
            f"and pass one data iterator per chunk"
        )
    builder_options = options.builder_options()
    if (spec.name == "interleaved" and "microbatch_group_size_per_vp_stage" not in builder_options
            and getattr(config, "microbatch_group_size_per_vp_stage", None)):
        builder_options["microbatch_group_size_per_vp_stage"] = (
            config.microbatch_group_size_per_vp_stage)
    return _cached_schedule(options.schedule, p, m, v, forward_only,
                            tuple(sorted(builder_options.items())))


def _as_list(value, name: str, expected: int) -> list:
    values = value if isinstance(value, list) else [value]
    if len(values) != expected:
        raise ValueError(f"`{name}` holds {len(values)} entries but the model has {expected} "
                         f"chunk(s) on this rank; pass one per chunk")
    return values


def forward_backward_pipelining(
    *,
    forward_step_func,
    data_iterator,
    model,
    num_microbatches: int,
    seq_length: int,
    micro_batch_size: int,
    decoder_seq_length: int | None = None,
    forward_only: bool = False,
    collect_non_loss_data: bool = False,
    first_val_step: bool | None = None,
    adjust_tensor_shapes_fn=None,
    p2p_communicator=None,
    pg_collection=None,
    force_all_reduce: bool | None = False,
):
    """Run one step of the installed schedule; returns the last stage's per-microbatch
    outputs of the loss function (``[]`` on the other ranks), as Megatron does."""
    options = STATE.options
    models = model if isinstance(model, list) else [model]
    iterators = _as_list(data_iterator, "data_iterator", len(models))
    config = get_model_config(models[0])

    if pg_collection is None:
        pg_collection = _build_default_pg_collection()
    pp_group = p2p_communicator.pp_group if p2p_communicator is not None else pg_collection.pp
    tp_group, cp_group = pg_collection.tp, pg_collection.cp
    p, rank = pp_group.size(), pp_group.rank()

    schedule = schedule_for(options, p, num_microbatches, len(models), forward_only, config)
    last_stage_here = schedule.rank_of(schedule.num_stages - 1) == rank

    shapes = get_tensor_shapes(seq_length=seq_length, micro_batch_size=micro_batch_size,
                               decoder_seq_length=decoder_seq_length, config=config,
                               tp_group=tp_group, cp_group=cp_group)
    if adjust_tensor_shapes_fn is not None:
        shapes, _ = adjust_tensor_shapes_fn(shapes, shapes)
    variable = bool(config.variable_seq_lengths)
    recv_shape = None if variable else tuple(shapes[0])
    transport = _transport_for(pp_group)

    embedding_module = None
    if config.finalize_model_grads_func is not None and not forward_only:
        embedding_module = clear_embedding_activation_buffer(config, models, last_stage_here)
    if config.timers is not None:
        config.timers("forward-backward", log_level=1).start(barrier=config.barrier_with_L1_time)

    grad_sync = GradSync(config, models, schedule, rank, forward_only)
    weight_split = None
    if schedule.uses_split_backward():
        from ..runtime.wgrad import WeightGradSplit

        weight_split = WeightGradSplit(models)
    work = MegatronStageWork(
        schedule=schedule, rank=rank, forward_step_func=forward_step_func,
        data_iterators=iterators, model_chunks=models, num_microbatches=num_microbatches,
        config=config, cp_size=cp_group.size(), collect_non_loss_data=collect_non_loss_data,
        first_val_step=first_val_step, forward_only=forward_only,
        token_device=device_helper.comm_device(pp_group), grad_sync=grad_sync,
        weight_split=weight_split,
    )
    grad_sync.start()
    timeout = options.first_timeout_s if STATE.steps_run == 0 else options.p2p_timeout_s
    executor = Executor(schedule, rank, transport, work, recv_shape=recv_shape,
                        dtype=config.pipeline_dtype or torch.float32,
                        device=transport.device, timeout_s=timeout, variable_shapes=variable,
                        trace=options.trace, timers=config.timers)
    result = executor.run()
    grad_sync.finish()
    if weight_split is not None:
        weight_split.assert_drained()

    if config.finalize_model_grads_func is not None and not forward_only:
        finish_embedding_wgrad_compute(config, embedding_module, last_stage_here, tp_group)
        config.finalize_model_grads_func(
            models,
            work.total_num_tokens if config.calculate_per_token_loss else None,
            pg_collection=pg_collection,
            force_all_reduce=force_all_reduce,
        )
    if config.timers is not None:
        config.timers("forward-backward").stop()

    STATE.last_step, STATE.last_schedule = result, schedule
    STATE.steps_run += 1
    if needs_relay(schedule):
        return relay_losses(work.forward_data_store, schedule, rank, pp_group, transport.device)
    return work.forward_data_store if last_stage_here else []


class ScheduleFunction:
    """A ``forward_backward_func`` bound to given options (picklable: usable as a spawn
    target's argument, and for running schedules side by side without install())."""

    def __init__(self, schedule: str = "1f1b", **options):
        self.options = PipelineOptions.from_kwargs(schedule, **options)

    def __call__(self, **kwargs):
        if STATE.options != self.options:
            STATE.options, STATE.steps_run = self.options, 0
        return forward_backward_pipelining(**kwargs)

    def __repr__(self) -> str:
        return f"ScheduleFunction({self.options.schedule!r})"
