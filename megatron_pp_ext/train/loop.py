"""One rank's training run, the way Megatron-LM's ``train_step`` does it.

Per rank: Megatron's parallel state (pp, and vp for two or more chunks per rank), this rank's
chunks of the tiny Megatron-Core ``GPTModel`` (``models.tiny_gpt``; the V layout for zb-v and
dualpipev), Megatron's ``DistributedDataParallel`` and hooks, Megatron's optimizer (Adam, fp32,
``get_megatron_optimizer``), then ``megatron_pp_ext.install(schedule, trace=...)``. Every step:

    for chunk in model: chunk.zero_grad_buffer()
    optimizer.zero_grad()
    forward_backward_func = get_forward_backward_func()     # Megatron's selector -> the plugin
    losses = forward_backward_func(forward_step_func=..., data_iterator=..., model=model, ...)
    optimizer.step()

Rank 0 gathers the step's loss, measured timeline and peak activations, prints the step's
line, and at the end writes summary.json, timeline.html and trace.json into ``--out``.
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .. import device as device_helper
from ..analysis.shared_cores import wake_delay
from ..integration.plan import plan_text
from . import preload  # noqa: F401  (before Megatron's first import: see its docstring)
from .data import counting_batches
from .measure import (
    StepMeasurement,
    costs_per_rank,
    gather_step,
    pipeline_cores,
    memory_summary,
    unit_cost_bubble,
)
from .progress import Progress, format_step
from .quiet import hide_megatron_warnings
from .report import write_outputs
from .settings import TrainSettings


def train_rank(rank: int, world_size: int, settings: TrainSettings, launcher: str = "local",
               device: torch.device | None = None) -> dict | None:
    """Train on this rank (the process group is already initialized). Returns the summary on
    rank 0, None elsewhere. A ``train.processes.spawn`` target."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel.schedules import get_forward_backward_func

    from megatron_pp_ext.integration.install import install
    from megatron_pp_ext.models.tiny_gpt import forward_step_func

    # Megatron-Core 0.19.2 logs that GPTModel is deprecated in favour of HybridModel: known.
    logging.getLogger("megatron.core.models.gpt.gpt_model").setLevel(logging.ERROR)
    hide_megatron_warnings()  # in this rank too (its logger; a no-op if the user asked to see)
    device = device or torch.device("cpu")
    backend = device_helper.backend_of()
    talk = rank == 0
    started = time.perf_counter()

    model, optimizer, cfg = _build(settings, device, backend)
    pp_group = parallel_state.get_pipeline_model_parallel_group()
    dp_size = parallel_state.get_data_parallel_world_size()
    dp_rank = parallel_state.get_data_parallel_rank()
    last_pipeline_rank = pp_group.rank() == pp_group.size() - 1
    installation = install(schedule=settings.schedule, trace=settings.trace,
                           p2p_timeout_s=settings.p2p_timeout_s,
                           memory=True)  # activation bytes on every step
    state = installation.state

    progress = _start_progress(settings, cfg, dp_size, backend, launcher, started) if talk else None
    cores = pipeline_cores(device.type, world_size, settings.pp) if settings.trace else None
    if talk and cores is not None:
        progress.message(
            f"{world_size} ranks share this machine's {len(os.sched_getaffinity(0))} cores: "
            "each action's cost and the host's time between actions are taken from the "
            "measured step as if alone on a core, and the prediction shares the cores as the "
            "ranks do, a rank woken while they are all taken waiting "
            f"{wake_delay() * 1e3:g} ms for one (half the kernel's base slice; "
            "analysis/shared_cores.py)")
    history = _History(cores=cores)
    for step in range(settings.steps):
        batches = counting_batches(settings.microbatches, cfg.micro_batch_size, cfg.seq_length,
                                   cfg.vocab_size, settings.seed, step, dp_rank, device)
        outputs, norm, seconds = _train_step(model, optimizer, batches, settings, cfg,
                                             get_forward_backward_func, forward_step_func)
        history.step_times.append(seconds)
        # The loss's all-reduce and the step's gather are collectives: every rank takes part.
        loss = _mean_loss(outputs, last_pipeline_rank, dp_size, device)
        if talk and step == 0 and state.auto is not None and state.auto.choice is not None:
            progress.message(f"auto: {state.auto.choice.reason}")
        history.measurement = (gather_step(state, pp_group, settings.trace, cores)
                               if settings.pp > 1
                               else StepMeasurement([1], None))
        if talk:
            _report_step(progress, history, step, settings.steps, loss, norm)

    if not talk:
        return None
    progress.close()
    summary = _summary(settings, state, history, world_size, dp_size, backend, launcher,
                       started)
    predicted, measurement = history.predicted, history.measurement
    if predicted is not None and summary.get("peak_activation_bytes_predicted"):
        # the predicted timeline's table shows the simulator's count in bytes beside it
        predicted.peak_bytes = list(summary["peak_activation_bytes_predicted"])
    files = write_outputs(settings.out, summary, predicted, measurement.timeline)
    summary["files"] = files
    print(_closing_line(summary, files), flush=True)
    return summary


@dataclass
class _History:
    """What the steps leave for the summary: every rank times its steps; rank 0 alone keeps
    the rest (the other ranks only take part in the collectives)."""

    losses: list = field(default_factory=list)
    step_times: list = field(default_factory=list)
    grad_norms: list = field(default_factory=list)
    bubbles: list = field(default_factory=list)
    predicted_bubbles: list = field(default_factory=list)
    measurement: StepMeasurement | None = None  # the last step's
    predicted: object = None  # the last step's predicted timeline (rank 0)
    cores: float | None = None  # the cores the pipeline's ranks shared (None: a core each)


def _start_progress(settings: TrainSettings, cfg, dp_size: int, backend: str, launcher: str,
                    started: float) -> Progress:
    """Rank 0's opening lines (and the plan the plugin logs at INFO), then its progress."""
    progress = Progress(settings.steps)
    progress.message(
        f"training the tiny Megatron-Core GPT ({cfg.num_layers} layers, hidden "
        f"{cfg.hidden_size}) with {settings.schedule}: pp={settings.pp}, v={settings.v}, "
        f"dp={dp_size}, {settings.microbatches} microbatches of {cfg.micro_batch_size}x"
        f"{cfg.seq_length} tokens, {settings.steps} steps, {backend} via {launcher} "
        f"(ready in {time.perf_counter() - started:.1f} s)")
    if settings.pp > 1:  # what the plugin logs at INFO before the first step
        schedule = settings.first_step_schedule()
        progress.message(plan_text(schedule, (cfg.seq_length, cfg.micro_batch_size,
                                              cfg.hidden_size), torch.float32))
    progress.start()
    return progress


def _train_step(model, optimizer, batches, settings: TrainSettings, cfg,
                get_forward_backward_func, forward_step_func):
    """One step as Megatron-LM's ``train_step`` takes it; the selector is asked every step, as
    there, so the installed plugin answers. Returns the step's outputs, gradient norm and
    seconds."""
    iterators = [iter(batches) for _ in model]
    t0 = time.perf_counter()
    for chunk in model:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    forward_backward_func = get_forward_backward_func()
    outputs = forward_backward_func(
        forward_step_func=forward_step_func,
        data_iterator=iterators if len(model) > 1 else iterators[0],
        model=model,
        num_microbatches=settings.microbatches,
        seq_length=cfg.seq_length,
        micro_batch_size=cfg.micro_batch_size,
        forward_only=False,
    )
    _, norm, _ = optimizer.step()
    return outputs, norm, time.perf_counter() - t0


def _report_step(progress: Progress, history: _History, step: int, steps: int, loss: float,
                 norm) -> None:
    """Rank 0 keeps the step's numbers for the summary and prints the step's line."""
    measurement = history.measurement
    history.losses.append(loss)
    history.grad_norms.append(float(norm) if norm is not None else None)
    bubble = predicted_bubble = None
    history.predicted = predicted = measurement.predicted
    if measurement.timeline is not None:
        bubble = measurement.timeline.bubble_fraction
        predicted_bubble = predicted.bubble_fraction
    history.bubbles.append(bubble)
    history.predicted_bubbles.append(predicted_bubble)
    progress.step(step + 1, format_step(step + 1, steps, loss, history.step_times[-1],
                                        bubble, predicted_bubble,
                                        measurement.peak_activations,
                                        measurement.peak_bytes,
                                        measurement.device_peak_bytes))


def _summary(settings: TrainSettings, state, history: _History, world_size: int, dp_size: int,
             backend: str, launcher: str, started: float) -> dict:
    """summary.json's content (the last step's measurement for the timeline and memory)."""
    schedule = state.last_schedule
    measurement, predicted = history.measurement, history.predicted
    step_times, bubbles = history.step_times, history.bubbles
    return {
        "schedule": settings.schedule,
        "auto_choice": state.auto.choice.schedule if state.auto and state.auto.choice else None,
        "pp": settings.pp,
        "microbatches": settings.microbatches,
        "chunks": settings.v,
        "layout": settings.layout,
        "steps": settings.steps,
        "dp": dp_size,
        "world_size": world_size,
        "backend": backend,
        "launcher": launcher,
        "losses": history.losses,
        "step_times_s": step_times,
        "step_time_median_s": statistics.median(step_times[1:] or step_times),
        "grad_norms": history.grad_norms,
        "bubble_measured": bubbles[-1],
        "bubble_predicted": history.predicted_bubbles[-1],
        "bubble_measured_per_step": bubbles,
        "bubble_predicted_per_step": history.predicted_bubbles,
        "bubble_unit_costs": unit_cost_bubble(schedule) if schedule is not None else 0.0,
        # the cores this pipeline's ranks shared, which the prediction accounts for (a
        # count, a share where data-parallel pipelines split the machine); None: a core each
        "pipeline_cores_shared": history.cores,
        "peak_activations": measurement.peak_activations,  # a COUNT per rank
        # DualPipe's F&B pairs computed in one call, per rank (a COUNT; the last step's)
        "overlapped_pairs": measurement.overlapped_pairs,
        **memory_summary(schedule, measurement),
        "makespan_measured_s": measurement.timeline.makespan if measurement.timeline else None,
        "makespan_predicted_s": predicted.makespan if predicted is not None else None,
        "measured_costs_per_rank_s": (costs_per_rank(schedule, measurement.timeline)
                                      if measurement.timeline is not None else None),
        "settings": settings.to_dict(),
        "seconds_total": time.perf_counter() - started,
    }


def _build(settings: TrainSettings, device: torch.device, backend: str):
    """Megatron's parallel state, this rank's DDP-wrapped chunks with their hooks, and
    Megatron's optimizer."""
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from ..models import tiny_gpt
    from .cpu_shims import shims_active
    from .processes import init_megatron

    cfg = tiny_gpt.TinyGPTConfig(
        num_layers=settings.num_layers, hidden_size=settings.hidden,
        num_attention_heads=settings.heads, vocab_size=settings.vocab,
        seq_length=settings.seq_length, micro_batch_size=settings.micro_batch_size,
        seed=settings.seed, loss_mask_drop=0.0)
    # The CPU shims (train.cpu_shims) only where there is no NCCL; on GPUs Megatron runs as is.
    init_megatron(settings.pp, settings.vp_size, seed=settings.seed,
                  force_cpu=backend != "nccl")
    config = tiny_gpt.make_transformer_config(cfg, settings.pp, settings.vp_size)
    chunks = tiny_gpt.build_model_chunks(cfg, vp_size=settings.vp_size, layout=settings.layout,
                                         config=config, wrap_ddp=False)
    chunks = [chunk.to(device) for chunk in chunks]
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=False, overlap_grad_reduce=False, use_distributed_optimizer=False)
    model = tiny_gpt.wrap_with_ddp(chunks, config, ddp_config)
    tiny_gpt.configure_hooks(config, model)
    # On the CPU: no clipping (Megatron's clip asserts CUDA grads; see train/cpu_shims.py).
    clip_grad = 0.0 if shims_active() else 1.0
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=settings.lr, weight_decay=0.0, clip_grad=clip_grad,
                        bf16=False, fp16=False, params_dtype=torch.float32,
                        use_distributed_optimizer=False),
        model)
    config.grad_scale_func = optimizer.scale_loss  # as megatron.training.setup_model_and_optimizer
    return model, optimizer, cfg


def _mean_loss(outputs, last_pipeline_rank: bool, dp_size: int, device: torch.device) -> float:
    """The step's loss (mean over microbatches and data-parallel replicas) on every rank. The
    last pipeline rank holds the per-microbatch losses (under V layouts the drop-in relays them
    there from rank 0, which holds the last stage, as Megatron-LM's train_step expects); the
    other ranks contribute zero."""
    values = [float(out["lm loss"]) for out in outputs or []] if last_pipeline_rank else []
    total = torch.tensor([sum(values) / len(values) if values else 0.0], dtype=torch.float64,
                         device=device)
    dist.all_reduce(total)
    return float(total.item()) / dp_size


def _closing_line(summary: dict, files: list[str]) -> str:
    losses = summary["losses"]
    text = (f"done in {summary['seconds_total']:.1f} s: loss {losses[0]:.4f} -> {losses[-1]:.4f}"
            f", median step {summary['step_time_median_s']:.3f} s")
    if summary["bubble_measured"] is not None:
        text += (f", bubble {100 * summary['bubble_measured']:.1f}% measured / "
                 f"{100 * summary['bubble_predicted']:.1f}% predicted from the measured costs"
                 + (f" on {summary['pipeline_cores_shared']:g} shared cores"
                    if summary.get("pipeline_cores_shared") else "") + " / "
                 f"{100 * summary['bubble_unit_costs']:.1f}% at t_F=t_I=t_W")
    return text + "\nwrote " + ", ".join(files)
