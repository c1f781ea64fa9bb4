"""Megatron's optimizer on the CPU (Megatron-Core 0.19.2), for the train command's gloo runs.

``get_megatron_optimizer`` with fp32 params returns a ``ChainedOptimizer`` of ``FP32Optimizer``
(torch's AdamW inside when neither Transformer Engine nor apex is installed). It runs on the
CPU except where it allocates with a hard-coded ``device='cuda'``:

* ``FP32Optimizer.__init__``: its loss scale, ``torch.tensor([1.0], device='cuda')``;
* ``clip_grads.get_grad_norm_fp32`` (every ``step()`` computes the grad norm): its accumulator
  and the multi-tensor overflow buffer;
* ``megatron.core.utils.local_multi_tensor_l2_norm`` (the norm's kernel without apex): its
  result.

:func:`apply_cpu_optimizer_shims` lets those three modules see ``torch`` through
``demo.cpu_shims``' proxy (tensor factories put ``device="cuda"`` on the CPU; everything else is
the real torch), as ``demo.cpu_shims`` does for Megatron's schedules module. It acts only while
the CPU shims are active, so on GPUs Megatron's optimizer runs untouched.

Gradient clipping is the one thing no shim can make work: ``clip_grad_by_total_norm_fp32``
asserts ``param.grad.type() == 'torch.cuda.FloatTensor'``. CPU runs use ``clip_grad=0`` (the
grad norm is still computed and reported); GPU runs clip at 1.0.
"""

from __future__ import annotations

_REPLACED: list[tuple[object, object]] = []  # (module, its original torch)


def apply_cpu_optimizer_shims() -> bool:
    """Idempotent; returns whether the shims are in place (only with the CPU shims active)."""
    from megatron.core import utils as megatron_utils
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer import optimizer as megatron_optimizer

    from ..demo.cpu_shims import _CpuTorchProxy, shims_active

    if _REPLACED:
        return True
    if not shims_active():
        return False
    for module in (megatron_optimizer, clip_grads, megatron_utils):
        _REPLACED.append((module, module.torch))
        module.torch = _CpuTorchProxy()
    return True


def remove_cpu_optimizer_shims() -> None:
    while _REPLACED:
        module, original = _REPLACED.pop()
        module.torch = original
