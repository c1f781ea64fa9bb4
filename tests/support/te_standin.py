"""A CPU stand-in for Transformer Engine's linear module and its deferred weight gradient
(TE is GPU-only and not installed here). It follows TE 2.x's documented API, read from
NVIDIA/TransformerEngine:

* ``transformer_engine/pytorch/module/_common.py``: ``WeightGradStore(delay_wgrad_compute=False,
  ub_bulk_wgrad=False)`` with ``delay_wgrad_compute()``, ``put(tensor_list, func)`` (queues the
  wgrad GEMM and its operands) and ``pop()`` (runs the oldest: ``func(*tensor_list)``);
* ``transformer_engine/pytorch/module/base.py``: ``TransformerEngineBaseModule`` holds
  ``wgrad_store``; ``need_backward_dw()``; ``backward_dw()`` pops, assigns ``weight.grad``
  unless ``fuse_wgrad_accumulation`` (then the GEMM accumulated into ``main_grad``), and calls
  the hooks given to ``register_wgrad_accumulation_and_reduce_hooks``;
* ``transformer_engine/pytorch/module/linear.py``: built with ``delay_wgrad_compute=True`` the
  module's backward ``put``s ``[inputmat_total, grad_output]`` with its ``wgrad_gemm`` instead of
  running it, marks its weights ``skip_backward_post_hook``, and under Megatron's DDP with
  fusion returns a dummy wgrad with ``grad_added_to_main_grad`` set;
* Megatron's wrapper (``megatron/core/extensions/transformer_engine.py``, ``TELinear``) passes
  ``delay_wgrad_compute`` only from its config and runs ``backward_dw`` only when
  ``config.delay_wgrad_compute``.

:class:`MegatronTELinear` is the stand-in of Megatron's wrapper: the plugin passes over
classes of Megatron's own modules to call TE's ``backward_dw``, so it declares Megatron's
module path. Tensor parallel size 1 only (TE's TP paths are not imitated)."""

from __future__ import annotations

import dataclasses
import functools
import queue
from typing import Any

import torch

__all__ = ["WeightGradStore", "TELinear", "MegatronTELinear", "OldTELinear", "te_layer_spec"]

_dummy: dict = {}


def get_dummy_wgrad(shape, dtype) -> torch.Tensor:
    """As TE's: one cached buffer per shape and dtype."""
    key = (tuple(shape), dtype)
    if key not in _dummy:
        _dummy[key] = torch.zeros(shape, dtype=dtype)
    return _dummy[key]


class WeightGradStore:
    """TE's ``WeightGradStore``: a FIFO of (tensor_list, func)."""

    def __init__(self, delay_wgrad_compute=False, ub_bulk_wgrad=False):
        if delay_wgrad_compute:
            assert ub_bulk_wgrad is False, \
                "ub_bulk_wgrad is not supported when enabling delay_wgrad_compute"
            self.context = queue.Queue()
            self.enabled = True
        else:
            self.context = None
            self.enabled = False

    def delay_wgrad_compute(self):
        return self.enabled

    def put(self, tensor_list, func):
        assert self.enabled is True, "delay_wgrad_compute is not enabled"
        self.context.put([tensor_list, func])

    def pop(self):
        assert self.enabled is True, "delay_wgrad_compute is not enabled"
        if self.context.qsize() > 0:
            tensor_list, func = self.context.get()
            return func(*tensor_list), tensor_list
        raise RuntimeError("Pop empty queue.")

    def assert_empty(self):
        assert self.enabled is True and self.context.empty(), "Queue is not empty."


class _Linear(torch.autograd.Function):
    """TE's ``_Linear``: y = x W^T; its backward computes dgrad, and the wgrad now or, with a
    delaying store, puts it in the store."""

    @staticmethod
    def forward(ctx, weight, inp, module):
        ctx.save_for_backward(inp, weight)
        ctx.module = module
        store = module.wgrad_store
        ctx.wgrad_store = store if store is not None and store.delay_wgrad_compute() else None
        return inp.matmul(weight.t())

    @staticmethod
    def backward(ctx, grad_output):
        inp, weight = ctx.saved_tensors
        module = ctx.module
        fuse = module.fuse_wgrad_accumulation
        dgrad = grad_output.matmul(weight)
        x = inp.reshape(-1, inp.shape[-1])
        dy = grad_output.reshape(-1, grad_output.shape[-1])

        @torch.no_grad()  # TE's GEMM is a kernel call, outside autograd
        def wgrad_gemm(x, dy):  # TE: general_gemm(x, dy, accumulate=fuse, out=main_grad)
            if fuse:
                weight.main_grad.addmm_(dy.t().float(), x.float())
                return None, None
            return dy.t().matmul(x), None

        if ctx.wgrad_store is not None:
            ctx.wgrad_store.put([x, dy], wgrad_gemm)
            wgrad = None
        else:
            wgrad, _ = wgrad_gemm(x, dy)
        if fuse and hasattr(weight, "grad_added_to_main_grad"):
            weight.grad_added_to_main_grad = True
            wgrad = get_dummy_wgrad(list(weight.shape), weight.dtype)
        elif fuse:
            wgrad = None
        return wgrad, dgrad, None


class TELinear(torch.nn.Module):
    """TE's ``Linear`` (TransformerEngineBaseModule's deferral API), with Megatron's linear
    constructor arguments and its (output, bias) return."""

    def __init__(self, input_size: int, output_size: int, *, config, init_method=None,
                 bias: bool = True, skip_bias_add: bool = False, delay_wgrad_compute=None,
                 **_unused: Any):
        super().__init__()
        assert config.tensor_model_parallel_size == 1, "the TE stand-in is tp=1 only"
        self.config = config
        self.weight = torch.nn.Parameter(torch.empty(output_size, input_size))
        self.bias = torch.nn.Parameter(torch.zeros(output_size)) if bias else None
        torch.nn.init.normal_(self.weight, std=0.02)
        self.skip_bias_add = skip_bias_add
        self.weight_names = ["weight"]
        self.fuse_wgrad_accumulation = config.gradient_accumulation_fusion
        self.wgrad_accumulation_and_reduce_hooks = []
        if delay_wgrad_compute is None:  # as Megatron's wrapper: from its config
            delay_wgrad_compute = config.delay_wgrad_compute
        self.wgrad_store = WeightGradStore(delay_wgrad_compute, False)
        if delay_wgrad_compute:
            self.weight.skip_backward_post_hook = True

    def register_wgrad_accumulation_and_reduce_hooks(self, hook):
        self.wgrad_accumulation_and_reduce_hooks.append(hook)

    def need_backward_dw(self):
        return self.wgrad_store is not None and self.wgrad_store.delay_wgrad_compute()

    def backward_dw(self):
        if not self.need_backward_dw():
            return
        (wgrad, _bgrad), _ = self.wgrad_store.pop()
        if not self.fuse_wgrad_accumulation:
            self.weight.grad = wgrad.to(self.weight.dtype)
        del wgrad
        for hook in self.wgrad_accumulation_and_reduce_hooks:
            hook()

    def forward(self, x):
        out = _Linear.apply(self.weight, x, self)
        if self.bias is None:
            return out, None
        if self.skip_bias_add:
            return out, self.bias
        return out + self.bias, None


class MegatronTELinear(TELinear):
    """Megatron's ``TELinear`` wrapper: runs TE's ``backward_dw`` only when Megatron's config
    has ``delay_wgrad_compute`` (which Megatron-Core 0.19.2 allows only with MoE overlap)."""

    def backward_dw(self):
        if self.config.delay_wgrad_compute:
            super().backward_dw()


# the plugin recognises Megatron's wrappers by the module that defines them
MegatronTELinear.__module__ = "megatron.core.extensions.transformer_engine"


class OldTELinear(TELinear):
    """TE before 2.3: no ``WeightGradStore``, so no deferral to switch on."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.wgrad_store = None


def te_layer_spec(linear=MegatronTELinear):
    """Megatron's local GPT layer spec with ``linear`` for QKV, the attention projection, FC1
    and FC2 (as Megatron's TE spec has TE modules there)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec()
    layer = spec.submodules
    attention = layer.self_attention
    attention = dataclasses.replace(attention, submodules=dataclasses.replace(
        attention.submodules, linear_qkv=linear, linear_proj=linear))
    mlp = layer.mlp
    mlp = functools.partial(mlp.func, *mlp.args, **{
        **mlp.keywords,
        "submodules": dataclasses.replace(mlp.keywords["submodules"], linear_fc1=linear,
                                          linear_fc2=linear)})
    layer = dataclasses.replace(layer, self_attention=attention, mlp=mlp)
    return dataclasses.replace(spec, submodules=layer)


def old_te_layer_spec():
    return te_layer_spec(OldTELinear)
