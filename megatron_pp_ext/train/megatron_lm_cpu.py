"""Megatron-LM's training loop (``megatron.training.pretrain``, ``pretrain_gpt.py``) on the CPU
with gloo: the patches it needs where it assumes CUDA, each with its reason (``_patch_table``).

Applied only in a rank process that runs on the CPU (``verify`` without a launcher, the tests);
the plugin's runtime needs none of them, and on GPUs none is applied. Megatron-Core's own CPU
shims (``cpu_shims``: the model code's) come first.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch

from .cpu_shims import NullEvent, NullStream, _CpuTorchProxy, _on_cpu, apply_cpu_shims



def _cpu_tensor_cuda(self, device=None, non_blocking=False, **kwargs):
    return self


_CUDA_TYPE_NAMES = {
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
}
_tensor_type = torch.Tensor.type


def _cuda_named_type(self, dtype=None, non_blocking=False, **kwargs):
    if dtype is None and not kwargs:
        name = _tensor_type(self)
        return _CUDA_TYPE_NAMES.get(name, name)
    return _tensor_type(self, dtype, non_blocking, **kwargs)


def _patch_table() -> list[tuple[Any, str, Any, str]]:
    """(owner, attribute, replacement, why): the CPU patches Megatron-LM's loop needs."""
    from megatron.core.datasets import utils as dataset_utils
    from megatron.core.tensor_parallel import random as tensor_parallel_random
    from megatron.core.transformer import utils as transformer_utils
    from megatron.core.transformer.moe import moe_utils, token_dispatcher
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.training import arguments, initialize, training


    init = functools.partial(training.initialize_megatron, allow_no_cuda=True)
    return [
        (training, "initialize_megatron", init,
         "pretrain() calls initialize_megatron() without allow_no_cuda: it asserts CUDA"),
        (initialize, "torch", _TorchWithOneDevice(),
         "initialize sees torch.cuda.device_count() == 0 and then skips initialize_model_parallel"),
        (training, "set_jit_fusion_options", lambda *a, **k: None,
         "set_jit_fusion_options warms up fused kernels on CUDA tensors"),
        (torch, "tensor", _on_cpu(torch.tensor),
         "the loop, the rerun state machine and the loss reporting make flags, timestamps and "
         "counters with torch.tensor(..., device='cuda')"),
        (torch.Tensor, "cuda", _cpu_tensor_cuda,
         "get_model moves each model chunk with .cuda(current_device), i.e. Tensor.cuda('cpu')"),
        (torch.cuda, "Stream", lambda *a, **k: NullStream(),
         "get_model builds DDP on a side CUDA stream (a CPU stand-in)"),
        (torch.cuda, "Event", lambda *a, **k: NullEvent(),
         "Megatron's combined 1F1B (--overlap-moe-expert-parallel-comm) orders its compute and "
         "communication streams with CUDA events; on the CPU one thread runs both in order"),
        (torch.cuda, "stream", lambda stream=None: NullStream(),
         "the combined 1F1B's nodes run under torch.cuda.stream(their stream)"),
        (torch.Tensor, "record_stream", lambda self, stream: None,
         "the combined 1F1B's nodes tell the CUDA caching allocator which stream used a "
         "tensor before freeing it; the CPU has no such allocator"),
        (torch.Tensor, "type", _cuda_named_type,
         "clip_grads and the distributed optimizer assert torch.cuda.* tensor type names"),
        (dataset_utils, "compile_helpers", lambda: None,
         "initialize runs `make` in the wheel's datasets folder, which ships helpers_cpp prebuilt "
         "and no Makefile"),
        (torch.cuda, "get_rng_state", lambda *a, **k: torch.empty(0, dtype=torch.uint8),
         "the rerun state machine saves the CUDA RNG state every step (no CUDA RNG here)"),
        (token_dispatcher, "maybe_move_tensor_to_cpu", _host_copy,
         "the MoE alltoall dispatcher turns its split sizes into host (numpy) arrays only for "
         "CUDA tensors; on the CPU they stay tensors, which all_to_all_single refuses"),
        (transformer_utils, "torch", _CpuTorchProxy(),
         "get_default_causal_mask (a chunk given no attention mask: pretrain_gpt.py's get_batch "
         "reads none on a middle stage) makes it with torch.ones(..., device='cuda')"),
        (moe_utils, "torch", _CpuTorchProxy(),
         "0.17's track_moe_metrics (training_log) makes the tracker of a rank without MoE "
         "layers with torch.zeros(..., device='cuda')"),
        (tensor_parallel_random, "_get_cuda_rng_state",
         lambda *a, **k: torch.empty(0, dtype=torch.uint8),
         "activation recompute (--recompute-granularity) saves the CUDA RNG state with each "
         "checkpointed forward (no CUDA RNG here; the CPU's is saved beside it)"),
        (tensor_parallel_random, "_set_cuda_rng_state", lambda *a, **k: None,
         "and puts it back before the recomputed forward"),
        (arguments, "get_device_arch_version", lambda: 9,
         "validate_args asks the GPU's architecture under tensor parallelism (there is no GPU: "
         "an H100's, 9, whose rule is CUDA_DEVICE_MAX_CONNECTIONS=1, as users set it)"),
        (WrappedTorchNorm, "__new__", staticmethod(_sequence_parallel_norm(
            WrappedTorchNorm.__new__)),
         "without apex and TE the local spec's norm is WrappedTorchNorm, which refuses "
         "--sequence-parallel; apex's FusedLayerNorm (GPU-only) takes it and marks its "
         "parameters sequence_parallel, so finalize_model_grads all-reduces their gradients "
         "over TP: the same torch norm, marked so"),
        *_adam_checkpoint_patches(),
    ]


def _sequence_parallel_norm(wrapped_torch_norm_new):
    """``WrappedTorchNorm.__new__`` that builds the torch norm under --sequence-parallel too,
    its parameters marked ``sequence_parallel`` as apex's and TE's norms mark theirs."""

    def new(cls, config, hidden_size, eps=1e-5, **kwargs):
        if not config.sequence_parallel:
            return wrapped_torch_norm_new(cls, config, hidden_size, eps, **kwargs)
        config.sequence_parallel = False  # only while its assert reads it
        try:
            norm = wrapped_torch_norm_new(cls, config, hidden_size, eps, **kwargs)
        finally:
            config.sequence_parallel = True
        for param in norm.parameters():
            param.sequence_parallel = True
        return norm

    return new


def _host_copy(tensor, as_numpy=False, record_stream=False):
    """moe_utils.maybe_move_tensor_to_cpu as the GPU sees it: the host copy, as numpy if asked."""
    if torch.is_tensor(tensor) and as_numpy:
        return tensor.numpy()
    return tensor


def _adam_checkpoint_patches() -> list[tuple[Any, str, Any, str]]:
    """What Megatron's checkpointing (``--save``/``--load``, the default torch_dist format with
    the distributed optimizer) needs on the CPU: Megatron-Core 0.19.2's Adam fallback without
    apex and Transformer Engine (on GPUs TE's FusedAdam keeps the step in the param groups and
    neither arises)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return [
        (DistributedOptimizer, "state_dict", _state_dict_of_a_fresh_optimizer(
            DistributedOptimizer.state_dict),
         "without apex/TE, state_dict() reads Adam's step from the per-parameter state, which "
         "an optimizer built to load a checkpoint does not have yet (assert len(steps) == 1)"),
        (DistributedOptimizer, "load_state_dict", _with_the_loaded_step(
            DistributedOptimizer.load_state_dict),
         "without apex/TE, the dp_reshardable parameter state copies the load template's step "
         "over the loaded one (measured: 0 loaded where 2 was saved), so Adam's bias correction "
         "would restart; the loaded param groups hold the saved step"),
    ]


def _state_dict_of_a_fresh_optimizer(state_dict):
    @functools.wraps(state_dict)
    def patched(self):
        if len(self.optimizer.state) > 0:
            return state_dict(self)
        # A template for loading: step 0 for now; the load puts the saved step in.
        for group in self.optimizer.param_groups:
            for param in group["params"]:
                self.optimizer.state[param] = {"step": torch.tensor(0.0)}
        try:
            return state_dict(self)
        finally:
            self.optimizer.state.clear()

    return patched


def _with_the_loaded_step(load_state_dict):
    @functools.wraps(load_state_dict)
    def patched(self, state_dict):
        load_state_dict(self, state_dict)
        steps = {group.get("step") for group in state_dict["optimizer"]["param_groups"]}
        if len(steps) == 1 and None not in steps:
            step = steps.pop()
            for state in self.optimizer.state.values():
                if "step" in state:  # torch's Adam: one tensor per parameter
                    state["step"] = torch.tensor(float(step), dtype=torch.float32)

    return patched


class _TorchWithOneDevice:
    """``torch`` for megatron.training.initialize: ``torch.cuda.device_count()`` is 1."""

    class _Cuda:
        def __getattr__(self, name):
            return getattr(torch.cuda, name)

        @staticmethod
        def device_count():
            return 1

    cuda = _Cuda()

    def __getattr__(self, name):
        return getattr(torch, name)


_APPLIED: list[tuple[Any, str, Any]] = []


def apply_megatron_lm_cpu_patches() -> None:
    """Megatron-Core's CPU shims (``cpu_shims``), then the loop's own patches above. For a
    rank process on the CPU only (never undone: the process ends with the run)."""
    apply_cpu_shims(force=True)
    if _APPLIED:
        return
    for owner, attr, replacement, _why in _patch_table():
        _APPLIED.append((owner, attr, getattr(owner, attr, None)))
        setattr(owner, attr, replacement)


def prepare_cpu_environment() -> None:
    """The environment Megatron-LM's argument checks ask for, as users set it on GPUs:
    0.17/0.18's validate_args require NCCL_ALGO under --deterministic-mode (0.19 dropped the
    check), and tensor parallelism on a Hopper GPU CUDA_DEVICE_MAX_CONNECTIONS=1; gloo reads
    neither."""
    os.environ.setdefault("NCCL_ALGO", "Ring")
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
