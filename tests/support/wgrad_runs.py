"""Spawn targets for the I/W split on the layers people train with: the tiny GPT under tensor
and sequence parallelism, with gradient-accumulation fusion, or with Transformer Engine
stand-in linears; and the probe that watches every I and W (tests/test_w_proof.py).

Every target returns, per rank, the losses (last stage), the gradients by
``"tp<r>:<global name>"`` (under tensor parallelism the two ranks of a stage hold different
shards under one name) and, for the plugin's schedules, the step's ``weight_grads``
(``StepResult.weight_grads``: GEMMs I queued and W ran, W's seconds)."""

from __future__ import annotations

import collections
import contextlib
import warnings
from typing import Any, Optional

import torch

from megatron_pp_ext.models import tiny_gpt
from megatron_pp_ext.models.tiny_gpt import TinyGPTConfig
from support.reference import call_schedule

__all__ = ["tp_step", "tp_steps", "merge", "fused_kernel_standin", "fused_w_unit", "w_proof_step",
           "w_proof_steps", "PlainLinear", "plain_layer_spec"]


class _FusedWeightGradient:
    """A CPU stand-in for apex's ``fused_weight_gradient_mlp_cuda`` (GPU-only), which
    Megatron's backward calls under ``gradient_accumulation_fusion``: ``main_grad +=
    grad_output^T @ input`` with fp32 accumulation (the kernel's documented arithmetic)."""

    @staticmethod
    def wgrad_gemm_accum_fp32(total_input, grad_output, main_grad):
        main_grad.addmm_(grad_output.float().t(), total_input.float())

    @staticmethod
    def wgrad_gemm_accum_fp16(total_input, grad_output, main_grad):
        main_grad.add_((grad_output.float().t() @ total_input.float()).to(main_grad.dtype))


@contextlib.contextmanager
def fused_kernel_standin():
    """Let Megatron's linears take ``gradient_accumulation_fusion=True`` on the CPU: its
    layers module sees the stand-in kernel as apex's (restored on exit)."""
    from megatron.core.tensor_parallel import layers

    saved = (layers._grad_accum_fusion_available,
             getattr(layers, "fused_weight_gradient_mlp_cuda", None))
    layers._grad_accum_fusion_available = True
    layers.fused_weight_gradient_mlp_cuda = _FusedWeightGradient
    try:
        yield
    finally:
        layers._grad_accum_fusion_available, kernel = saved
        if kernel is None:
            del layers.fused_weight_gradient_mlp_cuda
        else:
            layers.fused_weight_gradient_mlp_cuda = kernel


def _build(cfg, pp, vp, layout, tp, sp, ddp, fused, layer_spec, overlap=False):
    from megatron.core.distributed import DistributedDataParallelConfig

    from megatron_pp_ext.train.processes import init_megatron

    init_megatron(pp, vp, tp=tp, seed=cfg.seed)
    config = tiny_gpt.make_transformer_config(cfg, pp, vp, tp_size=tp, sequence_parallel=sp,
                                              gradient_accumulation_fusion=fused)
    ddp_config = None
    if ddp:
        ddp_config = DistributedDataParallelConfig(overlap_grad_reduce=overlap,
                                                   use_distributed_optimizer=False)
    chunks = tiny_gpt.build_model_chunks(cfg, vp_size=vp, layout=layout, config=config,
                                         wrap_ddp=ddp, ddp_config=ddp_config,
                                         layer_spec=layer_spec)
    if ddp:
        tiny_gpt.configure_hooks(config, chunks)
        for chunk in chunks:
            chunk.zero_grad_buffer()
    return config, chunks


def _grads(chunks, cfg) -> dict[str, torch.Tensor]:
    from megatron.core import parallel_state

    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    return {f"tp{tp_rank}:{name}": grad
            for name, grad in tiny_gpt.global_grads(chunks, cfg).items()}


def _stats(schedule):
    state = getattr(schedule, "state", None)
    step = getattr(state, "last_step", None)
    return None if step is None else step.weight_grads


def tp_step(rank: int, world_size: int, schedule: Any, pp: int = 2, tp: int = 2,
            sp: bool = False, vp: Optional[int] = None, layout: str = "loop",
            num_microbatches: int = 8, cfg: TinyGPTConfig = TinyGPTConfig(), ddp: bool = True,
            fused: bool = False, overlap: bool = False, layer_spec_fn=None) -> dict[str, Any]:
    """One step of the tiny GPT at tensor parallel ``tp`` (sequence parallel ``sp``) x pipeline
    ``pp`` under ``schedule`` (a Megatron schedule name or a plugin ScheduleFunction).
    ``fused``: gradient-accumulation fusion (with the CPU stand-in of apex's kernel);
    ``layer_spec_fn()``: the layer spec to build from (e.g. TE stand-in linears)."""
    from megatron.core import parallel_state

    vp = vp if (vp or 1) > 1 else None
    if layout == "v" and vp is None:
        vp = 2
    with (fused_kernel_standin() if fused else contextlib.nullcontext()), \
            warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        layer_spec = layer_spec_fn() if layer_spec_fn is not None else None
        config, chunks = _build(cfg, pp, vp, layout, tp, sp, ddp, fused, layer_spec, overlap)
        batches = tiny_gpt.mock_batches(cfg, num_microbatches, seed=0)
        iterators = [iter(batches) for _ in chunks]
        forward_data = call_schedule(schedule, tiny_gpt.forward_step_func, chunks, iterators,
                                     cfg, num_microbatches)
    stages = [tiny_gpt.unwrap(c).pipeline_stage for c in chunks]
    holds_last = tiny_gpt.num_stages(pp, vp) - 1 in stages
    return {
        "rank": rank,
        "tp_rank": parallel_state.get_tensor_model_parallel_rank(),
        "pp_rank": parallel_state.get_pipeline_model_parallel_rank(),
        "losses": [float(d["lm loss"]) for d in forward_data] if holds_last else [],
        "grads": _grads(chunks, cfg),
        "weight_grads": _stats(schedule),
        "warnings": [str(w.message) for w in caught if "megatron_pp_ext" in str(w.message)],
        "te_stores_delaying_after": _te_delaying(chunks),
    }


def _te_delaying(chunks) -> int:
    """TE modules whose store still delays after the step (the plugin must put theirs back)."""
    from megatron_pp_ext.runtime.wgrad import follows_te_api

    return sum(1 for chunk in chunks for m in chunk.modules()
               if follows_te_api(m) and m.wgrad_store is not None
               and m.wgrad_store.delay_wgrad_compute())


def tp_steps(rank: int, world_size: int, runs) -> list[dict[str, Any]]:
    """Several :func:`tp_step` runs (keyword dicts) in the same processes."""
    return [tp_step(rank, world_size, **run) for run in runs]


def w_proof_steps(rank: int, world_size: int, runs) -> list[dict[str, Any]]:
    """Several :func:`w_proof_step` runs (keyword dicts) in the same processes."""
    return [w_proof_step(rank, world_size, **run) for run in runs]


def merge(ranks) -> dict[str, Any]:
    """The ranks of one tp x pp run (data parallel 1): losses of the last stage's TP rank 0,
    every gradient by "tp<r>:<name>", each rank's weight_grads."""
    grads: dict[str, torch.Tensor] = {}
    losses: list[float] = []
    for r in ranks:
        for name, grad in r["grads"].items():
            assert name not in grads, f"{name} held twice"
            grads[name] = grad
        if r["losses"] and r["tp_rank"] == 0:
            losses = r["losses"]
    return {"grads": grads, "losses": losses,
            "weight_grads": [r["weight_grads"] for r in ranks],
            "pp_ranks": [r.get("pp_rank") for r in ranks],
            "warnings": [w for r in ranks for w in r["warnings"]]}


class PlainLinear(torch.nn.Linear):
    """A plain ``torch.nn.Linear`` subclass with Megatron's linear constructor and its
    (output, bias) return: a layer kind the I/W split does not handle."""

    def __init__(self, input_size: int, output_size: int, *, config, bias: bool = True,
                 skip_bias_add: bool = False, **_unused: Any):
        super().__init__(input_size, output_size, bias=bias)
        self.skip_bias_add = skip_bias_add

    def forward(self, x):
        out = torch.nn.functional.linear(x, self.weight)
        if self.bias is None:
            return out, None
        return (out, self.bias) if self.skip_bias_add else (out + self.bias, None)


def plain_layer_spec():
    from support.te_standin import te_layer_spec

    return te_layer_spec(PlainLinear)


# --------------------------------------------------------------------------------------------
# Fused accumulation into main_grad, one layer, watched op by op
# --------------------------------------------------------------------------------------------


class _OpLog:
    """Every aten op run while entered: (name, output numel, aliases an input or main_grad)."""

    def __init__(self, main_grad: torch.Tensor):
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_flatten

        log = self
        self.ops: list[tuple[str, int, bool]] = []

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
                storages = {t.untyped_storage().data_ptr() for t in inputs + [main_grad]}
                for t in tree_flatten(out)[0]:
                    if isinstance(t, torch.Tensor):
                        log.ops.append((str(func.overloadpacket.__name__), t.numel(),
                                        t.untyped_storage().data_ptr() in storages))
                return out

        self.mode = Mode()


def fused_w_unit(rank: int, world_size: int, weight_dtype: str = "float32",
                 microbatches: int = 3) -> dict[str, Any]:
    """One Megatron linear with gradient-accumulation fusion (weight of ``weight_dtype``, fp32
    main_grad) through I and W, microbatch by microbatch: main_grad after each I and W, the ops
    each W ran, the expected fp32 accumulation, and Megatron's own backward's result (with the
    CPU stand-in of its fused kernel) on the same data."""
    from megatron.core.tensor_parallel.layers import (
        linear_with_grad_accumulation_and_async_allreduce as linear,
    )

    from megatron_pp_ext.ir import Action
    from megatron_pp_ext.runtime import wgrad
    from megatron_pp_ext.train.processes import init_megatron

    init_megatron(1)
    dtype = getattr(torch, weight_dtype)
    gen = torch.Generator().manual_seed(0)
    out_features, in_features = 64, 48  # weight: 3072 elements; activations: 8 x 48, 8 x 64
    init = torch.randn(out_features, in_features, generator=gen).to(dtype)
    xs = [torch.randn(4, 2, in_features, generator=gen).to(dtype) for _ in range(microbatches)]
    dys = [torch.randn(4, 2, out_features, generator=gen).to(dtype) for _ in range(microbatches)]

    def make_weight():
        weight = torch.nn.Parameter(init.clone())
        weight.main_grad = torch.zeros(out_features, in_features, dtype=torch.float32)
        weight.grad_added_to_main_grad = False
        return weight

    weight = make_weight()
    split = wgrad.WeightGradSplit([torch.nn.Module()])
    wgrad._dummy_wgrad(weight)  # the process's one dummy buffer of this shape, made up front
    after_i, after_w, w_ops, grads_after_w = [], [], [], []
    with split.deferring():
        for mb, (x, dy) in enumerate(zip(xs, dys)):
            y = linear(x.clone().requires_grad_(), weight, None, True, False, False)
            with split.capturing(Action(0, "I", mb)):
                y.backward(dy)
            after_i.append(weight.main_grad.clone())
            log = _OpLog(weight.main_grad)
            with log.mode:
                split.backward_weight(Action(0, "W", mb))
            w_ops.append(log.ops)
            after_w.append(weight.main_grad.clone())
            grads_after_w.append(weight.grad is not None)
    expected = torch.zeros(out_features, in_features, dtype=torch.float32)
    for x, dy in zip(xs, dys):
        expected += dy.reshape(-1, out_features).float().t() @ x.reshape(-1, in_features).float()

    megatron_weight = make_weight()
    with fused_kernel_standin():
        for x, dy in zip(xs, dys):
            linear(x.clone().requires_grad_(), megatron_weight, None, True, False,
                   False).backward(dy)
    return {"after_i": after_i, "after_w": after_w, "w_ops": w_ops, "expected": expected,
            "megatron": megatron_weight.main_grad.clone(), "grads_after_w": grads_after_w,
            "weight_numel": weight.numel(), "stats": split.stats.as_dict()}


# --------------------------------------------------------------------------------------------
# Proof that W does the work: every I and W of a step, watched
# --------------------------------------------------------------------------------------------


def _deferred_weights(module) -> list:
    """The weights the I/W split defers in ``module``: Megatron's linears' and TE modules'."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    from megatron_pp_ext.runtime.wgrad import _te_weights, follows_te_api

    out = []
    for m in module.modules():
        if isinstance(m, (ColumnParallelLinear, RowParallelLinear)):
            if getattr(m, "weight", None) is not None:
                out.append(m.weight)
        elif follows_te_api(m) and m.wgrad_store is not None:
            out.extend(_te_weights(m))
    return out


def _grad_now(param) -> torch.Tensor:
    grad = getattr(param, "main_grad", None)
    if grad is None:
        grad = param.grad
    return torch.zeros_like(param) if grad is None else grad.detach().clone()


def w_proof_step(rank: int, world_size: int, name: str, pp: int = 2, tp: int = 1,
                 sp: bool = False, layout: str = "loop", num_microbatches: int = 4,
                 layer_spec_fn=None, cfg: TinyGPTConfig = TinyGPTConfig()) -> dict[str, Any]:
    """One step of the plugin's schedule ``name`` on the DDP-wrapped tiny GPT with every B, I
    and W watched (each rank's parameters' gradients, main_grad, compared before and after).

    * after an I: no deferred weight (Megatron's linears', TE modules') of the rank has
      changed, bit for bit (a violation otherwise);
    * a W changes nothing but the deferred weights (a violation otherwise);
    * ``deltas[(weight, microbatch)] = (kind, change)``: how much each deferred weight changed
      in the B or W of that microbatch, by ``"tp<r>:<global name>"``. Run with a schedule of
      full backwards (1f1b) these are the full backward's weight gradients of each
      microbatch: a split schedule's W must have made the same changes.

    Also returns the final gradients and the step's ``weight_grads``."""
    from megatron.core import parallel_state

    from megatron_pp_ext.integration.forward_backward import ScheduleFunction
    from megatron_pp_ext.integration.megatron_stage import MegatronStageWork

    vp = 2 if layout == "v" else None
    layer_spec = layer_spec_fn() if layer_spec_fn is not None else None
    config, chunks = _build(cfg, pp, vp, layout, tp, sp, True, False, layer_spec)
    schedule = ScheduleFunction(name)
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    names = {id(p): f"tp{tp_rank}:{n}"
             for n, p in tiny_gpt.named_global_parameters(chunks, cfg).items()}
    params = [p for chunk in chunks for p in chunk.parameters()]
    deferred = {id(w) for chunk in chunks for w in _deferred_weights(chunk)}
    violations: list[str] = []
    deltas: dict[tuple, tuple] = {}
    counts = collections.Counter()

    def snapshot():
        return [_grad_now(p) for p in params]

    original_backward, original_weight = MegatronStageWork.backward, MegatronStageWork.weight

    def watch(action, run):
        before = snapshot()
        result = run()
        for p, b, a in zip(params, before, snapshot()):
            changed = not torch.equal(a, b)
            if id(p) in deferred:
                if action.kind == "I" and changed:
                    violations.append(f"{action}: deferred weight {names[id(p)]} changed in I")
                if action.kind in "BW" and changed:
                    key = (names[id(p)], action.microbatch)
                    if key in deltas:
                        violations.append(f"{action}: {key} changed by two actions")
                    deltas[key] = (action.kind, a - b)
            elif action.kind == "W" and changed:
                violations.append(f"{action}: {names[id(p)]}, not deferred, changed in W")
        counts[action.kind] += 1
        return result

    def backward(self, action, output_grad):
        return watch(action, lambda: original_backward(self, action, output_grad))

    def weight(self, action):
        return watch(action, lambda: original_weight(self, action))

    MegatronStageWork.backward, MegatronStageWork.weight = backward, weight
    try:
        batches = tiny_gpt.mock_batches(cfg, num_microbatches, seed=0)
        iterators = [iter(batches) for _ in chunks]
        forward_data = call_schedule(schedule, tiny_gpt.forward_step_func, chunks, iterators,
                                     cfg, num_microbatches)
    finally:
        MegatronStageWork.backward, MegatronStageWork.weight = original_backward, original_weight
    stages = [tiny_gpt.unwrap(c).pipeline_stage for c in chunks]
    holds_last = tiny_gpt.num_stages(pp, vp) - 1 in stages
    return {"rank": rank, "tp_rank": tp_rank,
            "pp_rank": parallel_state.get_pipeline_model_parallel_rank(),
            "violations": violations, "deltas": deltas,
            "counts": dict(counts), "deferred_weights": len(deferred),
            "losses": [float(d["lm loss"]) for d in forward_data] if holds_last else [],
            "grads": _grads(chunks, cfg), "weight_grads": _stats(schedule), "warnings": []}
