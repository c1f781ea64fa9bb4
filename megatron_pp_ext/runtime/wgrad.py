"""The I/W split of the backward for Megatron-Core models.

I runs Megatron's own ``backward_step`` while Megatron's linear layers (ColumnParallelLinear,
RowParallelLinear: everything built on ``LinearWithGradAccumulationAndAsyncCommunication``)
compute only their input gradient and queue their weight-gradient GEMM, keyed by the action's
(stage, microbatch). W pops that queue, runs the GEMMs and hands each result to the weight
through autograd (a view of the weight), so the weight's AccumulateGrad node and the hooks
on it - Megatron DDP's grad-ready / ``main_grad`` hook - fire exactly once per microbatch,
as in a full backward.

Parameters of other modules (layer norms, embeddings, biases, foreign layers) get their
gradients in I, as part of the full backward of those modules: correct, only not deferred;
a one-line warning names the module types affected. Transformer Engine layers built with
``config.delay_wgrad_compute`` defer their own wgrad; W calls their ``backward_dw()`` (GPU
only, import-guarded).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import inspect
import threading
import warnings
from dataclasses import dataclass

import torch

from ..ir import Action

_capture = threading.local()  # .queue: the list the running I appends its W tasks to
_patch_lock = threading.Lock()
_patch_users = 0  # split-backward steps running now (threads of one process may overlap)
_original_backward = None  # the linear layer's own backward, to call where we cannot split
_original_attribute = None  # the class attribute as it was (a staticmethod), to put back
_SCANNED = "_megatron_pp_ext_te_wgrad_modules"  # set on a model chunk once it was scanned


@dataclass
class WeightGradTask:
    weight: torch.Tensor
    total_input: torch.Tensor
    grad_output: torch.Tensor
    fused_into_main_grad: bool

    def run(self) -> None:
        grad_output = self.grad_output.reshape(-1, self.grad_output.shape[-1])
        total_input = self.total_input.reshape(-1, self.total_input.shape[-1])
        grad_weight = grad_output.t().matmul(total_input)
        if self.fused_into_main_grad and hasattr(self.weight, "main_grad"):
            # Megatron's gradient-accumulation fusion: accumulate into main_grad ourselves and
            # let DDP's hook see a grad it must not add again.
            self.weight.main_grad.add_(grad_weight.to(self.weight.main_grad.dtype))
            self.weight.grad_added_to_main_grad = True
            grad_weight = torch.zeros_like(self.weight)
        torch.autograd.backward(self.weight.view_as(self.weight), grad_tensors=grad_weight)


def _linear_function():
    from megatron.core.tensor_parallel.layers import LinearWithGradAccumulationAndAsyncCommunication

    return LinearWithGradAccumulationAndAsyncCommunication


def _deferring_backward(ctx, grad_output):
    """Input gradient now, weight-gradient GEMM queued; the original where we cannot split."""
    queue = getattr(_capture, "queue", None)
    splittable = (queue is not None and not ctx.sequence_parallel
                  and getattr(ctx, "gtp_remat_size", 1) <= 1 and ctx.grad_output_buffer is None)
    if not splittable:
        return _original_backward(ctx, grad_output)
    input_tensor, weight = ctx.saved_tensors
    grad_input = grad_output.matmul(weight)
    if ctx.allreduce_dgrad:
        torch.distributed.all_reduce(grad_input, group=ctx.tp_group)
    grad_bias = None
    if ctx.use_bias:  # summed over the flattened tokens, as Megatron does
        grad_bias = grad_output.reshape(-1, grad_output.shape[-1]).sum(dim=0)
    queue.append(WeightGradTask(weight, input_tensor, grad_output,
                                bool(ctx.gradient_accumulation_fusion)))
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


def _te_delayed_modules(model_chunk) -> list:
    """Transformer Engine modules that defer their own wgrad (GPU only)."""
    return [m for m in model_chunk.modules()
            if hasattr(m, "backward_dw") and getattr(getattr(m, "config", None),
                                                     "delay_wgrad_compute", False)]


class WeightGradSplit:
    """Per-rank queue of deferred weight gradients, keyed by (stage, microbatch)."""

    def __init__(self, model_chunks):
        self.pending: dict[tuple, list[WeightGradTask]] = collections.defaultdict(list)
        # Megatron DDP's {param: bucket group} of each chunk (see _hide_from_ddp)
        self.ddp_buckets = [buckets for buckets in (
            getattr(chunk, "param_to_bucket_group", None) for chunk in model_chunks)
            if isinstance(buckets, dict)]
        # A walk over every module: once per model chunk (remembered on it), not per step.
        fresh = [chunk for chunk in model_chunks if not hasattr(chunk, _SCANNED)]
        for chunk in fresh:
            setattr(chunk, _SCANNED, _te_delayed_modules(chunk))
        if fresh:
            self._warn_undeferred(fresh)
        self.te_modules = [getattr(chunk, _SCANNED) for chunk in model_chunks]

    @staticmethod
    def _warn_undeferred(model_chunks) -> None:
        """Warn once, naming each module with a weight-gradient GEMM the split cannot defer
        (a matrix weight outside Megatron's linear layers and embeddings). Norms, biases and
        embedding lookups get their (cheap) weight gradients in I, as documented."""
        from megatron.core.tensor_parallel.layers import (
            ColumnParallelLinear,
            RowParallelLinear,
            VocabParallelEmbedding,
        )

        expected = (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                    torch.nn.Embedding)
        foreign = []
        for chunk in model_chunks:
            for name, module in chunk.named_modules():
                if isinstance(module, expected) or hasattr(module, "backward_dw"):
                    continue
                if any(p.requires_grad and p.dim() >= 2
                       for p in module.parameters(recurse=False)):
                    kind = type(module)
                    foreign.append(f"{name} ({kind.__module__}.{kind.__name__})")
        if foreign:
            warnings.warn(
                "megatron_pp_ext: I/W split cannot defer the weight gradients of "
                f"{', '.join(foreign)}: they are computed in I (full backward), not in W",
                stacklevel=3)

    def deferring(self):
        """Enter around the whole step: I defers, W computes (see deferring_linear_backward)."""
        return deferring_linear_backward()

    @contextlib.contextmanager
    def capturing(self, action: Action):
        queue = self.pending[(action.stage, action.microbatch)]
        _capture.queue, _capture.ddp_buckets, _capture.hidden = queue, self.ddp_buckets, []
        try:
            yield
        finally:
            for buckets, weight, group in _capture.hidden:
                buckets[weight] = group
            _capture.queue, _capture.ddp_buckets, _capture.hidden = None, (), []

    def backward_input(self, action: Action, input_tensor, output, output_grad, config):
        from megatron.core.pipeline_parallel.schedules import backward_step

        # On the calling thread: the capture is thread-local, and autograd would run a CUDA
        # backward on its device threads, where no W task would be queued.
        with self.capturing(action), torch.autograd.set_multithreading_enabled(False):
            return backward_step(input_tensor, output, output_grad, config)

    def backward_weight(self, action: Action, chunk: int | None = None) -> None:
        for task in self.pending.pop((action.stage, action.microbatch), []):
            task.run()
        if chunk is not None:
            for module in self.te_modules[chunk]:
                module.backward_dw()

    def assert_drained(self) -> None:
        left = sorted(key for key, tasks in self.pending.items() if tasks)
        assert not left, f"W queue not empty at the end of the step: (stage, microbatch) {left}"
