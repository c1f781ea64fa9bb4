"""The I/W split of the backward for Megatron-Core models.

I runs Megatron's own ``backward_step`` while the layers that hold weight-gradient GEMMs
compute only their input gradient and queue the GEMM, keyed by the action's (stage,
microbatch). W pops that queue, runs the GEMMs and hands each result to the weight through
autograd (a view of the weight), so the weight's AccumulateGrad node and the hooks on it -
Megatron DDP's grad-ready / ``main_grad`` hook - fire exactly once per microbatch, as in a
full backward. Two kinds of layers defer:

* **Megatron's linear layers** (ColumnParallelLinear, RowParallelLinear: everything built on
  ``LinearWithGradAccumulationAndAsyncCommunication``), with and without sequence parallelism
  and with ``gradient_accumulation_fusion``. Their autograd function's backward is replaced
  while a split step runs (:func:`deferring_linear_backward`).

  *Sequence parallelism* (``ctx.sequence_parallel``: QKV, FC1 and the output layer under
  ``--sequence-parallel``): the forward all-gathered the input along the sequence and kept
  only this rank's shard, and Megatron's own backward all-gathers it again for the weight
  GEMM. W does the same: the task keeps the shard (what the forward saved anyway) and W
  re-gathers it into one buffer reused by every task of the rank. The alternative, keeping
  the gathered input from I to W, would hold (tp - 1) x the shard per pending linear per
  pending microbatch on top of what the forward keeps; re-gathering costs one all-gather per
  such linear per microbatch, which Megatron's backward pays too: it only moves from I to W.
  The all-gather is a collective on the tensor-parallel group: the ranks of one TP group hold
  the same pipeline stages and run the same action list (one schedule, one pipeline rank),
  and each I queues its tasks in the same (autograd) order on all of them, so their W's issue
  the same all-gathers in the same order.

  *Gradient-accumulation fusion* (the weight has ``main_grad``): W accumulates the GEMM
  straight into ``main_grad`` in its dtype (fp32), as Megatron's ``wgrad_gemm_accum_fp32``
  does: with Megatron's fused kernel where it is available (CUDA tensors, apex's
  ``fused_weight_gradient_mlp_cuda``), else one ``main_grad.addmm_(dy^T, x)``. When the
  operands are bf16/fp16 and ``main_grad`` fp32, the operands are upcast first
  (activation-sized temporaries, never weight-sized): a product of two bf16 numbers is exact
  in fp32, so this is the kernel's bf16 GEMM with fp32 accumulation. The weight then gets
  a dummy gradient (zeros, one buffer per shape and dtype, shared, never copied: autograd
  takes a view of it) with ``grad_added_to_main_grad`` set, as Megatron's backward does.

* **Transformer Engine linears** (TE 2.3+: ``Linear``, ``LayerNormLinear``, ``LayerNormMLP``,
  ``GroupedLinear`` and Megatron's wrappers of them), through TE's own deferral: a module
  built with ``delay_wgrad_compute=True`` holds a ``WeightGradStore`` that its backward
  ``put``s the wgrad GEMM into, and ``backward_dw()`` pops and runs it (TE's API: see
  ``transformer_engine/pytorch/module/base.py``, ``TransformerEngineBaseModule.backward_dw``
  / ``need_backward_dw`` / ``register_wgrad_accumulation_and_reduce_hooks``, and
  ``module/_common.py``, ``WeightGradStore(delay_wgrad_compute, ub_bulk_wgrad)`` with
  ``put(tensor_list, func)`` / ``pop()``). Megatron-Core 0.19.2 passes
  ``delay_wgrad_compute`` to TE only when its config has it, which it accepts only together
  with ``overlap_moe_expert_parallel_comm``; so while a split step runs the plugin gives every
  TE module of the model a delaying store itself (and puts the module's own store back after
  the step), and W calls TE's ``backward_dw`` (past Megatron's wrapper, which would skip it
  because of that config flag). Each ``put`` of an I is captured under the I's (stage,
  microbatch) and handed back to the module's store by that microbatch's W just before
  ``backward_dw``, so each W computes exactly its own microbatch's wgrad. TE is GPU-only and
  not installed here: this path is tested with a CPU stand-in that follows TE's API
  (``tests/support/te_standin.py``) and is unverified on a GPU.

Everything else (layer norms, embeddings, biases, foreign layers) gets its gradients in I, as
part of the full backward of those modules: correct, only not deferred. One warning per
process names the layers with a weight-gradient GEMM that W cannot hold and says what the
schedule loses (:meth:`WeightGradSplit.warn_undeferred`).

Each step's :class:`WeightGradStats` (per rank) count the weight GEMMs I queued and W ran,
and the time W spent on them: the work moved from I to W.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import inspect
import math
import threading
import time
import warnings
from dataclasses import dataclass, field

import torch

from .. import megatron_compat
from ..ir import Action
from .memory import unique_bytes

_capture = threading.local()  # the running I's (or B's) capture; see WeightGradSplit.capturing
_patch_lock = threading.Lock()
_patch_users = 0  # split-backward steps running now (threads of one process may overlap)
_original_backward = None  # the linear layer's own backward, to call where we cannot split
_original_attribute = None  # the class attribute as it was (a staticmethod), to put back
_SCANNED = "_megatron_pp_ext_wgrad_scan"  # set on a model chunk once it was scanned
_warned = False  # the undeferred-layers warning: once per process
_dummy_lock = threading.Lock()
_dummy_wgrads: dict[tuple, torch.Tensor] = {}


# --------------------------------------------------------------------------------------------
# What a step moved from I to W
# --------------------------------------------------------------------------------------------


@dataclass
class WeightGradStats:
    """One rank's weight-gradient GEMMs in one step.

    ``deferred``: GEMMs I queued for W, ``by_kind`` splits them ("linear", "linear+sp" for
    sequence-parallel ones, "+fused" with gradient-accumulation fusion, "te" for Transformer
    Engine modules); ``in_w``: GEMMs W ran (equal to ``deferred`` after a step);
    ``w_seconds``: host time W spent running them (launch time on a GPU, where kernels are
    asynchronous); ``kept_in_i``: Megatron linear backwards that could not split and ran
    whole in I; ``in_b``: TE wgrads run at once after a full B (DualPipeV's B actions)."""

    deferred: int = 0
    in_w: int = 0
    w_seconds: float = 0.0
    kept_in_i: int = 0
    in_b: int = 0
    by_kind: collections.Counter = field(default_factory=collections.Counter)

    def as_dict(self) -> dict:
        return {"deferred": self.deferred, "in_w": self.in_w, "w_seconds": self.w_seconds,
                "kept_in_i": self.kept_in_i, "in_b": self.in_b, "by_kind": dict(self.by_kind)}


# --------------------------------------------------------------------------------------------
# Handing a gradient to a weight
# --------------------------------------------------------------------------------------------


def _dummy_wgrad(weight: torch.Tensor) -> torch.Tensor:
    """Zeros of the weight's shape and dtype, one per process and (shape, dtype, device), as
    TE's ``get_dummy_wgrad``: what DDP's hook sees when the real gradient is in main_grad."""
    key = (tuple(weight.shape), weight.dtype, weight.device)
    with _dummy_lock:
        dummy = _dummy_wgrads.get(key)
        if dummy is None:
            dummy = _dummy_wgrads[key] = torch.zeros(key[0], dtype=key[1], device=key[2])
    return dummy


def _deliver(weight: torch.Tensor, grad: torch.Tensor, dummy: bool = False) -> None:
    """Give ``grad`` to ``weight`` through autograd: its AccumulateGrad adds it (or takes it,
    when the weight has none: through the view it takes a view, no copy) and its hooks fire
    as in a full backward. A dummy must never stay behind in ``weight.grad``: the next
    accumulation would write into the shared buffer."""
    torch.autograd.backward(weight.view_as(weight), grad_tensors=grad)
    if dummy and weight.grad is not None and weight.grad.data_ptr() == grad.data_ptr():
        weight.grad = None


def _fused_kernel():
    """apex's ``fused_weight_gradient_mlp_cuda`` as Megatron imported it, or None."""
    return megatron_compat.grad_accum_fusion_kernel()


def accumulate_wgrad_into(main_grad: torch.Tensor, grad_output_2d: torch.Tensor,
                          input_2d: torch.Tensor) -> None:
    """``main_grad += grad_output^T @ input`` in main_grad's dtype, with no weight-sized
    temporary: Megatron's fused kernel on CUDA tensors (what its own backward calls), else one
    in-place GEMM; bf16/fp16 operands of an fp32 main_grad are upcast first (exact products,
    fp32 accumulation: the kernel's arithmetic)."""
    kernel = _fused_kernel() if input_2d.is_cuda else None
    if kernel is not None:
        if main_grad.dtype == torch.float32:
            kernel.wgrad_gemm_accum_fp32(input_2d, grad_output_2d, main_grad)
            return
        if main_grad.dtype in (torch.float16, torch.bfloat16):
            kernel.wgrad_gemm_accum_fp16(input_2d, grad_output_2d, main_grad)
            return
    if grad_output_2d.dtype != main_grad.dtype:
        grad_output_2d = grad_output_2d.to(main_grad.dtype)
    if input_2d.dtype != main_grad.dtype:
        input_2d = input_2d.to(main_grad.dtype)
    main_grad.addmm_(grad_output_2d.t(), input_2d)


# --------------------------------------------------------------------------------------------
# Megatron's linear layers
# --------------------------------------------------------------------------------------------


@dataclass
class LinearWeightGrad:
    """The weight-gradient GEMM of one Megatron linear layer for one microbatch."""

    weight: torch.Tensor
    input: torch.Tensor  # this rank's sequence shard under sequence parallelism
    grad_output: torch.Tensor
    main_grad: torch.Tensor | None  # set with gradient-accumulation fusion
    sp_group: object | None = None  # the TP group to all-gather the input over, or None

    @property
    def kind(self) -> str:
        return ("linear" + ("+sp" if self.sp_group is not None else "")
                + ("+fused" if self.main_grad is not None else ""))

    def run(self, split: "WeightGradSplit") -> None:
        deliver_linear_wgrads([(self.weight, self.compute(split))])

    def compute(self, split: "WeightGradSplit") -> torch.Tensor | None:
        """The GEMM: its result (the weight's gradient, in the weight's dtype), or None when
        it went straight into ``main_grad`` (gradient-accumulation fusion)."""
        from megatron.core.utils import prepare_input_tensors_for_wgrad_compute

        with torch.no_grad():  # as inside autograd's backward, where Megatron does this
            total_input = self.input
            if self.sp_group is not None:
                # A collective on the TP group: every rank of the group runs the same action
                # list, and its I's queued the same tasks in the same order, so the W's of
                # all of them gather the same inputs in the same order.
                total_input = split.gather_sequence(self.input, self.sp_group)
            grad_output, total_input = prepare_input_tensors_for_wgrad_compute(
                self.grad_output, total_input)
            if self.main_grad is not None:
                accumulate_wgrad_into(self.main_grad, grad_output, total_input)
                return None
            return grad_output.t().matmul(total_input)


def deliver_linear_wgrads(results) -> None:
    """Hand each weight its gradients of one microbatch, ``results`` being ``(weight, GEMM
    result or None)`` in the order the I queued them. A weight that several linears of the
    microbatch use (the output layer under multi-token prediction: the main logits and each
    MTP depth's) gets their sum in that order, in the weight's dtype, delivered once: what
    autograd's input buffer of the weight's AccumulateGrad does in a full backward, so
    Megatron DDP's hook adds the same rounded sum to ``main_grad`` and fires once. (Adding
    each GEMM separately to the fp32 ``main_grad`` is not bit-identical under bf16.) With
    gradient-accumulation fusion each GEMM went into ``main_grad`` already, as in Megatron's
    own backward, and the weight gets one dummy."""
    summed: dict[int, list] = {}
    for weight, grad in results:
        entry = summed.setdefault(id(weight), [weight, None])
        if grad is not None:
            entry[1] = grad if entry[1] is None else entry[1] + grad
    for weight, grad in summed.values():
        if grad is None:
            weight.grad_added_to_main_grad = True
            _deliver(weight, _dummy_wgrad(weight), dummy=True)
        else:
            _deliver(weight, grad)



def _linear_function():
    from megatron.core.tensor_parallel.layers import LinearWithGradAccumulationAndAsyncCommunication

    return LinearWithGradAccumulationAndAsyncCommunication


def _deferring_backward(ctx, grad_output):
    """Input gradient now, weight-gradient GEMM queued; the original where we cannot split
    (outside an I, Megatron-FSDP or GTP weights, the embedding's deferred wgrad buffer)."""
    queue = getattr(_capture, "queue", None)
    splittable = (queue is not None and getattr(_capture, "defer_linears", False)
                  and getattr(ctx, "gtp_remat_size", 1) <= 1 and ctx.grad_output_buffer is None)
    if splittable:
        input_tensor, weight = ctx.saved_tensors
        splittable = not hasattr(weight, "__fsdp_param__")
    if not splittable:
        if queue is not None and getattr(_capture, "defer_linears", False):
            _capture.kept.append(ctx.saved_tensors[1])
        return _original_backward(ctx, grad_output)
    grad_input = grad_output.matmul(weight)
    if ctx.sequence_parallel:
        # as Megatron's backward: the input gradient of the whole sequence, reduce-scattered
        # back to this rank's shard
        from megatron.core.tensor_parallel.layers import dist_reduce_scatter_func

        shard = torch.empty(input_tensor.shape, dtype=input_tensor.dtype,
                            device=input_tensor.device)
        dist_reduce_scatter_func(shard, grad_input, group=ctx.tp_group)
        grad_input = shard
    elif ctx.allreduce_dgrad:
        torch.distributed.all_reduce(grad_input, group=ctx.tp_group)
    grad_bias = None
    if ctx.use_bias:  # summed over the flattened tokens, as Megatron does
        grad_bias = grad_output.reshape(-1, grad_output.shape[-1]).sum(dim=0)
    main_grad = None
    if ctx.gradient_accumulation_fusion:
        main_grad = ctx.main_grad if ctx.main_grad is not None else getattr(
            weight, "main_grad", None)
    sp_group = ctx.tp_group if ctx.sequence_parallel else None
    queue.append(LinearWeightGrad(weight, input_tensor, grad_output, main_grad, sp_group))
    _hide_from_ddp(weight)
    return (grad_input, None, grad_bias) + (None,) * (_num_forward_inputs() - 3)


def _hide_from_ddp(weight) -> None:
    """Megatron DDP's grad-ready hook runs when the weight's AccumulateGrad does, even for the
    None gradient this I returns; with overlap_grad_reduce it asserts a gradient, and
    register_grad_ready would start the bucket's reduction before W adds the real one. So
    for the rest of this I the weight is out of its DDP's param_to_bucket_group (the hook
    then does nothing); W's gradient fires the hook as a full backward would, once per
    microbatch (Megatron's own deferred wgrad moves the hook to backward_dw likewise)."""
    for buckets in getattr(_capture, "ddp_buckets", ()):
        if weight in buckets:
            _capture.hidden.append((buckets, weight, buckets.pop(weight)))
            return


@functools.lru_cache(maxsize=1)
def _num_forward_inputs() -> int:  # read once: backward of every linear layer asks
    return len(inspect.signature(_linear_function().forward).parameters) - 1  # minus ctx


@contextlib.contextmanager
def deferring_linear_backward():
    """Megatron's linear layers defer their weight-gradient GEMM while this is entered (by a
    split-backward step); once the last such step leaves, the class's own backward is back,
    so nothing outside a step (Megatron's own schedules, a user's backward) ever sees ours."""
    global _patch_users, _original_backward, _original_attribute
    with _patch_lock:
        if _patch_users == 0:
            function = _linear_function()
            _original_attribute = function.__dict__["backward"]
            _original_backward = function.backward
            function.backward = staticmethod(_deferring_backward)
        _patch_users += 1
    try:
        yield
    finally:
        with _patch_lock:
            _patch_users -= 1
            if _patch_users == 0:
                # _original_backward stays set: a thread may be between reading the class's
                # backward (ours) and calling the original
                _linear_function().backward = _original_attribute


# --------------------------------------------------------------------------------------------
# Transformer Engine modules
# --------------------------------------------------------------------------------------------


def follows_te_api(module) -> bool:
    """A module with TE's deferral API (``wgrad_store``, ``need_backward_dw``, ``backward_dw``):
    TE's own modules, Megatron's wrappers of them, and the CPU stand-in of the tests. Megatron's
    own linears have a no-op ``backward_dw`` but no ``wgrad_store``."""
    return (hasattr(module, "wgrad_store") and callable(getattr(module, "backward_dw", None))
            and callable(getattr(module, "need_backward_dw", None)))


def _te_weights(module) -> list:
    """The parameters TE defers: its weights (TE's ``weight_names``; with delay_wgrad_compute
    TE marks exactly these ``skip_backward_post_hook``, the bias keeps the main backward)."""
    names = getattr(module, "weight_names", None)
    if names:
        return [getattr(module, name) for name in names if getattr(module, name, None) is not None]
    return [p for p in module.parameters(recurse=False) if p.dim() >= 2]


def _te_backward_dw(module) -> None:
    """TE's own ``backward_dw``: Megatron's wrappers (TELinear, TELayerNormColumnParallelLinear,
    TEGroupedLinear, ...) run it only when Megatron's config says ``delay_wgrad_compute``,
    which the plugin leaves alone, so their classes are passed over."""
    for cls in type(module).__mro__:
        if "backward_dw" in vars(cls) and not cls.__module__.startswith("megatron."):
            cls.backward_dw(module)
            return
    module.backward_dw()


def _te_cannot_defer(module) -> str | None:
    """Why TE's deferral cannot be switched on for ``module`` (None when it can)."""
    store = getattr(module, "wgrad_store", None)
    if store is None or not callable(getattr(store, "delay_wgrad_compute", None)):
        return "no WeightGradStore (Transformer Engine < 2.3)"
    if getattr(module, "ub_bulk_wgrad", False):
        return "ub_bulk_wgrad (TE refuses delay_wgrad_compute with it)"
    return None


@dataclass
class TEWeightGrad:
    """One TE module's deferred wgrad for one microbatch: what its backward ``put``."""

    module: object
    put: object  # the store's own put
    tensors: list
    func: object
    kind = "te"

    def run(self, split: "WeightGradSplit") -> None:
        module = self.module
        self.put(self.tensors, self.func)  # back into TE's queue: backward_dw pops this one
        if getattr(module, "wgrad_accumulation_and_reduce_hooks", None):
            # DDP built with delay_wgrad_compute registered its hooks with the module: TE
            # calls them itself at the end of backward_dw
            with torch.no_grad():
                _te_backward_dw(module)
            return
        weights = _te_weights(module)
        before = [w.grad for w in weights]
        for w in weights:
            w.grad = None
        with torch.no_grad():  # as in a backward
            _te_backward_dw(module)  # sets w.grad (or, fused, accumulates into main_grad)
        fused = getattr(module, "fuse_wgrad_accumulation", False)
        for w, old in zip(weights, before):
            new, w.grad = w.grad, old  # TE assigns .grad; autograd accumulates it and hooks
            if new is not None:
                _deliver(w, new)
            elif fused and hasattr(w, "main_grad"):
                w.grad_added_to_main_grad = True
                _deliver(w, _dummy_wgrad(w), dummy=True)


class _TESwitch:
    """TE deferral on one module for one step: a delaying store (TE's own class, built as TE
    builds it for ``delay_wgrad_compute=True``) whose ``put`` is captured by the running I."""

    def __init__(self, module):
        self.module = module
        self.original = module.wgrad_store

    def on(self) -> None:
        store = self.original
        if not store.delay_wgrad_compute():
            store = type(store)(True, False)  # WeightGradStore(delay_wgrad_compute, ub_bulk_wgrad)
        own_put = store.put
        module = self.module

        def put(tensor_list, func):
            queue = getattr(_capture, "te_queue", None)
            if queue is None:  # a backward outside the split step's I and B: TE's own queue
                return own_put(tensor_list, func)
            queue.append(TEWeightGrad(module, own_put, tensor_list, func))

        store.put = put
        module.wgrad_store = store

    def off(self) -> None:
        store = self.module.wgrad_store
        if store is not self.original:
            self.module.wgrad_store = self.original
        else:
            vars(store).pop("put", None)


# --------------------------------------------------------------------------------------------
# Per chunk: what can defer
# --------------------------------------------------------------------------------------------


def _plain_name(name: str) -> str:
    """A module or parameter name without the wrappers' ``module.`` prefixes."""
    while name.startswith("module."):
        name = name[len("module."):]
    return name


def _named_layers(layers: list[tuple[str, str]]) -> str:
    """'name (kind)' each, or 'N kind layers (three names, ...)' for a kind with many."""
    by_kind: dict[str, list[str]] = {}
    for name, kind in layers:
        by_kind.setdefault(kind, []).append(name)
    parts = []
    for kind, names in by_kind.items():
        if len(names) <= 3:
            parts.extend(f"{name} ({kind})" for name in names)
        else:
            parts.append(f"{len(names)} layers of {kind} ({', '.join(names[:3])}, ...)")
    return ", ".join(parts)


@dataclass
class _ChunkScan:
    te_modules: list  # modules whose TE deferral can be switched on
    te_weights: list  # their deferred weights
    names: dict  # id(parameter) -> name, for warnings
    undeferred: list  # (name, "module.Class[: why]") of layers W cannot hold
    deferred_numel: int  # elements of the weights W holds
    undeferred_numel: int  # elements of matrix weights computed in I


def _scan(chunk) -> _ChunkScan:
    from megatron.core.tensor_parallel.layers import (
        ColumnParallelLinear,
        RowParallelLinear,
        VocabParallelEmbedding,
    )

    te_modules, te_weights, undeferred = [], [], []
    deferred_numel = undeferred_numel = 0
    names = {id(p): _plain_name(n) for n, p in chunk.named_parameters()}
    for name, module in chunk.named_modules():
        name = _plain_name(name)
        own = [p for p in module.parameters(recurse=False) if p.requires_grad and p.dim() >= 2]
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            deferred_numel += sum(p.numel() for p in own)
            continue
        if isinstance(module, (VocabParallelEmbedding, torch.nn.Embedding)):
            continue  # a lookup: its (cheap, sparse) gradient comes in I, as documented
        if follows_te_api(module):
            reason = _te_cannot_defer(module)
            if reason is None:
                te_modules.append(module)
                weights = _te_weights(module)
                te_weights.extend(weights)
                deferred_numel += sum(p.numel() for p in weights)
                continue
            kind = type(module)
            undeferred.append((name, f"{kind.__module__}.{kind.__name__}: {reason}"))
            undeferred_numel += sum(p.numel() for p in own)
            continue
        if own:
            kind = type(module)
            undeferred.append((name, f"{kind.__module__}.{kind.__name__}"))
            undeferred_numel += sum(p.numel() for p in own)
    return _ChunkScan(te_modules, te_weights, names, undeferred, deferred_numel,
                      undeferred_numel)


# --------------------------------------------------------------------------------------------
# The split
# --------------------------------------------------------------------------------------------


def weight_share_text(held: int, total: int) -> str:
    """``held / total`` as a percentage that reads 100% only when nothing is left out (a MoE
    router's few weights beside the experts' are 99.99%, not 100%) and 0% only when nothing
    is held."""
    share = 100.0 * held / total if total else 0.0
    text = f"{share:.0f}%"
    if text == "100%" and held < total:
        text = f"{math.floor(share * 100) / 100:.2f}%"
    elif text == "0%" and held > 0:
        text = f"{math.ceil(share * 100) / 100:.2f}%"
    return text


class WeightGradSplit:
    """Per-rank queue of deferred weight gradients, keyed by (stage, microbatch)."""

    def __init__(self, model_chunks, schedule_name: str | None = None):
        self.pending: dict[tuple, list] = collections.defaultdict(list)
        self.schedule_name = schedule_name
        self.stats = WeightGradStats()
        # Megatron DDP's {param: bucket group} of each chunk (see _hide_from_ddp)
        self.ddp_buckets = [buckets for buckets in (
            getattr(chunk, "param_to_bucket_group", None) for chunk in model_chunks)
            if isinstance(buckets, dict)]
        # A walk over every module: once per model chunk (remembered on it), not per step.
        for chunk in model_chunks:
            if not hasattr(chunk, _SCANNED):
                setattr(chunk, _SCANNED, _scan(chunk))
        self.scans: list[_ChunkScan] = [getattr(chunk, _SCANNED) for chunk in model_chunks]
        self.te_modules = [scan.te_modules for scan in self.scans]
        self._gather_buffers: dict[tuple, torch.Tensor] = {}
        self._kept: list = []

    # ---------------------------------------------------------------- warnings
    def warn_undeferred(self, extra: list[tuple[str, str]] = ()) -> None:
        """Once per process: the layers whose weight-gradient GEMMs W cannot hold, and what
        the schedule loses. Norms, biases and embedding lookups get their (cheap) weight
        gradients in I, as documented, and are not named."""
        global _warned
        layers = [name for scan in self.scans for name in scan.undeferred] + list(extra)
        if _warned or not layers:
            return
        _warned = True
        held = sum(scan.deferred_numel for scan in self.scans)
        left = sum(scan.undeferred_numel for scan in self.scans)
        share = weight_share_text(held, held + left)
        schedule = f"schedule {self.schedule_name!r}" if self.schedule_name else "the schedule"
        if held == 0:
            loses = (f"W is empty on this rank: {schedule} holds the activations of its "
                     "pending W's (more memory than 1f1b) and gains nothing from the split; "
                     "use 1f1b (or interleaved) for this model")
        elif 100.0 * held / (held + left) < 50.0:
            loses = (f"W holds only {share} of this rank's weight-gradient work (by "
                     f"weight size): {schedule} keeps the memory cost of its pending W's but "
                     "loses most of its bubble gain")
        else:
            loses = (f"W holds {share} of this rank's weight-gradient work (by weight "
                     f"size): {schedule} loses the rest of its bubble gain")
        warnings.warn(
            f"megatron_pp_ext: W defers the weight gradients of {held:,} weights on this "
            f"rank; the I/W split cannot defer those of {_named_layers(layers)} "
            f"({left:,} weights): they are computed in I (full backward), not in W. "
            f"{loses}. "
            "See docs/troubleshooting.md (W holds little or nothing).",
            stacklevel=3)

    # ---------------------------------------------------------------- the step
    @contextlib.contextmanager
    def deferring(self):
        """Enter around the whole step: Megatron's linears defer (see
        deferring_linear_backward) and TE modules get delaying stores; both are undone when
        the step leaves, so a later non-split step (or Megatron's own schedule) runs the
        layers as they were built."""
        self.warn_undeferred()
        switches = [_TESwitch(m) for modules in self.te_modules for m in modules]
        with deferring_linear_backward():
            for switch in switches:
                switch.on()
            try:
                yield
            finally:
                for switch in switches:
                    switch.off()
        if self._kept:
            self._warn_kept()

    def _warn_kept(self) -> None:
        names = {}
        for weight in self._kept:
            for scan in self.scans:
                if id(weight) in scan.names:
                    names[scan.names[id(weight)]] = None
        self._kept = []
        self.warn_undeferred([(name, "a Megatron linear that cannot split here: GTP, "
                               "Megatron-FSDP or the deferred embedding wgrad") for name in names])

    def gather_sequence(self, shard: torch.Tensor, group) -> torch.Tensor:
        """All-gather a sequence-parallel input shard along dim 0 into this rank's reused
        buffer (as Megatron's backward does into its global memory buffer)."""
        shape = (shard.shape[0] * group.size(),) + tuple(shard.shape[1:])
        key = (shape, shard.dtype, shard.device)
        buffer = self._gather_buffers.get(key)
        if buffer is None:
            buffer = self._gather_buffers[key] = torch.empty(shape, dtype=shard.dtype,
                                                             device=shard.device)
        from megatron.core.tensor_parallel.layers import dist_all_gather_func

        dist_all_gather_func(buffer, shard.contiguous(), group=group)
        return buffer

    @contextlib.contextmanager
    def capturing(self, action: Action, defer_linears: bool = True, chunk: int | None = None):
        """While an I (or B) of model chunk ``chunk`` (None: any) runs: Megatron's linears
        queue their weight GEMMs (I only), TE's ``put``s are captured, and the deferred weights
        are out of DDP's buckets (see _hide_from_ddp). Yields the list the tasks land in."""
        queue = self.pending[(action.stage, action.microbatch)] if defer_linears else []
        scans = self.scans if chunk is None else [self.scans[chunk]]
        # TE weights whose DDP hook is on their AccumulateGrad (DDP built without
        # delay_wgrad_compute: the hooks registered with the module fire in backward_dw)
        chunk_te = [w for scan in scans for m in scan.te_modules
                    if not getattr(m, "wgrad_accumulation_and_reduce_hooks", None)
                    for w in _te_weights(m)]
        _capture.queue, _capture.te_queue = queue, queue
        _capture.defer_linears, _capture.kept = defer_linears, self._kept
        _capture.ddp_buckets, _capture.hidden = self.ddp_buckets, []
        for weight in chunk_te:
            _hide_from_ddp(weight)
        try:
            yield queue
        finally:
            te_hidden = {id(w) for w in chunk_te}
            for buckets, weight, group in _capture.hidden:
                buckets[weight] = group
                if id(weight) in te_hidden and weight.grad is not None:
                    # TE's I hands a hidden weight a dummy (fused) or nothing; W delivers
                    # the real one, so none is held from I to W
                    weight.grad = None
            _capture.queue = _capture.te_queue = None
            _capture.defer_linears, _capture.kept = False, []
            _capture.ddp_buckets, _capture.hidden = (), []

    def backward_input(self, action: Action, input_tensor, output, output_grad, config,
                       chunk: int | None = None):
        from megatron.core.pipeline_parallel.schedules import backward_step

        with self.input_gradient(action, chunk=chunk):
            return backward_step(input_tensor, output, output_grad, config)

    @contextlib.contextmanager
    def input_gradient(self, action: Action, chunk: int | None = None):
        """Enter around whatever computes I ``action``'s backward (Megatron's backward_step,
        or its combined F&B step): the linears' weight GEMMs queue for the W, counted."""
        # On the calling thread: the capture is thread-local, and autograd would run a CUDA
        # backward on its device threads, where no W task would be queued.
        kept = len(self._kept)
        with self.capturing(action, chunk=chunk) as queue, \
                torch.autograd.set_multithreading_enabled(False):
            before = len(queue)
            yield
        self.stats.deferred += len(queue) - before
        self.stats.by_kind.update(task.kind for task in queue[before:])
        self.stats.kept_in_i += len(self._kept) - kept

    def backward_full(self, action: Action, input_tensor, output, output_grad, config,
                      chunk: int | None = None):
        """A full B inside a split step (DualPipeV has some): Megatron's linears compute their
        weight gradients as always; TE modules, switched to deferring for the step, get
        theirs at once after the backward."""
        from megatron.core.pipeline_parallel.schedules import backward_step

        with self.full_gradient(action, chunk=chunk):
            return backward_step(input_tensor, output, output_grad, config)

    @contextlib.contextmanager
    def full_gradient(self, action: Action, chunk: int | None = None):
        """Enter around whatever computes a full B ``action`` inside a split step: TE modules'
        weight gradients (deferred for the step) run right after it."""
        if not any(self.te_modules):
            yield
            return
        with self.capturing(action, defer_linears=False, chunk=chunk) as queue, \
                torch.autograd.set_multithreading_enabled(False):
            yield
        for task in queue:
            task.run(self)
        self.stats.in_b += len(queue)

    def backward_weight(self, action: Action, chunk: int | None = None) -> None:
        tasks = self.pending.pop((action.stage, action.microbatch), [])
        start = time.perf_counter()
        linear_results = []  # delivered together: a weight used twice gets one sum
        for task in tasks:
            if isinstance(task, LinearWeightGrad):
                linear_results.append((task.weight, task.compute(self)))
            else:
                task.run(self)
        deliver_linear_wgrads(linear_results)
        self.stats.w_seconds += time.perf_counter() - start
        self.stats.in_w += len(tasks)

    def held_tensors(self) -> list:
        """The activation tensors the pending W tasks hold (a linear's input and output
        gradient; TE's stored tensors), not the weights or main_grad buffers they write to:
        the W queue's part of the activation memory (``runtime.memory``)."""
        held = []
        for tasks in self.pending.values():
            for task in tasks:
                if isinstance(task, LinearWeightGrad):
                    held += [task.input, task.grad_output]
                else:
                    held += [t for t in getattr(task, "tensors", None) or ()
                             if isinstance(t, torch.Tensor)
                             and not isinstance(t, torch.nn.Parameter)]
        return held

    def held_bytes(self) -> int:
        """Bytes of the unique storages of :meth:`held_tensors`."""

        return unique_bytes(self.held_tensors())

    def assert_drained(self) -> None:
        left = sorted(key for key, tasks in self.pending.items() if tasks)
        assert not left, f"W queue not empty at the end of the step: (stage, microbatch) {left}"
