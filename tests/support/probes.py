"""Spawn targets that look inside one step of the tiny GPT: which hooks fired in which order,
whether a forward-only step left gradients, variable sequence lengths, non-loss data, a
module the I/W split cannot defer. Used by the runtime tests (Megatron's schedule versus
ours, same processes, same model and data)."""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Optional

import torch

from megatron_pp_ext.models import tiny_gpt
from support.reference import call_schedule
from megatron_pp_ext.models.tiny_gpt import TinyGPTConfig


class HookLog:
    """Records Megatron's hooks and timers as (event, detail) tuples."""

    def __init__(self):
        self.events: list[tuple] = []

    def no_sync(self, func, chunk):
        @contextlib.contextmanager
        def wrapped():
            self.events.append(("no_sync_enter", chunk))
            with func():
                yield
            self.events.append(("no_sync_exit", chunk))

        return wrapped

    def sync(self, name, func, chunk):
        def wrapped(params):
            self.events.append((name, chunk))
            if func is not None:
                return func(params)

        return wrapped

    def finalize(self, func):
        def wrapped(*args, **kwargs):
            self.events.append(("finalize_model_grads", None))
            return func(*args, **kwargs)

        return wrapped

    def __call__(self, name, log_level=0):  # config.timers
        log = self

        class _Timer:
            def start(self, barrier=False):
                log.events.append(("timer_start", name))

            def stop(self, barrier=False):
                log.events.append(("timer_stop", name))

        return _Timer()


def _record_hooks(config, chunks, log: HookLog, param_sync: bool) -> None:
    no_sync = config.no_sync_func
    if no_sync is not None:
        if isinstance(no_sync, list):
            config.no_sync_func = [log.no_sync(f, c) for c, f in enumerate(no_sync)]
        else:
            config.no_sync_func = log.no_sync(no_sync, 0)
    grad_sync = config.grad_sync_func
    if grad_sync is not None:
        if isinstance(grad_sync, list):
            config.grad_sync_func = [log.sync("grad_sync", f, c) for c, f in enumerate(grad_sync)]
        else:
            config.grad_sync_func = log.sync("grad_sync", grad_sync, 0)
    if param_sync:
        config.param_sync_func = [log.sync("param_sync", None, c) for c in range(len(chunks))]
    config.finalize_model_grads_func = log.finalize(config.finalize_model_grads_func)
    config.timers = log


class _ForeignAdapter(torch.nn.Module):
    """A module the I/W split cannot defer: a plain torch Linear on the hidden states."""

    def __init__(self, hidden: int):
        super().__init__()
        self.proj = torch.nn.Linear(hidden, hidden)
        torch.nn.init.zeros_(self.proj.weight)
        torch.nn.init.zeros_(self.proj.bias)

    def forward(self, hidden_states):
        return hidden_states + self.proj(hidden_states)


def _variable_batches(cfg: TinyGPTConfig, num_microbatches: int, seed: int):
    """Microbatches of different sequence lengths (the second half is shorter)."""
    full = tiny_gpt.mock_batches(cfg, num_microbatches, seed=seed)
    out = []
    for i, batch in enumerate(full):
        length = cfg.seq_length if i % 2 == 0 else cfg.seq_length // 2
        out.append({
            "tokens": batch["tokens"][:, :length].contiguous(),
            "labels": batch["labels"][:, :length].contiguous(),
            "loss_mask": batch["loss_mask"][:, :length].contiguous(),
            "position_ids": batch["position_ids"][:, :length].contiguous(),
            "attention_mask": batch["attention_mask"][:, :, :length, :length].contiguous(),
        })
    return out


def _non_loss_step(data_iterator, model):
    output, _mask = tiny_gpt._run_model(data_iterator, model)

    def collect(output_tensor, non_loss_data=False):
        return {"mean": output_tensor.detach().float().mean().reshape(1).clone()}

    return output, collect


def probe_step(
    rank: int,
    world_size: int,
    schedule: Any = "1f1b",
    pp: int = 1,
    vp: Optional[int] = None,
    layout: str = "loop",
    num_microbatches: int = 4,
    forward_only: bool = False,
    collect_non_loss_data: bool = False,
    variable_seq_lengths: bool = False,
    record_hooks: bool = False,
    param_sync: bool = False,
    foreign_module: bool = False,
    ddp: bool = True,
    config_overrides: Optional[dict] = None,
    cfg: TinyGPTConfig = TinyGPTConfig(),
) -> dict[str, Any]:
    """One step; returns losses, grads, which parameters hold a gradient, the hook log and
    the warnings raised."""
    from megatron.core.distributed import DistributedDataParallelConfig

    from megatron_pp_ext.train.processes import init_megatron

    vp = vp if (vp or 1) > 1 else None
    if layout == "v" and vp is None:
        vp = 2
    init_megatron(pp, vp, seed=cfg.seed)
    overrides = dict(config_overrides or {})
    if variable_seq_lengths:
        overrides["variable_seq_lengths"] = True
        overrides.setdefault("moe_token_dispatcher_type", "alltoall")  # Megatron insists, even without MoE
    config = tiny_gpt.make_transformer_config(cfg, pp, vp, **overrides)
    ddp_config = DistributedDataParallelConfig(overlap_grad_reduce=record_hooks,
                                               use_distributed_optimizer=False) if ddp else None
    chunks = tiny_gpt.build_model_chunks(cfg, vp_size=vp, layout=layout, config=config,
                                         wrap_ddp=ddp, ddp_config=ddp_config)
    if foreign_module:
        for chunk in chunks:
            inner = tiny_gpt.unwrap(chunk)
            if inner.pre_process:  # wrap the embedding's output in a foreign module
                adapter = _ForeignAdapter(cfg.hidden_size)
                inner.foreign_adapter = adapter
                original = inner.embedding.forward
                inner.embedding.forward = lambda *a, _o=original, _ad=adapter, **k: _ad(_o(*a, **k))
        if ddp:  # rebuild the DDP wrappers so they see the new parameters
            chunks = [tiny_gpt.unwrap(c) for c in chunks]
            chunks = tiny_gpt.wrap_with_ddp(chunks, config, ddp_config)
    if ddp:
        tiny_gpt.configure_hooks(config, chunks)
        for chunk in chunks:
            chunk.zero_grad_buffer()
    log = HookLog()
    if record_hooks:
        _record_hooks(config, chunks, log, param_sync)

    if variable_seq_lengths:
        batches = _variable_batches(cfg, num_microbatches, seed=0)
    else:
        batches = tiny_gpt.mock_batches(cfg, num_microbatches, seed=0)
    iterators = [iter(batches) for _ in chunks]
    step = _non_loss_step if collect_non_loss_data else tiny_gpt.forward_step_func
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        forward_data = call_schedule(schedule, step, chunks, iterators, cfg, num_microbatches,
                                     forward_only=forward_only,
                                     collect_non_loss_data=collect_non_loss_data)
    params_with_grad = []
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            main_grad = getattr(param, "main_grad", None)
            if param.grad is not None or (main_grad is not None and bool(main_grad.any())):
                params_with_grad.append(name)
    return {
        "rank": rank,
        "forward_data": [{k: v.detach().clone() if torch.is_tensor(v) else v
                          for k, v in d.items()} for d in forward_data],
        "grads": tiny_gpt.global_grads(chunks, cfg),
        "params_with_grad": params_with_grad,
        "hooks": log.events,
        "warnings": [str(w.message) for w in caught if "megatron_pp_ext" in str(w.message)],
    }


def schedule_function(name: str, **options):
    """A picklable plugin schedule (ScheduleFunction) for the probes."""
    from megatron_pp_ext.integration.forward_backward import ScheduleFunction

    return ScheduleFunction(name, **options)


__all__ = ["probe_step", "schedule_function", "HookLog"]


def auto_steps(rank: int, world_size: int, pp: int, steps: int = 3, layout: str = "loop",
               **run_kwargs) -> dict[str, Any]:
    """``steps`` steps with ``schedule="auto"`` (each on a fresh model with the same weights
    and data), then the fixed 1f1b step; returns each step's result and auto's choice."""
    from support.reference import run_step
    from megatron_pp_ext.integration.forward_backward import ScheduleFunction

    auto = ScheduleFunction("auto")
    results, schedules = [], []
    for _ in range(steps):
        results.append(run_step(rank, world_size, auto, pp=pp, layout=layout, **run_kwargs))
        schedules.append(auto.state.last_schedule.name)
    choice = auto.state.auto.choice
    fixed = "zb-v" if layout == "v" else "1f1b"
    reference = run_step(rank, world_size, ScheduleFunction(fixed), pp=pp, layout=layout,
                         **run_kwargs)
    return {"results": results, "reference": reference, "schedules": schedules,
            "choice": choice.schedule, "reason": choice.reason}


def switching_schedule_steps(rank: int, world_size: int, schedules=("1f1b", "zb-auto", "zb-auto"),
                             num_microbatches: int = 8) -> list[dict[str, Any]]:
    """One model (Megatron DDP, --overlap-grad-reduce, its hooks as megatron.training installs
    them) trained a step under each of ``schedules`` by one ScheduleFunction switched between
    them (``set_options``, as ``auto`` switches), at pp = world_size. Per step: whether each
    DDP bucket group counted the grad-ready calls it had learned (True, or True while it
    learns), the step's grad-ready calls per parameter summed, and this rank's last four
    actions."""
    from megatron_pp_ext.integration.forward_backward import ScheduleFunction
    from megatron_pp_ext.integration.options import PipelineOptions
    from megatron_pp_ext.train.processes import init_megatron
    from megatron.core.distributed import DistributedDataParallelConfig
    from support.megatron_loop import _grad_ready_as_learned

    cfg = TinyGPTConfig()
    init_megatron(world_size, None, seed=cfg.seed)
    config = tiny_gpt.make_transformer_config(cfg, world_size, None)
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=False,
                                               overlap_grad_reduce=True,
                                               use_distributed_optimizer=False)
    chunks = tiny_gpt.build_model_chunks(cfg, config=config, wrap_ddp=True,
                                         ddp_config=ddp_config)
    tiny_gpt.configure_hooks(config, chunks)
    function = ScheduleFunction(schedules[0])
    steps = []
    for name in schedules:
        function.set_options(PipelineOptions.from_kwargs(name))
        for chunk in chunks:
            chunk.zero_grad_buffer()  # Megatron's train_step does it first (DDP's reset)
        batches = tiny_gpt.mock_batches(cfg, num_microbatches, seed=0)
        call_schedule(function, tiny_gpt.forward_step_func, chunks, [iter(batches)], cfg,
                      num_microbatches)
        groups = [g for chunk in chunks for g in chunk.bucket_groups]
        tail = [str(a) for a in function.state.last_schedule.actions[rank]][-4:]
        steps.append({"as_learned": _grad_ready_as_learned(chunks), "tail": tail,
                      "counted": sum(sum(g.per_param_grad_ready_counts.values())
                                     for g in groups)})
    return steps
