"""Spawn target for the post-validation tests: on every rank, two replicas of the tiny
Megatron-Core GPT with identical weights and data, each with Megatron's own optimizer
(``get_megatron_optimizer``): the reference steps synchronously (``optimizer.step()``), the
other through :class:`~megatron_pp_ext.integration.post_validation.PostValidatedOptimizer`,
whose steps settle only at the next ``zero_grad()`` (the deferred flow a loop that overlaps
steps uses). After every step, this rank's model parameters, main parameters, optimizer state
and loss-scaler state of the two replicas are compared bit for bit, and both steps' returned
(success, grad norm, zeros) are recorded.

Per step ``clips[k]`` is the clip threshold of both replicas (Megatron reads
``config.clip_grad`` each step), so the test decides where clipping triggers; on
``inf_step`` every data-parallel rank of the last pipeline stage fills one parameter's
gradient with inf after the backward, as an fp16 overflow would.

CPU patches (support.megatron_loop's, for the same reasons): ``Tensor.type()`` reports
``torch.cuda.*`` names (``clip_grads`` and the distributed optimizer assert them), and
``torch.tensor(..., device='cuda')`` makes CPU tensors (the loss scaler's scale, the found-inf
flag); nothing else here stands in for CUDA beyond the CPU shims ``init_megatron`` applies.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from megatron_pp_ext.models import tiny_gpt


def _patch_for_cpu() -> None:
    from megatron_pp_ext.train.cpu_shims import _on_cpu
    from megatron_pp_ext.train.megatron_lm_cpu import _cuda_named_type

    torch.Tensor.type = _cuda_named_type
    # the loss scaler and the found-inf flag are made with torch.tensor(..., device='cuda')
    torch.tensor = _on_cpu(torch.tensor)


def _build(cfg, pp: int, precision: str, distributed: bool, lr: float, loss_scale_window: int,
           vp=None, layout: str = "loop"):
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module

    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[precision]
    config = tiny_gpt.make_transformer_config(
        cfg, pp, vp, fp16=precision == "fp16", bf16=precision == "bf16",
        params_dtype=dtype, pipeline_dtype=dtype)
    chunks = tiny_gpt.build_model_chunks(cfg, vp_size=vp, layout=layout, config=config,
                                         wrap_ddp=False)
    if precision != "fp32":
        chunks = [Float16Module(config, chunk) for chunk in chunks]
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=precision != "fp32", overlap_grad_reduce=False,
        use_distributed_optimizer=distributed)
    model = tiny_gpt.wrap_with_ddp(chunks, config, ddp_config)
    tiny_gpt.configure_hooks(config, model)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=lr, weight_decay=0.01, clip_grad=1.0,
                        fp16=precision == "fp16", bf16=precision == "bf16", params_dtype=dtype,
                        use_distributed_optimizer=distributed, initial_loss_scale=2.0 ** 12,
                        loss_scale_window=loss_scale_window, hysteresis=1,
                        min_loss_scale=1.0),
        model)
    config.grad_scale_func = optimizer.scale_loss  # as megatron.training does
    return model, optimizer, config


def _leaf(optimizer):
    from megatron.core.optimizer.optimizer import ChainedOptimizer

    inner = getattr(optimizer, "wrapped", optimizer)
    return inner.chained_optimizers[0] if isinstance(inner, ChainedOptimizer) else inner


def _state_of(model, optimizer) -> dict[str, Any]:
    """Everything a step may change on this rank, as comparable values."""
    leaf = _leaf(optimizer)
    out: dict[str, Any] = {}
    for i, chunk in enumerate(model):
        for name, param in chunk.named_parameters():
            out[f"model/{i}/{name}"] = param.detach().clone()
    inner = leaf.optimizer
    for g, group in enumerate(inner.param_groups):
        for j, param in enumerate(group["params"]):
            out[f"main/{g}/{j}"] = param.detach().clone()
            for key, value in inner.state.get(param, {}).items():
                out[f"state/{g}/{j}/{key}"] = (value.detach().clone() if torch.is_tensor(value)
                                               else value)
    scaler = getattr(leaf, "grad_scaler", None)
    if scaler is not None:
        out["scaler/scale"] = scaler.scale.detach().clone()
        for key in ("_growth_tracker", "_hysteresis_tracker"):
            if hasattr(scaler, key):
                out[f"scaler/{key}"] = getattr(scaler, key)
    return out


def _differences(a: dict, b: dict) -> list[str]:
    bad = sorted(set(a) ^ set(b))
    for key in sorted(set(a) & set(b)):
        x, y = a[key], b[key]
        if torch.is_tensor(x):
            same = torch.is_tensor(y) and x.dtype == y.dtype and x.shape == y.shape and \
                torch.equal(x.view(-1).view(torch.uint8) if x.numel() else x,
                            y.view(-1).view(torch.uint8) if y.numel() else y)
        else:
            same = x == y
        if not same:
            bad.append(key)
    return bad


def _plain(value):
    if torch.is_tensor(value):
        return float(value)
    return value


def run_post_validation(rank: int, world_size: int, pp: int = 2, precision: str = "fp16",
                        distributed: bool = False, schedule: str = "zb-h2",
                        clips: Sequence[float] = (), inf_step: int | None = None,
                        num_microbatches: int = 4, lr: float = 1e-2,
                        loss_scale_window: int = 2,
                        without_restore: bool = False, run_ahead: bool = False,
                        layout: str = "loop") -> dict[str, Any]:
    from megatron.core import parallel_state

    from megatron_pp_ext.integration.forward_backward import ScheduleFunction
    from megatron_pp_ext.integration.post_validation import PostValidatedOptimizer
    from megatron_pp_ext.integration.run_ahead_step import RunAhead
    from megatron_pp_ext.train.processes import init_megatron

    _patch_for_cpu()
    if without_restore:  # the negative control: a rollback that restores nothing
        from megatron_pp_ext.integration import post_validation

        post_validation._Snapshot.restore = lambda self, leaf: None
    cfg = tiny_gpt.TinyGPTConfig(loss_mask_drop=0.0)
    vp = 2 if layout == "v" else None  # the V layout: 2 chunks per rank (zb-v, dualpipev)
    init_megatron(pp, vp, seed=cfg.seed)
    ref_model, ref_opt, _ = _build(cfg, pp, precision, distributed, lr, loss_scale_window,
                                   vp, layout)
    pv_model, pv_base, _ = _build(cfg, pp, precision, distributed, lr, loss_scale_window,
                                  vp, layout)
    pv_opt = PostValidatedOptimizer(pv_base)
    function = ScheduleFunction(schedule)
    dp_rank = parallel_state.get_data_parallel_rank()
    last_stage = parallel_state.is_pipeline_last_stage()
    steps = len(clips)

    def forward_backward(model, step):
        batches = tiny_gpt.mock_batches(cfg, num_microbatches, seed=100 * step + dp_rank)
        for chunk in model:
            chunk.zero_grad_buffer()
        function(forward_step_func=tiny_gpt.forward_step_func,
                 data_iterator=_iterators(batches, model), model=model,
                 num_microbatches=num_microbatches, seq_length=cfg.seq_length,
                 micro_batch_size=cfg.micro_batch_size)
        if step == inf_step and last_stage:  # an fp16 overflow in one parameter's gradient
            param = next(p for p in model[0].parameters() if p.requires_grad)
            param.main_grad.fill_(float("inf"))

    if run_ahead:
        return _run_ahead(cfg, function, ref_model, ref_opt, pv_model, RunAhead(pv_base, pv_model),
                          clips, inf_step, num_microbatches, dp_rank, last_stage, rank)
    ref_results, pv_results, mismatches, snapshot_bytes = [], [], [], []
    ref_states = []
    for k in range(steps + 1):
        pv_opt.zero_grad()  # settles step k-1 (deferred)
        if k > 0:
            outcome = pv_opt.history[-1]
            pv_results.append({"megatron": [_plain(v) for v in outcome.as_megatron()],
                               "rolled_back": outcome.rolled_back, "redone": outcome.redone,
                               "found_inf": outcome.found_inf, "clipped": outcome.clipped})
            mismatches.append(_differences(ref_states[k - 1], _state_of(pv_model, pv_opt)))
        if k == steps:
            break
        for opt in (ref_opt, pv_opt):
            opt.config.clip_grad = clips[k]
        ref_opt.zero_grad()
        forward_backward(ref_model, k)
        ref_results.append([_plain(v) for v in ref_opt.step()])
        ref_states.append(_state_of(ref_model, ref_opt))
        forward_backward(pv_model, k)
        pv_opt.begin_step()  # returns without waiting for the other ranks
        snapshot_bytes.append(pv_opt.snapshot_bytes())
    # the synchronous form too (what Megatron-LM's train_step calls): one more step each
    for opt in (ref_opt, pv_opt):
        opt.config.clip_grad = clips[0]
    ref_opt.zero_grad()
    forward_backward(ref_model, steps)
    sync_ref = [_plain(v) for v in ref_opt.step()]
    pv_opt.zero_grad()
    forward_backward(pv_model, steps)
    sync_pv = [_plain(v) for v in pv_opt.step()]
    sync_mismatch = _differences(_state_of(ref_model, ref_opt), _state_of(pv_model, pv_opt))
    main_numel = sum(p.numel() for g in _leaf(pv_opt).optimizer.param_groups for p in g["params"])
    return {"rank": rank, "pp_rank": parallel_state.get_pipeline_model_parallel_rank(),
            "ref": ref_results, "pv": pv_results, "mismatches": mismatches,
            "sync": (sync_ref, sync_pv, sync_mismatch), "snapshot_bytes": snapshot_bytes,
            "main_numel": main_numel, "leaf": type(_leaf(pv_opt)).__name__,
            "wrapped": type(pv_base).__name__}


def _iterators(batches, model):
    """One iterator over the microbatches per model chunk (every chunk reads each one)."""
    if len(model) == 1:
        return iter(batches)
    return [iter(batches) for _ in model]


def _losses(output) -> list[float]:
    return [float(d["lm loss"]) for d in output or []]


def _run_ahead(cfg, function, ref_model, ref_opt, pv_model, run, clips, inf_step,
               num_microbatches, dp_rank, last_stage, rank) -> dict[str, Any]:
    """The reference loop (Megatron's synchronous step) beside ``RunAhead``: step k+1 runs on
    step k's optimistic weights and is replayed when step k's validation fails. Compared after
    each step is settled (inside the next step's ``forward_backward``, before its optimizer
    step) and the losses of every step (the replay's when replayed)."""
    from megatron.core import parallel_state

    steps = len(clips)
    batches_of = lambda k: tiny_gpt.mock_batches(cfg, num_microbatches, seed=100 * k + dp_rank)
    kwargs = dict(forward_step_func=tiny_gpt.forward_step_func, num_microbatches=num_microbatches,
                  seq_length=cfg.seq_length, micro_batch_size=cfg.micro_batch_size)

    def inject(model, k):
        if k == inf_step and last_stage:
            param = next(p for p in model[0].parameters() if p.requires_grad)
            param.main_grad.fill_(float("inf"))

    def injecting(k):
        def forward_backward(**kw):
            out = function(**kw)
            inject(pv_model, k)
            return out
        return forward_backward

    ref_results, ref_states, ref_losses = [], [], []
    pv_results, pv_losses, mismatches, replayed = [], [], [], []
    for k in range(steps + 1):
        if k < steps:  # the reference's step k
            ref_opt.config.clip_grad = clips[k]
            ref_opt.zero_grad()
            for chunk in ref_model:
                chunk.zero_grad_buffer()
            ref_losses.append(_losses(function(data_iterator=_iterators(batches_of(k), ref_model),
                                               model=ref_model, **kwargs)))
            inject(ref_model, k)
            ref_results.append([_plain(v) for v in ref_opt.step()])
            ref_states.append(_state_of(ref_model, ref_opt))
            output, outcome, again = run.forward_backward(injecting(k),
                                                          _iterators(batches_of(k), pv_model),
                                                          **kwargs)
            pv_losses.append(_losses(output))
            replayed.append(again)
        else:
            outcome = run.finish()
        if k > 0:  # step k-1 is settled now
            pv_results.append({"megatron": [_plain(v) for v in outcome.as_megatron()],
                               "rolled_back": outcome.rolled_back, "redone": outcome.redone,
                               "found_inf": outcome.found_inf, "clipped": outcome.clipped})
            if k < steps:  # compare before step k's optimizer step
                mismatches.append(_differences(ref_states[k - 1],
                                               _state_of(pv_model, run.optimizer)))
        if k < steps:
            run.optimizer.config.clip_grad = clips[k]
            run.optimizer_step()
    mismatches.append(_differences(ref_states[-1], _state_of(pv_model, run.optimizer)))
    return {"rank": rank, "pp_rank": parallel_state.get_pipeline_model_parallel_rank(),
            "ref": ref_results, "pv": pv_results, "mismatches": mismatches,
            "ref_losses": ref_losses, "pv_losses": pv_losses, "replayed": replayed,
            "replays": run.replays, "snapshot_bytes": [run.optimizer.snapshot_bytes()],
            "leaf": type(_leaf(run.optimizer)).__name__}
