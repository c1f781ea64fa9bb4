"""``train --schedule pipedream|pipedream-2bw``: the tiny Megatron-Core GPT under an
asynchronous schedule (``schedules.pipedream``), through the Python API
(``runtime.pipedream.AsyncPipeline``) and the one executor, over gloo processes.

Megatron's ``forward_backward_func`` flushes every step, so this path does not go through it:
each rank builds its chunk of the same tiny ``GPTModel`` (one chunk per rank, wrapped in
Megatron's DDP for its gradient buffers), Megatron's optimizer as the flushed schedules'
``train`` builds it (``get_megatron_optimizer``: Adam, fp32, ``--lr``, no weight decay, no
clipping), and runs all ``--steps`` batches of ``-m`` microbatches as one action list, the same
data as every other schedule (``train.data.counting_batches``, batch = step). The rank holding
the last stage prints a line per batch as its last loss arrives and writes ``summary.json``
(per-batch losses, weight versions and their bytes per rank, peak activations, staleness).
"""

from __future__ import annotations

import logging
import time

import torch
import torch.distributed as dist

from .quiet import hide_megatron_warnings
from .settings import TrainSettings
from .report import write_outputs
from ..analysis.simulate import CostModel, simulate
from ..timeline import Timeline


def staleness(settings: TrainSettings) -> str:
    p, m = settings.pp, settings.microbatches
    if settings.schedule == "pipedream-2bw":
        return (f"PipeDream-2BW: gradients of a batch of {m} microbatches are applied one batch "
                "late: W(t+1) = W(t) - lr * grad f(W(t-1)), the same version on every stage; "
                "2 versions per stage")
    if settings.vertical_sync:
        return (f"PipeDream with vertical sync: an update per microbatch, computed on the "
                f"version the microbatch entered with, {p - 1} updates old on every stage: "
                f"W(t+1) = W(t) - lr * grad f(W(t-{p - 1}))")
    return (f"PipeDream with weight stashing: an update per microbatch; stage r computes on a "
            f"version p-1-r = {p - 1}..0 updates old (stage 0 the stalest): W(t+1) = W(t) - lr * "
            "grad f(W_1(t-p+1), ..., W_p(t)); stage r stashes up to p - r versions")


def async_train_rank(rank: int, world_size: int, settings: TrainSettings,
                     launcher: str = "local") -> dict | None:
    """One rank's run (the process group is initialized). The summary on the last stage's
    rank, None elsewhere."""
    from megatron.core import parallel_state

    from ..models import tiny_gpt
    from ..runtime.pipedream import AsyncPipeline
    from ..runtime.transport import TorchDistTransport
    from .data import counting_batches
    from .processes import init_megatron

    logging.getLogger("megatron.core.models.gpt.gpt_model").setLevel(logging.ERROR)
    hide_megatron_warnings()
    started = time.perf_counter()
    p, m, steps = settings.pp, settings.microbatches, settings.steps
    cfg = tiny_gpt.TinyGPTConfig(
        num_layers=settings.num_layers, hidden_size=settings.hidden,
        num_attention_heads=settings.heads, vocab_size=settings.vocab,
        seq_length=settings.seq_length, micro_batch_size=settings.micro_batch_size,
        seed=settings.seed, loss_mask_drop=0.0)
    init_megatron(p, None, seed=settings.seed, force_cpu=True)
    config = tiny_gpt.make_transformer_config(cfg, p, None)
    (chunk,) = tiny_gpt.build_model_chunks(cfg, vp_size=None, layout="loop", config=config)
    optimizer = _megatron_optimizer(chunk, config, settings.lr)
    batches = [b for step in range(steps) for b in counting_batches(
        m, cfg.micro_batch_size, cfg.seq_length, cfg.vocab_size, settings.seed, step)]
    last = p - 1
    pp_group = parallel_state.get_pipeline_model_parallel_group()
    pp_rank = pp_group.rank()
    forward_fn = _forward_fn(chunk, batches, last, tiny_gpt.loss_func)
    on_loss = _BatchLines(m, steps)

    if pp_rank == last:
        print(_opening_line(settings, cfg, launcher), flush=True)
    transport = TorchDistTransport(pp_group, timeout_s=settings.p2p_timeout_s)
    pipeline = AsyncPipeline(settings.schedule, [chunk], optimizer, forward_fn,
                             num_microbatches=m, steps=steps,
                             vertical_sync=settings.vertical_sync,
                             recv_shape=(cfg.seq_length, cfg.micro_batch_size, cfg.hidden_size),
                             dtype=torch.float32, transport=transport,
                             timeout_s=settings.p2p_timeout_s, trace=settings.trace,
                             on_loss=on_loss if pp_rank == last else None)
    t0 = time.perf_counter()
    result = pipeline.run()
    seconds = time.perf_counter() - t0
    gathered = _gather_ranks(pipeline, result, chunk, pp_group, settings.trace)
    if pp_rank != last:
        return None
    summary, measured, predicted = _summary(settings, pipeline, result, gathered, seconds,
                                            launcher, started)

    files = write_outputs(settings.out, summary, predicted, measured)
    print(_closing_line(summary, files, measured, predicted), flush=True)
    return summary


def _forward_fn(chunk, batches: list[dict], last: int, loss_func):
    """The pipeline's forward of one microbatch on this rank's stage: the loss on the last
    stage, the activations to send on elsewhere."""

    def forward_fn(stage, microbatch, call, input_tensor):
        batch = batches[microbatch]
        if stage != 0:
            chunk.set_input_tensor(input_tensor)
        output = call(batch["tokens"], batch["position_ids"], batch["attention_mask"],
                      labels=batch["labels"])
        if stage == last:
            return loss_func(batch["loss_mask"], output)[0]
        return output

    return forward_fn


class _BatchLines:
    """``on_loss`` for the last stage: a batch's line as soon as its last microbatch's loss
    arrives (the losses come one microbatch at a time, with no flush between batches)."""

    def __init__(self, m: int, steps: int):
        self.m, self.steps = m, steps
        self.last = time.perf_counter()  # when the previous batch's line was printed
        self.batch_losses: list[float] = []

    def __call__(self, microbatch, value):
        m, steps = self.m, self.steps
        self.batch_losses.append(value)
        if (microbatch + 1) % m:
            return
        step = (microbatch + 1) // m
        now = time.perf_counter()
        mean = sum(self.batch_losses[-m:]) / m
        line = (f"[{step:>{len(str(steps))}}/{steps}] step {step}  loss {mean:7.4f}  time "
                f"{now - self.last:6.3f} s")
        self.last = now
        print(line, flush=True)


def _opening_line(settings: TrainSettings, cfg, launcher: str) -> str:
    return (f"training the tiny Megatron-Core GPT ({cfg.num_layers} layers, hidden "
            f"{cfg.hidden_size}) with {settings.schedule}"
            f"{' (vertical sync)' if settings.vertical_sync else ''}: pp={settings.pp}, "
            f"{settings.steps} batches of {settings.microbatches} microbatches in one action "
            f"list (no flush), gloo via {launcher}\nstaleness: {staleness(settings)}")


def _gather_ranks(pipeline, result, chunk, pp_group, trace: bool) -> list[dict]:
    """Every rank's weight versions, their bytes and peak activations (and events, with
    ``trace``), gathered on every rank of the pipeline (a collective)."""
    pp_rank = pp_group.rank()
    mine = {"rank": pp_rank, "versions_held": result.max_versions_held,
            "stashed_weight_bytes": result.max_stashed_bytes,
            "parameter_bytes": sum(q.numel() * q.element_size() for q in chunk.parameters()),
            "peak_activations": result.step.peak_activations,
            # the executor's measured saved-tensor bytes (runtime.memory; weight versions,
            # leaves that require grad, are not counted); None where not measured
            "peak_activation_bytes": getattr(result.step, "peak_bytes", None),
            "planned_versions_held": pipeline.plan.max_held[pp_rank]}
    if trace:
        mine["events"] = result.step.events
    gathered: list = [None] * pp_group.size()
    dist.all_gather_object(gathered, mine, group=pp_group)
    return gathered


def _summary(settings: TrainSettings, pipeline, result, gathered: list[dict], seconds: float,
             launcher: str, started: float):
    """summary.json's content, with the measured and predicted timelines of the whole run
    (None without ``trace``)."""
    p, m, steps = settings.pp, settings.microbatches, settings.steps
    measured = predicted = None
    if settings.trace:
        measured, predicted = _timelines(pipeline.schedule, gathered)
    per_step = result.losses_per_step(m)
    summary = {
        "schedule": settings.schedule,
        "vertical_sync": settings.vertical_sync,
        "pp": p, "microbatches": m, "steps": steps, "chunks": 1, "layout": "loop",
        "launcher": launcher, "backend": "gloo",
        "optimizer": (f"Megatron's get_megatron_optimizer: Adam, lr {settings.lr}, fp32, "
                      "no clipping"),
        "update_rule": pipeline.plan.rule.describe(),
        "staleness": staleness(settings),
        "losses": per_step,
        "losses_per_microbatch": result.losses,
        "updates_per_stage": result.work.updates,
        "versions_held_per_rank": [g["versions_held"] for g in gathered],
        "stashed_weight_bytes_per_rank": [g["stashed_weight_bytes"] for g in gathered],
        "parameter_bytes_per_rank": [g["parameter_bytes"] for g in gathered],
        "peak_activations": [g["peak_activations"] for g in gathered],
        "peak_activation_bytes": [g["peak_activation_bytes"] for g in gathered],
        "seconds_pipeline": seconds,
        "seconds_per_microbatch": seconds / (m * steps),
        "seconds_total": time.perf_counter() - started,
        "settings": settings.to_dict(),
    }
    if measured is not None:
        summary.update(bubble_measured=measured.bubble_fraction,
                       bubble_predicted=predicted.bubble_fraction,
                       makespan_measured_s=measured.makespan,
                       makespan_predicted_s=predicted.makespan)
    return summary, measured, predicted


def _closing_line(summary: dict, files: list[str], measured, predicted) -> str:
    per_step = summary["losses"]
    return (f"done in {summary['seconds_total']:.1f} s: loss {per_step[0]:.4f} -> "
            f"{per_step[-1]:.4f}, {1000 * summary['seconds_per_microbatch']:.1f} ms per "
            f"microbatch; weight versions per rank {summary['versions_held_per_rank']} "
            f"({', '.join(f'{b / 2**20:.2f}' for b in summary['stashed_weight_bytes_per_rank'])}"
            f" MiB stashed); peak activations {summary['peak_activations']}"
            + (" (" + ", ".join(f"{b / 2**20:.1f}" for b in summary["peak_activation_bytes"])
               + " MiB)" if all(b is not None for b in summary["peak_activation_bytes"]) else "")
            + (f"; bubble of the whole run (one fill and one drain) "
               f"{100 * measured.bubble_fraction:.1f}%"
               f" measured / {100 * predicted.bubble_fraction:.1f}% predicted from the measured "
               "costs" if measured is not None else "")
            + "\nwrote "
            + ", ".join(files))


def _megatron_optimizer(chunk, config, lr: float):
    """Megatron's optimizer (Adam, fp32), as the flushed schedules' ``train`` builds it, over
    the chunk wrapped in Megatron's DDP (which gives each parameter its ``main_grad``; the
    versioned work writes each update's gradients there). No gradient clipping: it would
    all-reduce the norm over the pipeline ranks, which update at different times here."""
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from ..models import tiny_gpt

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=False, overlap_grad_reduce=False, use_distributed_optimizer=False)
    model = tiny_gpt.wrap_with_ddp([chunk], config, ddp_config)
    return get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=lr, weight_decay=0.0, clip_grad=0.0, bf16=False,
                        fp16=False, params_dtype=torch.float32,
                        use_distributed_optimizer=False),
        model)


def _timelines(schedule, gathered: list[dict]):
    """The measured timeline of the whole run (every rank's events: one machine's monotonic
    clock) and the simulator's, under each rank's measured mean F and B."""
    import statistics

    events = [e for g in gathered for e in g["events"]]
    peaks = [g["peak_activations"] for g in gathered]
    measured = Timeline(schedule.name, schedule.num_ranks, schedule.num_microbatches, 1,
                        events, peaks, "measured", "s")
    means = {}
    for kind in ("F", "B"):
        means[kind] = [statistics.mean([e.duration for e in measured.compute_events(r)
                                        if e.kind == kind] or [0.0])
                       for r in range(schedule.num_ranks)]
    predicted = simulate(schedule, CostModel(t_f=means["F"], t_b=means["B"]))
    predicted.unit = "s"
    return measured, predicted
