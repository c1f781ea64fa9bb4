"""The one place that touches torch.cuda: which device the pipeline's tensors live on.

Everything else asks this module, so the same code runs on the CPU with gloo and on GPUs
with NCCL.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def backend_of(group=None) -> str:
    if not (dist.is_available() and dist.is_initialized()):
        return "none"
    return str(dist.get_backend(group)).lower()


def comm_device(group=None) -> torch.device:
    """Device of the tensors exchanged over ``group``: the current GPU under NCCL, else CPU."""
    if backend_of(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def device_of_module(module: torch.nn.Module) -> torch.device:
    for param in module.parameters():
        return param.device
    return torch.device("cpu")


def waits_block_host(group=None) -> bool:
    """gloo's Work.wait() blocks the host with a timeout; NCCL's only orders streams, so
    NCCL waits are polled with is_completed() to honour a host-side timeout."""
    return backend_of(group) != "nccl"


def free_device_memory(device: torch.device) -> int | None:
    """Free bytes on a GPU, or None on the CPU."""
    if device.type != "cuda":
        return None
    free, _total = torch.cuda.mem_get_info(device)
    return int(free)
