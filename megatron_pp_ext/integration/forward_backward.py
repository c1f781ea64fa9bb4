"""The drop-in ``forward_backward_func``: Megatron-Core 0.19.2's keyword signature, return
value, loss scaling and hooks, running whichever schedule is installed.

``ScheduleFunction(schedule, **options)`` is that function; ``install()`` hands one to
Megatron. Each keeps what it remembers between steps on its own ``RunState`` (``.state``), so
two functions (two installations, or schedules run side by side) share nothing.

Around the executor: bad input is rejected before any communication (a ``ValueError`` that
names the values, the rule and the fix); before the first step of each distinct setting the
pipeline ranks agree on it (``agreement.check_agreement``: a mismatch raises on every rank)
and pipeline rank 0 logs the plan (``plan.plan_text``, logger "megatron_pp_ext", INFO);
with ``trace=True`` every step's measured timeline lands in ``state.last_timeline`` on
pipeline rank 0, beside the simulator's prediction under the measured costs
(``state.last_predicted``; ``trace.summary_text`` prints both) and its scalars
(``state.last_metrics``, written to Megatron's tensorboard / wandb writers when configured).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field

import torch
from megatron.core import parallel_state
from megatron.core.pipeline_parallel.schedules import (
    clear_embedding_activation_buffer,
    finish_embedding_wgrad_compute,
    get_tensor_shapes,
)
from megatron.core.utils import get_model_config

from .. import device as device_helper
from .. import megatron_compat
from ..analysis.lowering import runtime_program
from ..analysis.program_steps import compile_steps
from ..ir import Schedule, ScheduleError
from ..program import Program
from ..runtime import trace as tracing
from ..runtime.errors import PipelineTimeoutError
from ..runtime.executor import Executor, StepResult
from ..runtime.transport import TorchDistTransport
from ..runtime.wgrad import WeightGradSplit
from ..schedules import (AUTO, AUTO_LAYOUT, DUAL_LAYOUT, build_schedule, get_spec,
                         schedule_layout)
from ..timeline import Timeline
from . import agreement
from .auto import AutoSchedule
from .direction_data import direction_iterators, finish_step
from .expert_groups import check_expert_group
from .loss_relay import (mtp_metrics_before, needs_relay, relay_losses, share_mtp_metrics,
                         share_token_count)
from .megatron_stage import GradSync, MegatronStageWork, offers_overlapped_pairs
from .options import PipelineOptions
from .plan import plan_text
from .stage_copies import sum_stage_copies


@dataclass
class RunState:
    """What the plugin remembers between steps: the active options and the last step."""

    options: PipelineOptions = field(default_factory=PipelineOptions.from_kwargs)
    last_step: StepResult | None = None
    last_schedule: Schedule | None = None
    steps_run: int = 0
    #: trace=True: the last step's measured timeline (pipeline rank 0; None elsewhere), the
    #: simulator's timeline of the same schedule under the measured mean costs, and the
    #: step's scalars ({"pipeline/bubble_fraction": ..., ...}; on every pipeline rank)
    last_timeline: Timeline | None = None
    last_predicted: Timeline | None = None
    last_metrics: dict = field(default_factory=dict)
    #: settings the pipeline ranks already agreed on / plans already logged
    agreed: set = field(default_factory=set)
    planned: set = field(default_factory=set)
    #: schedule="auto": what was measured and chosen (reset when the options change)
    auto: AutoSchedule | None = None
    #: this rank's action order that Megatron DDP learned its grad-ready counts in
    #: (``GradSync.start``); None before the first training step
    grad_counts_order: tuple | None = None
    #: NCCL: failure notes published when the run last went well (read again after a failed
    #: step); a wait stops on a peer's note numbered above it
    failure_baseline: int | None = None
    #: --overlap-moe-expert-parallel-comm: the F&B pairs the last step ran in one combined
    #: call on this rank (logged when it changes); None before the first such step
    overlapped_pairs: int | None = None
    #: per schedule: what the executor derives from it once (the program, lowered and
    #: checked, and this rank's part of it compiled); the schedule object is kept beside
    #: them, so an id is never reused while cached
    _derived_cache: dict = field(default_factory=dict, repr=False)

    def activate(self, options: PipelineOptions) -> None:
        """Make ``options`` the active ones; a change starts afresh: the first-step timeout
        applies again and ``auto`` measures again."""
        if self.options != options:
            self.steps_run, self.auto = 0, None
        self.options = options

    def program(self, schedule: Schedule, *, batched: bool, prefetch: bool,
                overlapped_pairs: bool, variable_shapes: bool) -> Program:
        """The program the executor interprets (``lowering.runtime_program``): lowered (and on
        NCCL checked against NCCL's rules: ScheduleError, before any byte moves, if it could
        hang) once per schedule and posting."""
        return self._derived(
            ("program", batched, prefetch, overlapped_pairs, variable_shapes), schedule,
            lambda: runtime_program(schedule, batched=batched, prefetch=prefetch,
                                    overlapped_pairs=overlapped_pairs,
                                    variable_shapes=variable_shapes))

    def program_steps(self, program: Program, schedule: Schedule, rank: int,
                      timed: bool) -> list:
        """This rank's part of ``program``, compiled, once per program."""
        return self._derived(("steps", id(program), rank, timed), schedule,
                             lambda: compile_steps(program, rank, schedule, timed=timed))

    def _derived(self, what: tuple, schedule: Schedule, derive):
        key = (id(schedule), *what)
        cached = self._derived_cache.get(key)
        if cached is None or cached[0] is not schedule:
            if len(self._derived_cache) >= 64:
                self._derived_cache.clear()
            cached = self._derived_cache[key] = (schedule, derive())
        return cached[1]

    def summary(self) -> str | None:
        """The last traced step, measured beside predicted (pipeline rank 0), else None."""
        if self.last_timeline is None:
            return None
        return tracing.summary_text(self.last_timeline, self.last_predicted)


logger = logging.getLogger("megatron_pp_ext")


@functools.lru_cache(maxsize=64)
def _cached_schedule(name: str, p: int, m: int, v: int, forward_only: bool,
                     options: tuple) -> Schedule:
    """Built and validated once per (schedule, p, m, v, options)."""
    return build_schedule(name, p, m, chunks=v, forward_only=forward_only, **dict(options))


@functools.lru_cache(maxsize=8)
def _transport_for(group) -> TorchDistTransport:
    return TorchDistTransport(group)


def schedule_for(options: PipelineOptions, p: int, m: int, num_chunks: int, forward_only: bool,
                 config=None, extra_options: dict | None = None) -> Schedule:
    """This step's schedule; checks the model chunks against what the schedule needs."""
    if isinstance(m, bool) or not isinstance(m, int) or m < 1:
        raise ValueError(
            f"num_microbatches={m!r}: it must be an integer >= 1 (it is global_batch_size / "
            "(micro_batch_size x data_parallel_size)); raise the global batch size or lower "
            "micro_batch_size")
    if options.is_file:
        return file_schedule_for(options, p, m, num_chunks, forward_only)
    spec = get_spec(options.schedule)
    if options.chunks:
        v = options.chunks
    elif spec.layout in ("v", DUAL_LAYOUT):
        v = 2
    elif spec.layout == AUTO_LAYOUT:  # zb-auto builds for the model's layout
        v = num_chunks
    else:  # interleaved takes v from the model; the one-chunk schedules need exactly 1
        v = num_chunks if spec.name == "interleaved" else spec.default_chunks
    if spec.layout == AUTO_LAYOUT and v not in (1, 2):
        raise ValueError(
            f"schedule {options.schedule!r} builds for one model chunk per rank (the loop "
            f"layout) or two (the V layout: rank r holds stages r and 2p-1-r), but the model "
            f"holds {v}: build it with 1 or 2 chunks per rank")
    if spec.layout == DUAL_LAYOUT and v != 2:
        raise ValueError(
            f"schedule {options.schedule!r} runs exactly 2 model chunks per rank (rank r holds "
            f"model parts r and p-1-r), but chunks={v} was asked; build the model with "
            "virtual_pipeline_model_parallel_size=2 and drop the chunks option")
    if spec.layout == "v" and v != 2:
        raise ValueError(
            f"schedule {options.schedule!r} is a V-shape schedule: it runs exactly v=2 model "
            f"chunks per rank (rank r holds stages r and 2p-1-r), but chunks={v} was asked; "
            "build the model with virtual_pipeline_model_parallel_size=2 and drop the chunks "
            "option")
    if v != num_chunks:
        raise ValueError(
            f"schedule {options.schedule!r} runs v={v} model chunks per rank, but `model` holds "
            f"{num_chunks}; build the model with {v} chunk(s) per rank (vp_stage 0..{v - 1}) "
            f"and pass one data iterator per chunk"
            + ("" if spec.name == "interleaved" or spec.layout in ("v", DUAL_LAYOUT)
               or num_chunks < 2 else
               f", or choose a schedule for {num_chunks} chunks per rank ('interleaved')")
        )
    builder_options = {**options.builder_options(), **(extra_options or {})}
    if (spec.name == "interleaved" and "microbatch_group_size_per_vp_stage" not in builder_options
            and getattr(config, "microbatch_group_size_per_vp_stage", None)):
        builder_options["microbatch_group_size_per_vp_stage"] = (
            config.microbatch_group_size_per_vp_stage)
    if spec.name == "interleaved":
        group = builder_options.get("microbatch_group_size_per_vp_stage") or p
        if p <= group <= m and 0 < m % group < p:
            raise MicrobatchGroupError(
                f"interleaved: m={m} mod microbatch_group_size_per_vp_stage={group} is "
                f"{m % group}: it must be 0 or >= p={p} (Megatron's rule); pick m as a "
                f"multiple of {group}")
    return _cached_schedule(options.schedule, p, m, v, forward_only,
                            tuple(sorted(builder_options.items())))


def file_schedule_for(options: PipelineOptions, p: int, m: int, num_chunks: int,
                      forward_only: bool) -> Schedule:
    """A schedule file's schedule for this step (already validated and checked against NCCL's
    rules when the options were made), once the step's sizes are those it was written for."""
    schedule = options.file_schedule()
    path, layout = options.schedule, schedule_layout(schedule)
    if p != schedule.num_ranks:
        raise ValueError(
            f"the schedule file {path} has {schedule.num_ranks} rows (one per pipeline rank), "
            f"but the pipeline has p={p} ranks: a schedule file runs only at the pipeline size "
            f"it was written for; set the pipeline-model-parallel size to {schedule.num_ranks}, "
            f"or write the schedule for p={p}")
    if m != schedule.num_microbatches:
        raise ValueError(
            f"the schedule file {path} schedules m={schedule.num_microbatches} microbatches "
            f"(0..{schedule.num_microbatches - 1}), but this step has num_microbatches={m}: "
            f"choose the batch sizes so that global_batch_size / (micro_batch_size x "
            f"data_parallel_size) = {schedule.num_microbatches}, or write the schedule for m={m}")
    if num_chunks != schedule.chunks:
        where = ("the V layout: rank r holds stages r and 2p-1-r" if layout == "v" else
                 "the loop layout: chunk c of rank r is stage c*p + r")
        raise ValueError(
            f"the schedule file {path} places {schedule.chunks} stage(s) on each rank ({where}), "
            f"but `model` holds {num_chunks} chunk(s) on this rank: build the model with "
            f"{schedule.chunks} chunk(s) per rank in that layout and pass one data iterator "
            "per chunk")
    return options.file_schedule(forward_only) if forward_only else schedule


class MicrobatchGroupError(ScheduleError, RuntimeError):
    """Megatron's interleaved schedule raises RuntimeError when the last microbatch group is
    shorter than p; code written for it (Megatron-LM's own test_schedules.py) catches that.
    Ours is a ScheduleError (a ValueError, like every bad input) and a RuntimeError."""


def shape_decoder_seq_length(num_chunks: int, decoder_seq_length: int | None) -> int | None:
    """The decoder_seq_length that sets the pipeline's tensor shape, as the Megatron function
    this call replaces has it: with one model chunk Megatron's 1F1B uses ``get_tensor_shapes``
    (decoder_seq_length when given); with several chunks Megatron's interleaved schedule
    always sends ``seq_length`` (it ignores decoder_seq_length)."""
    return decoder_seq_length if num_chunks == 1 else None


def check_chunk_placement(schedule: Schedule, rank: int, models) -> None:
    """Each local chunk must be built for the stage the schedule gives it: the embedding where
    microbatches enter, the loss where they leave (the V layout puts the last stage on rank
    0's chunk 1; dualpipe both on ranks 0 and p-1)."""
    from megatron.core.utils import get_attr_wrapped_model

    for chunk, (stage, model) in enumerate(zip(schedule.stages_of(rank), models)):
        for flag, expected in (("pre_process", schedule.is_entry(stage)),
                               ("post_process", schedule.is_exit(stage))):
            try:
                built = bool(get_attr_wrapped_model(model, flag))
            except (RuntimeError, AttributeError):
                continue  # not a Megatron model: nothing to check
            if built != expected:
                layout = {
                    "v": "the V layout: rank r holds stages r and 2p-1-r, so rank 0's chunk 1 "
                         "computes the loss",
                    DUAL_LAYOUT: "dualpipe: rank r holds model part r (chunk 0) and a copy of "
                                 "part p-1-r (chunk 1)",
                }.get(schedule_layout(schedule),
                      "Megatron's layout: chunk c of rank r is stage c*p + r")
                raise ValueError(
                    f"schedule {schedule.name!r} runs stage {stage} on rank {rank}, chunk "
                    f"{chunk} ({layout}), but that model chunk was built with {flag}={built}; "
                    "build the chunks for this layout (docs/building-models-for-v-layout.md) "
                    "or choose a schedule for how the model is built")


def _as_list(value, name: str, expected: int) -> list:
    values = value if isinstance(value, list) else [value]
    if len(values) != expected:
        raise ValueError(f"`{name}` holds {len(values)} entries but `model` has {expected} "
                         f"chunk(s) on this rank: every model chunk needs its own data "
                         f"iterator (None where a chunk reads no data); pass a list of "
                         f"{expected}")
    return values


def check_pipeline_size(pp_group, p2p_communicator=None, pg_collection=None,
                        config=None) -> int:
    """The pipeline size, once every source of it agrees: the group the step communicates
    on, the ``pg_collection`` passed beside a ``p2p_communicator``, Megatron's
    ``parallel_state`` (when initialized) and ``config.pipeline_model_parallel_size``."""
    p = pp_group.size()
    sources = []
    if p2p_communicator is not None and pg_collection is not None:
        other = getattr(pg_collection, "pp", None)
        if other is not None and other is not pp_group and other.size() != p:
            sources.append(f"pg_collection.pp.size()={other.size()}")
    if parallel_state.model_parallel_is_initialized():
        try:
            megatron_p = parallel_state.get_pipeline_model_parallel_world_size()
        except (AssertionError, RuntimeError):
            megatron_p = None
        if megatron_p is not None and megatron_p != p:
            sources.append(
                f"parallel_state.get_pipeline_model_parallel_world_size()={megatron_p}")
    config_p = getattr(config, "pipeline_model_parallel_size", None)
    if isinstance(config_p, int) and config_p > 1 and config_p != p:
        sources.append(f"config.pipeline_model_parallel_size={config_p}")
    if sources:
        where = ("p2p_communicator.pp_group" if p2p_communicator is not None
                 else "pg_collection.pp")
        raise ValueError(
            f"the pipeline size disagrees: the step communicates on {where} of size {p}, but "
            f"{', '.join(sources)}; pass the pipeline group of the model's own parallel state "
            "(pg_collection / p2p_communicator built for the same pipeline_model_parallel_size "
            "as initialize_model_parallel and the TransformerConfig)")
    return p


def _first_step_checks(state: RunState, options: PipelineOptions, schedule: Schedule, pp_group,
                       rank: int, forward_only: bool, recv_shape, dtype, variable: bool,
                       device, first_timeout_s: float) -> int:
    """Before the first step of each distinct setting: the ranks agree, rank 0 logs the plan
    (and warns when a timeout set by hand would let NCCL's watchdog act first). Returns the
    setting's fingerprint."""
    values = agreement.settings(
        options.schedule, schedule.num_ranks, schedule.num_microbatches, schedule.chunks,
        forward_only, recv_shape, dtype, variable, options.to_dict())
    key = agreement.fingerprint(values)
    if key not in state.agreed and schedule.num_ranks > 1:
        agreement.check_agreement(values, pp_group, rank, device,
                                  timeout_s=first_timeout_s,
                                  polled=not device_helper.waits_block_host(pp_group))
    state.agreed.add(key)
    plan_key = (options.schedule, schedule.num_ranks, schedule.num_microbatches,
                schedule.chunks, forward_only)
    if plan_key not in state.planned:
        state.planned.add(plan_key)
        unsafe = options.unsafe_timeouts(device_helper.group_timeout_s(pp_group))
        if unsafe and rank == 0 and device_helper.backend_of(pp_group) == "nccl":
            logger.warning(
                "%s exceed 0.45 x the pipeline group's timeout of %g s: NCCL's watchdog may "
                "abort the job before the plugin names the peer it waited for; leave them "
                "unset (derived from the group's timeout) or raise the group's timeout",
                ", ".join(unsafe), device_helper.group_timeout_s(pp_group))
        if rank == 0 and logger.isEnabledFor(logging.INFO):
            logger.info("%s", plan_text(schedule, recv_shape, dtype))
    return key


def _report_overlap(state: RunState, pairs: int | None, schedule: Schedule, rank: int) -> None:
    """--overlap-moe-expert-parallel-comm: each rank logs how many F&B pairs ran through
    Megatron's combined step, at its first step and whenever the number changes; none is a
    warning (the schedule has no pairs: every F and B ran alone, nothing was hidden)."""
    if pairs is None or state.overlapped_pairs == pairs:
        return
    state.overlapped_pairs = pairs
    if pairs:
        logger.info("megatron-pp-ext: overlapped F&B pairs: %d per step on pipeline rank %d "
                    "(%s)", pairs, rank, schedule.name)
    else:
        logger.warning(
            "megatron-pp-ext: overlapped F&B pairs: 0 on pipeline rank %d: "
            "--overlap-moe-expert-parallel-comm asks to hide the MoE all-to-alls behind another "
            "microbatch's compute, but schedule %r has no F&B pairs, so every forward and "
            "backward ran alone (dualpipev has them)", rank, schedule.name)


def _trace_step(state: RunState, result: StepResult, schedule: Schedule, rank: int, pp_group,
                device, config, trace_dir: str | None = None) -> None:
    """Gather the measured timeline to pipeline rank 0, predict the same schedule under the
    measured costs, share the scalars and write them where Megatron logs (and the timeline
    as a Chrome trace into ``trace_dir``)."""
    timeline = tracing.gather_timeline(result, schedule, rank, pp_group, device)
    predicted = metrics = None
    if timeline is not None:
        predicted = tracing.predicted_timeline(timeline, schedule)
        metrics = tracing.step_metrics(timeline, predicted)
        if trace_dir:
            tracing.write_chrome_trace(timeline, trace_dir)
    state.last_timeline, state.last_predicted = timeline, predicted
    state.last_metrics = tracing.share_metrics(metrics, rank, pp_group, device)
    try:
        tracing.log_metrics(state.last_metrics, timers=getattr(config, "timers", None))
    except Exception as exc:  # noqa: BLE001 - logging must not fail a training step
        logger.warning("could not log the pipeline metrics: %s", exc)


def run_step(
    state: RunState,
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
    """Run one step of ``state.options``' schedule; returns the last stage's per-microbatch
    outputs of the loss function (``[]`` on the other ranks), as Megatron does."""
    models = model if isinstance(model, list) else [model]
    config = get_model_config(models[0])
    pg_collection = (megatron_compat.default_pg_collection() if pg_collection is None
                     else pg_collection)
    pp_group = p2p_communicator.pp_group if p2p_communicator is not None else pg_collection.pp
    tp_group, cp_group = pg_collection.tp, pg_collection.cp
    p = check_pipeline_size(pp_group, p2p_communicator, pg_collection, config)
    rank = pp_group.rank()
    options, auto, schedule = _step_schedule(state, models, p, pp_group, num_microbatches,
                                             forward_only, config)
    # after the schedule's own checks, as Megatron's interleaved schedule checks the
    # microbatches before it reads the iterators
    iterators, step_batches = direction_iterators(
        schedule, rank, _as_list(data_iterator, "data_iterator", len(models)))
    last_stage_here = any(schedule.is_exit(stage) for stage in schedule.stages_of(rank))
    check_chunk_placement(schedule, rank, models)  # a few attribute reads
    recv_shape, variable = _p2p_shape(config, len(models), seq_length, micro_batch_size,
                                      decoder_seq_length, adjust_tensor_shapes_fn, tp_group,
                                      cp_group)
    pipeline_dtype = config.pipeline_dtype or torch.float32
    transport = _transport_for(pp_group)
    steps, (first_timeout, later_timeout) = _checked_program(
        state, options, schedule, rank, pp_group, pg_collection, transport, models, config,
        forward_only, recv_shape, variable, pipeline_dtype)
    finalizing = config.finalize_model_grads_func is not None and not forward_only
    embedding_module = (clear_embedding_activation_buffer(config, models, last_stage_here)
                        if finalizing else None)
    if config.timers is not None:
        config.timers("forward-backward", log_level=1).start(barrier=config.barrier_with_L1_time)

    grad_sync, weight_split, work = _stage_work(
        schedule, rank, models, config, forward_step_func, iterators, num_microbatches,
        cp_group.size(), collect_non_loss_data, first_val_step, forward_only, pp_group)
    state.grad_counts_order = grad_sync.start(state.grad_counts_order)
    timeout = first_timeout if state.steps_run == 0 else later_timeout
    measuring = auto is not None and auto.measuring and not forward_only
    executor = Executor(schedule, rank, transport, work, recv_shape=recv_shape,
                        dtype=pipeline_dtype, device=transport.device, timeout_s=timeout,
                        variable_shapes=variable, trace=options.trace, timers=config.timers,
                        steps=steps, memory=(options.trace or measuring)
                        if options.memory is None else options.memory or measuring)
    _arm_transport(state, transport, timeout, pp_group, rank)
    memory_probe = device_helper.start_memory_probe(transport.device) if measuring else None
    mtp_before = None if forward_only else mtp_metrics_before(schedule, config)
    result = _run_executor(state, executor, weight_split, pp_group, rank)
    finish_step(step_batches)
    share_mtp_metrics(mtp_before, config, pp_group, transport.device)
    grad_sync.finish()
    if weight_split is not None:
        weight_split.assert_drained()

    if finalizing:
        finish_embedding_wgrad_compute(config, embedding_module, last_stage_here, tp_group)
        _finalize_grads(config, models, work, schedule, pp_group, pg_collection,
                        force_all_reduce)
    if not forward_only:  # dualpipe: both copies of each part get the summed gradient
        sum_stage_copies(models, schedule, rank, transport, timeout)
    if config.timers is not None:
        config.timers("forward-backward").stop()
    _observe(state, options, result, schedule, rank, pp_group, transport.device, config,
             auto if measuring else None, memory_probe)
    _report_overlap(state, work.overlapped_pairs(), schedule, rank)
    state.last_step, state.last_schedule = result, schedule
    state.steps_run += 1
    if needs_relay(schedule):
        return relay_losses(work.forward_data_store, schedule, rank, pp_group,
                            transport.device, state.steps_run, timeout)
    return work.forward_data_store if last_stage_here else []


def _observe(state: RunState, options: PipelineOptions, result: StepResult,
             schedule: Schedule, rank: int, pp_group, device, config, measuring_auto,
             memory_probe) -> None:
    """The step's trace (``options.trace``) and, while ``auto`` measures, its measurement."""
    if options.trace:
        _trace_step(state, result, schedule, rank, pp_group, device, config, options.trace_dir)
    if measuring_auto is not None:
        measuring_auto.after_step(result, schedule, pp_group, device_helper.finish_memory_probe(
            device, memory_probe, result.peak_activations))


def _stage_work(schedule: Schedule, rank: int, models, config, forward_step_func, iterators,
                num_microbatches: int, cp_size: int, collect_non_loss_data: bool,
                first_val_step, forward_only: bool, pp_group):
    """(Megatron's grad-sync protocol, the I/W split or None, the work) of this step."""
    grad_sync = GradSync(config, models, schedule, rank, forward_only)
    weight_split = WeightGradSplit(models) if schedule.uses_split_backward() else None
    work = MegatronStageWork(
        schedule=schedule, rank=rank, forward_step_func=forward_step_func,
        data_iterators=iterators, model_chunks=models, num_microbatches=num_microbatches,
        config=config, cp_size=cp_size, collect_non_loss_data=collect_non_loss_data,
        first_val_step=first_val_step, forward_only=forward_only,
        token_device=device_helper.comm_device(pp_group), grad_sync=grad_sync,
        weight_split=weight_split)
    return grad_sync, weight_split, work


def _finalize_grads(config, models, work, schedule: Schedule, pp_group, pg_collection,
                    force_all_reduce) -> None:
    """Megatron's ``finalize_model_grads``, with the loss rank's token count shared first
    where the last pipeline rank is not the loss rank (the V layouts)."""
    if config.calculate_per_token_loss and needs_relay(schedule):
        share_token_count(work.total_num_tokens, schedule, pp_group)
    config.finalize_model_grads_func(
        models, work.total_num_tokens if config.calculate_per_token_loss else None,
        pg_collection=pg_collection, force_all_reduce=force_all_reduce)


def _step_schedule(state: RunState, models, p: int, pp_group, num_microbatches: int,
                   forward_only: bool, config):
    """(the step's options, the auto chooser or None, the schedule): with ``auto``, the
    options of the candidate this step measures or the one chosen."""
    options, auto, extra_options = state.options, None, None
    if options.schedule == AUTO:
        if state.auto is None:
            state.auto = AutoSchedule(options.auto_measure_steps, options.auto_memory_budget_bytes,
                                      options.auto_activation_bytes)
        auto = state.auto
        options, extra_options = auto.options_for_step(options, models, pp_group)
    schedule = schedule_for(options, p, num_microbatches, len(models), forward_only, config,
                            extra_options)
    return options, auto, schedule


def _checked_program(state: RunState, options: PipelineOptions, schedule: Schedule,
                     rank: int, pp_group, pg_collection, transport, models, config,
                     forward_only: bool, recv_shape, variable: bool, pipeline_dtype):
    """(this rank's compiled program, (first-step timeout, later timeout)) after the
    first step's checks: the program (on NCCL checked against NCCL's rules), the agreement of
    the pipeline ranks and, for an MoE model, of each expert group's ranks on the order of
    their collectives, before anything is sent."""
    program = state.program(
        schedule, batched=getattr(transport, "batched", False),
        prefetch=getattr(transport, "prefetch_receives", False) and config.timers is None,
        overlapped_pairs=offers_overlapped_pairs(models, None if forward_only else config),
        variable_shapes=variable)
    timeouts = options.timeouts(device_helper.group_timeout_s(pp_group))
    setting = _first_step_checks(state, options, schedule, pp_group, rank, forward_only,
                                 recv_shape, pipeline_dtype, variable, transport.device,
                                 timeouts[0])
    expert_key = ("expert groups", setting)
    if expert_key not in state.agreed:
        check_expert_group(program, schedule, rank, models, config, pg_collection,
                           transport.device, timeouts[0],
                           polled=not device_helper.waits_block_host(pp_group))
        state.agreed.add(expert_key)
    return state.program_steps(program, schedule, rank, timed=config.timers is not None), timeouts


def _p2p_shape(config, chunks: int, seq_length: int, micro_batch_size: int,
               decoder_seq_length, adjust_tensor_shapes_fn, tp_group, cp_group):
    """(the shape every P2P tensor has, or None with variable sequence lengths; whether they
    vary), from Megatron's own ``get_tensor_shapes``."""
    shapes = get_tensor_shapes(seq_length=seq_length, micro_batch_size=micro_batch_size,
                               decoder_seq_length=shape_decoder_seq_length(
                                   chunks, decoder_seq_length),
                               config=config, tp_group=tp_group, cp_group=cp_group)
    if adjust_tensor_shapes_fn is not None:
        shapes, _ = adjust_tensor_shapes_fn(shapes, shapes)
    variable = bool(config.variable_seq_lengths)
    return (None if variable else tuple(shapes[0])), variable


def _arm_transport(state: RunState, transport, timeout: float, pp_group, rank: int) -> None:
    """The step's timeout for the transport's own waits (shape headers), and on NCCL the
    watch that stops a wait at once when a peer publishes its failure."""
    transport.timeout_s = timeout
    if transport.poll:
        if state.failure_baseline is None:
            state.failure_baseline = agreement.failures_published()
        transport.watch = (None if state.failure_baseline is None else
                           agreement.peer_failure_watch(pp_group, rank, state.failure_baseline))


def _run_executor(state: RunState, executor: Executor, weight_split, pp_group,
                  rank: int) -> StepResult:
    """Run the step; on a failure, tell the peers and abort the group (NCCL: so that no rank
    is left blocked in a dead op) before raising."""
    try:
        if weight_split is None:
            return executor.run()
        with weight_split.deferring():  # defers linear wgrads only while the step runs
            return executor.run()
    except PipelineTimeoutError as exc:
        state.failure_baseline = None  # a later step counts only failures after this one
        agreement.explain_failure(exc, pp_group, rank)  # tell the peers, hear theirs
        agreement.linger_if_serving_the_store(executor.timeout_s, exc)
        device_helper.abort_group(pp_group)
        raise
    except Exception as exc:  # e.g. a tensor of the wrong shape refused before sending
        # tell the peers at once: on NCCL they would otherwise sit out their timeout
        state.failure_baseline = None
        agreement.publish_failure(pp_group, rank, agreement.failure_note(exc, rank))
        agreement.settled()
        agreement.linger_if_serving_the_store(executor.timeout_s, exc)
        device_helper.abort_group(pp_group)  # NCCL: this rank's posted batches never finish
        raise


class ScheduleFunction:
    """A ``forward_backward_func`` (Megatron's keyword signature) bound to given options, with
    its own ``state``. Picklable (the options travel, the state starts afresh): usable as a
    spawn target's argument, and for running schedules side by side without install()."""

    def __init__(self, schedule: str | None = "1f1b", **options):
        self.options = PipelineOptions.from_kwargs(schedule, **options)
        self.state = RunState(options=self.options)

    def set_options(self, options: PipelineOptions) -> None:
        """Switch to ``options``; a change starts afresh (see ``RunState.activate``)."""
        self.options = options
        self.state.activate(options)

    def __call__(self, **kwargs):
        return run_step(self.state, **kwargs)

    @property
    def __name__(self) -> str:  # code that names the function it got (logs) sees which
        return f"ScheduleFunction({self.options.schedule!r})"

    def __getstate__(self) -> dict:
        return {"options": self.options}

    def __setstate__(self, values: dict) -> None:
        self.options = values["options"]
        self.state = RunState(options=self.options)

    def __repr__(self) -> str:
        return f"ScheduleFunction({self.options.schedule!r})"
