"""One training step of the tiny GPT under a schedule, as a :func:`launch.spawn` target, and the
helpers that merge and compare what the ranks return.

    from megatron_pp_ext.train.processes import spawn
    from support.reference import run_step, merge_results

    ref = merge_results(spawn(1, run_step, "no_pipelining", pp=1))
    out = merge_results(spawn(4, run_step, "1f1b", pp=4))
    assert_same(out, ref)                 # losses and every gradient, bit for bit

``schedule`` is a name ("no_pipelining", "1f1b", "interleaved": Megatron's own functions;
"megatron": whatever ``get_forward_backward_func()`` picks; "sequential": a schedule-free
oracle that runs every microbatch through all stages one at a time, for any layout), an
importable "module:function" path, or a callable with Megatron's ``forward_backward_func``
keyword signature (e.g. the plugin's ``ScheduleFunction("zb-v")``). Callables must be
picklable (module-level functions or instances of module-level classes) to cross processes.
``run_steps`` runs several such steps in the same processes (one launch, Megatron re-initialized
in between), e.g. Megatron's schedule and the plugin's side by side.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, Optional, Sequence, Union

import torch

from megatron_pp_ext.models import tiny_gpt
from megatron_pp_ext.models.tiny_gpt import TinyGPTConfig

__all__ = [
    "call_schedule",
    "run_step",
    "run_steps",
    "resolve_schedule",
    "sequential_forward_backward",
    "merge_results",
    "compare_grads",
    "assert_same",
    "MEGATRON_SCHEDULES",
]

MEGATRON_SCHEDULES = {
    "no_pipelining": "forward_backward_no_pipelining",
    "1f1b": "forward_backward_pipelining_without_interleaving",
    "interleaved": "forward_backward_pipelining_with_interleaving",
}


def resolve_schedule(schedule: Union[str, Callable]) -> Callable:
    """Turn a schedule name / "module:function" path / callable into a forward_backward_func."""
    if callable(schedule):
        return schedule
    from megatron.core.pipeline_parallel import schedules

    if schedule in MEGATRON_SCHEDULES:
        return getattr(schedules, MEGATRON_SCHEDULES[schedule])
    if schedule == "megatron":
        return schedules.get_forward_backward_func()
    if schedule == "sequential":
        return sequential_forward_backward
    if ":" in schedule:
        module, _, name = schedule.partition(":")
        return getattr(importlib.import_module(module), name)
    raise ValueError(
        f"unknown schedule {schedule!r}: use one of {sorted(MEGATRON_SCHEDULES)}, 'megatron', "
        "'sequential', 'module:function' or a callable"
    )


def call_schedule(schedule, forward_step_func, chunks, iterators, cfg: TinyGPTConfig,
                  num_microbatches: int, **kwargs):
    """One forward-backward step of the tiny GPT's chunks under ``schedule`` (any form
    :func:`resolve_schedule` takes), with Megatron's keyword arguments."""
    return resolve_schedule(schedule)(
        forward_step_func=forward_step_func,
        data_iterator=iterators if len(chunks) > 1 else iterators[0],
        model=chunks,
        num_microbatches=num_microbatches,
        seq_length=cfg.seq_length,
        micro_batch_size=cfg.micro_batch_size,
        **kwargs,
    )


def run_step(
    rank: int,
    world_size: int,
    schedule: Union[str, Callable] = "1f1b",
    pp: int = 1,
    vp: Optional[int] = None,
    layout: str = "loop",
    num_microbatches: int = 8,
    cfg: TinyGPTConfig = TinyGPTConfig(),
    data_seed: int = 0,
    ddp: bool = False,
    overlap_grad_reduce: bool = False,
    per_token_loss: bool = False,
    forward_only: bool = False,
    config_overrides: Optional[dict] = None,
    schedule_kwargs: Optional[dict] = None,
) -> dict[str, Any]:
    """Spawn target: one forward-backward step of the tiny GPT under ``schedule`` on this rank.

    Initializes Megatron (pp, vp; data parallel = world_size // pp, every replica gets the same
    data), builds this rank's chunks with identical global weights, runs
    ``schedule(forward_step_func=..., data_iterator=..., model=chunks, num_microbatches=...,
    seq_length=..., micro_batch_size=..., forward_only=..., **schedule_kwargs)`` and returns

        {"rank", "pp_rank", "dp_rank", "stages": [global stage per chunk],
         "losses": [per-microbatch loss tensors; empty unless this rank holds the last stage],
         "grads": {global param name: grad tensor}, "forward_data": raw forward_data_store}

    ``ddp`` wraps the chunks in Megatron's DDP and installs the hooks (``no_sync_func``,
    ``grad_sync_func`` with ``overlap_grad_reduce``, ``finalize_model_grads_func``) like
    ``megatron.training``; ``per_token_loss`` uses the 3-tuple loss with
    ``calculate_per_token_loss=True`` (needs ``ddp``, as finalize does the division)."""
    vp = vp if (vp or 1) > 1 else None
    if layout == "v" and vp is None:
        vp = 2
    if layout == "v" and isinstance(schedule, str) and schedule in (*MEGATRON_SCHEDULES, "megatron"):
        raise ValueError(
            f"Megatron's own schedules only know the loop placement; layout='v' needs a V-aware "
            f"schedule (e.g. 'sequential' or the plugin's), not {schedule!r}"
        )
    from megatron.core import parallel_state

    from megatron_pp_ext.train.processes import init_megatron

    init_megatron(pp, vp, seed=cfg.seed)
    overrides = dict(config_overrides or {})
    if per_token_loss:
        overrides.setdefault("calculate_per_token_loss", True)
    config = tiny_gpt.make_transformer_config(cfg, pp, vp, **overrides)
    ddp_config = None
    if ddp:
        from megatron.core.distributed import DistributedDataParallelConfig

        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=False,
            overlap_grad_reduce=overlap_grad_reduce,
            use_distributed_optimizer=False,
        )
    chunks = tiny_gpt.build_model_chunks(
        cfg, vp_size=vp, layout=layout, config=config, wrap_ddp=ddp, ddp_config=ddp_config
    )
    if ddp:
        tiny_gpt.configure_hooks(config, chunks)
        for chunk in chunks:
            chunk.zero_grad_buffer()

    batches = tiny_gpt.mock_batches(cfg, num_microbatches, seed=data_seed)
    iterators = [iter(batches) for _ in chunks]
    step = tiny_gpt.forward_step_func_per_token if per_token_loss else tiny_gpt.forward_step_func
    forward_data = call_schedule(schedule, step, chunks, iterators, cfg, num_microbatches,
                                 forward_only=forward_only, **(schedule_kwargs or {}))

    stages = [tiny_gpt.unwrap(c).pipeline_stage for c in chunks]
    holds_last = (tiny_gpt.num_stages(pp, vp) - 1) in stages
    losses = [d["lm loss"].detach().clone() for d in forward_data] if holds_last else []
    return {
        "rank": rank,
        "pp_rank": parallel_state.get_pipeline_model_parallel_rank(),
        "dp_rank": parallel_state.get_data_parallel_rank(),
        "stages": stages,
        "layer_numbers": [
            [layer.layer_number for layer in tiny_gpt.unwrap(c).decoder.layers] for c in chunks
        ],
        "losses": losses,
        "grads": {} if forward_only else tiny_gpt.global_grads(chunks, cfg),
        "forward_data": [
            {k: v.detach().clone() if torch.is_tensor(v) else v for k, v in d.items()}
            for d in forward_data
        ]
        if holds_last
        else [],
    }


def run_steps(rank: int, world_size: int, runs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Spawn target: several :func:`run_step` calls in the same processes (each re-initializes
    Megatron), e.g. Megatron's schedule and the plugin's on the same model, without paying for
    a second launch. ``runs`` is a list of run_step keyword dicts; returns their results."""
    return [run_step(rank, world_size, **kwargs) for kwargs in runs]


# --------------------------------------------------------------------------------------------
# A schedule-free oracle for any placement
# --------------------------------------------------------------------------------------------


def sequential_forward_backward(
    *,
    forward_step_func,
    data_iterator,
    model,
    num_microbatches: int,
    seq_length: int,
    micro_batch_size: int,
    forward_only: bool = False,
    **_unused: Any,
):
    """The simplest correct pipeline, for any stage placement (loop or V): for each microbatch,
    the forward runs through stages 0..S-1 one at a time (activations passed with blocking
    send/recv between the ranks that own consecutive stages), then the backward runs
    S-1..0. Uses Megatron's own ``forward_step`` / ``backward_step`` with ``is_last_stage`` and
    ``vp_stage`` passed explicitly, and calls ``config.finalize_model_grads_func`` at the end.
    Same keyword signature and return value as Megatron's schedules. Slow by design: an oracle.

    Chunks must come from ``tiny_gpt.build_model_chunks`` (they carry ``pipeline_stage``)."""
    import contextlib

    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel.schedules import backward_step, forward_step
    from megatron.core.utils import get_model_config

    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    iterators = list(data_iterator) if isinstance(data_iterator, (list, tuple)) else [data_iterator]
    config = get_model_config(chunks[0])
    group = parallel_state.get_pipeline_model_parallel_group()
    pp = group.size()
    my_rank = group.rank()
    stage_of = [tiny_gpt.unwrap(c).pipeline_stage for c in chunks]
    n_stages = tiny_gpt.unwrap(chunks[0]).pipeline_num_stages
    owner = {}  # stage -> pp rank, learned from every rank's stage list
    all_stages: list[Any] = [None] * pp
    dist.all_gather_object(all_stages, stage_of, group=group)
    for r, stages in enumerate(all_stages):
        for s in stages:
            owner[s] = r
    shape = (seq_length, micro_batch_size, config.hidden_size)
    dtype = config.pipeline_dtype

    def peer(stage):
        return dist.get_global_rank(group, owner[stage])

    no_sync_funcs = config.no_sync_func
    if no_sync_funcs is None:
        no_sync_funcs = []
    elif not isinstance(no_sync_funcs, list):
        no_sync_funcs = [no_sync_funcs]
    forward_data_store: list = []
    total_num_tokens = torch.zeros([], dtype=torch.int)
    for mb in range(num_microbatches):
        # Like Megatron: grad sync disabled for all but the last microbatch.
        ctx = contextlib.ExitStack()
        if not forward_only and mb < num_microbatches - 1:
            for f in no_sync_funcs:
                ctx.enter_context(f())
        with ctx:
            saved = {}
            for s in range(n_stages):
                if owner[s] != my_rank:
                    continue
                c = stage_of.index(s)
                x = None
                if s > 0:
                    if owner[s - 1] == my_rank:
                        x = saved[s - 1][1].detach().requires_grad_()
                    else:
                        x = torch.empty(shape, dtype=dtype, requires_grad=True)
                        dist.recv(x, src=peer(s - 1), group=group)
                is_last = s == n_stages - 1
                y, n_tok = forward_step(
                    forward_step_func,
                    iterators[c],
                    chunks[c],
                    num_microbatches,
                    x,
                    forward_data_store,
                    config,
                    cp_group_size=1,
                    is_first_microbatch=(mb == 0),
                    current_microbatch=mb,
                    vp_stage=c if len(chunks) > 1 else None,
                    is_last_stage=is_last,
                )
                total_num_tokens += n_tok
                saved[s] = (x, y)
                if not is_last and owner[s + 1] != my_rank:
                    dist.send(y.detach().contiguous(), dst=peer(s + 1), group=group)
            if forward_only:
                continue
            grad_in = {}
            for s in reversed(range(n_stages)):
                if owner[s] != my_rank:
                    continue
                x, y = saved[s]
                dy = None
                if s < n_stages - 1:
                    if owner[s + 1] == my_rank:
                        dy = grad_in[s + 1]
                    else:
                        dy = torch.empty(shape, dtype=dtype)
                        dist.recv(dy, src=peer(s + 1), group=group)
                dx = backward_step(x, y, dy, config)
                grad_in[s] = dx
                if s > 0 and owner[s - 1] != my_rank:
                    dist.send(dx.contiguous(), dst=peer(s - 1), group=group)
    if config.finalize_model_grads_func is not None and not forward_only:
        config.finalize_model_grads_func(
            chunks, total_num_tokens if config.calculate_per_token_loss else None
        )
    return forward_data_store


# --------------------------------------------------------------------------------------------
# Merging and comparing
# --------------------------------------------------------------------------------------------


def merge_results(results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Merge the per-rank dicts of :func:`run_step` into {"losses": [...], "grads": {...}}.
    Losses come from the data-parallel replica 0 rank holding the last stage; grads from all
    replica-0 ranks; every other replica must agree bit for bit (same data everywhere)."""
    losses: list = []
    grads: dict[str, torch.Tensor] = {}
    for res in sorted(results, key=lambda r: (r["dp_rank"], r["rank"])):
        if res["dp_rank"] == 0:
            if res["losses"]:
                losses = res["losses"]
            for name, g in res["grads"].items():
                if name in grads:
                    raise AssertionError(f"{name} returned by two ranks of one replica")
                grads[name] = g
        else:
            for name, g in res["grads"].items():
                if not torch.equal(grads[name], g):
                    raise AssertionError(f"data-parallel replicas disagree on {name}")
    return {"losses": losses, "grads": grads}


def compare_grads(
    a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]
) -> dict[str, float]:
    """{name: max |a - b|} over the union of names (inf where one side lacks the name)."""
    out = {}
    for name in sorted(set(a) | set(b)):
        if name not in a or name not in b:
            out[name] = float("inf")
        else:
            out[name] = (a[name].double() - b[name].double()).abs().max().item()
    return out


def assert_same(
    got: dict[str, Any],
    want: dict[str, Any],
    rtol: float = 0.0,
    atol: float = 0.0,
    check_losses: bool = True,
) -> None:
    """Assert merged results agree: per-microbatch losses and every gradient by global name.
    Default tolerance 0: bit for bit. The error message names the worst parameters."""
    if check_losses:
        gl = torch.stack([x.reshape(-1) for x in got["losses"]]) if got["losses"] else None
        wl = torch.stack([x.reshape(-1) for x in want["losses"]]) if want["losses"] else None
        if gl is None or wl is None or gl.shape != wl.shape:
            raise AssertionError(f"losses differ in count: {got['losses']} vs {want['losses']}")
        torch.testing.assert_close(gl, wl, rtol=rtol, atol=atol, msg=lambda m: f"losses: {m}")
    missing = sorted(set(want["grads"]) ^ set(got["grads"]))
    if missing:
        raise AssertionError(f"gradient names differ: {missing[:10]}")
    bad = []
    for name in sorted(want["grads"]):
        g, w = got["grads"][name], want["grads"][name]
        if not torch.allclose(g, w, rtol=rtol, atol=atol):
            bad.append((float((g.double() - w.double()).abs().max()), name))
    if bad:
        bad.sort(reverse=True)
        raise AssertionError(
            f"{len(bad)} of {len(want['grads'])} gradients differ (rtol={rtol}, atol={atol}); "
            f"worst: {bad[:5]}"
        )
