"""The one place that touches torch.cuda: which device the pipeline's tensors live on.

Everything else asks this module, so the same code runs on the CPU with gloo and on GPUs
with NCCL.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def cuda_available() -> bool:
    return torch.cuda.is_available()


def backend_of(group=None) -> str:
    if not (dist.is_available() and dist.is_initialized()):
        return "none"
    return str(dist.get_backend(group)).lower()


def comm_device(group=None) -> torch.device:
    """Device of the tensors exchanged over ``group``: the current GPU under NCCL, else CPU."""
    if backend_of(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def waits_block_host(group=None) -> bool:
    """gloo's Work.wait() blocks the host with a timeout; NCCL's only orders streams, so
    NCCL waits are polled with is_completed() to honour a host-side timeout."""
    return backend_of(group) != "nccl"


def launcher_backend() -> str:
    """The process-group backend for ranks started by a launcher (torchrun, srun): NCCL where
    this process sees a GPU and torch has NCCL, else gloo (the CPU)."""
    if torch.cuda.is_available() and dist.is_available() and dist.is_nccl_available():
        return "nccl"
    return "gloo"


def bind_local_device(local_rank: int, backend: str) -> torch.device:
    """Under NCCL, make GPU ``local_rank`` (modulo the GPUs this process sees) the current one
    and return it; under any other backend, the CPU. Call before init_process_group."""
    if backend != "nccl":
        return torch.device("cpu")
    index = local_rank % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def start_memory_probe(device: torch.device) -> int | None:
    """Start measuring a step's peak memory on a GPU (None on the CPU)."""
    if device.type != "cuda":
        return None
    torch.cuda.reset_peak_memory_stats(device)
    return int(torch.cuda.memory_allocated(device))


def finish_memory_probe(device: torch.device, start: int | None,
                        peak_held: int) -> tuple[float, float] | None:
    """(bytes free for activations now, bytes one held activation took during the step)."""
    if start is None:
        return None
    grown = max(0, torch.cuda.max_memory_allocated(device) - start)
    free, _total = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return float(free + cached), grown / max(1, peak_held)
