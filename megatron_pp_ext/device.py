"""The one place that touches torch.cuda: which device the pipeline's tensors live on.

Everything else asks this module, so the same code runs on the CPU with gloo and on GPUs
with NCCL.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def cuda_available() -> bool:
    return torch.cuda.is_available()


def current_cuda_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


def backend_of(group=None) -> str:
    """The backend that carries the pipeline's tensors over ``group``: "nccl", "gloo", ...

    A group may hold one backend per device type: torch 2.13's ``dist.get_backend`` then
    returns the string it was created with ("cpu:gloo,cuda:nccl"), or "undefined" when
    ``init_process_group`` picked the backends itself. The pipeline's tensors live on the GPU
    where this process sees one, so the GPU's backend is the one that counts there."""
    if not (dist.is_available() and dist.is_initialized()):
        return "none"
    per_device = _backends_by_device(group)
    if len(per_device) == 1:
        return next(iter(per_device.values()))
    wanted = "cuda" if cuda_available() and "cuda" in per_device else "cpu"
    return per_device.get(wanted, next(iter(per_device.values())))


def _backends_by_device(group=None) -> dict[str, str]:
    """{device type: backend} of ``group``; {"*": name} for a plain single-backend name."""
    name = str(dist.get_backend(group)).lower()
    if name == "undefined":  # torch chose: its resolved configuration says which
        name = str(dist.get_backend_config(group)).lower()
    if ":" not in name:
        return {"*": name}
    pairs = (part.split(":", 1) for part in name.split(",") if ":" in part)
    return {device.strip(): backend.strip() for device, backend in pairs}


def comm_device(group=None) -> torch.device:
    """Device of the tensors exchanged over ``group``: the current GPU under NCCL, else CPU."""
    if backend_of(group) == "nccl":
        return current_cuda_device()
    return torch.device("cpu")


def waits_block_host(group=None) -> bool:
    """gloo's Work.wait() blocks the host with a timeout; NCCL's only orders streams, so
    NCCL waits are polled with is_completed() to honour a host-side timeout."""
    return backend_of(group) != "nccl"


def p2p_batched(group=None) -> bool:
    """Whether the pipeline's point-to-point calls take NCCL's code path over ``group``: each
    call one ``batch_isend_irecv`` batch (one Work for all of it), waits polled, no receive
    posted ahead. The transport asks this when it is not told; tests replace it to run
    NCCL's code path over gloo (tests/support/nccl_rules.py)."""
    return backend_of(group) == "nccl"


def group_timeout_s(group=None) -> float | None:
    """The timeout ``group`` was created with (NCCL's watchdog aborts a collective or P2P
    op that runs longer), in seconds; None if torch does not say."""
    try:
        pg = group if group is not None else dist.group.WORLD
        device = torch.device("cuda") if backend_of(group) == "nccl" else torch.device("cpu")
        return float(pg._get_backend(device).options._timeout.total_seconds())
    except Exception:  # noqa: BLE001 - a private API: absent in some torch builds
        return None


def abort_group(group=None) -> bool:
    """NCCL: abort ``group``'s communicators so that no rank stays blocked in an op that will
    never complete (the pipeline gave up). Other backends: nothing (gloo's waits time out and
    a closed connection ends them). Returns whether it aborted."""
    if backend_of(group) != "nccl":
        return False
    try:
        from torch.distributed.distributed_c10d import _abort_process_group

        _abort_process_group(group)
        return True
    except Exception:  # noqa: BLE001 - best effort: the named error is already on its way
        return False


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


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on ``device`` (a GPU's streams; nothing on the CPU): a step's
    end, timed."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def allocator_peak_bytes(device: torch.device) -> int | None:
    """The CUDA caching allocator's peak allocated bytes on ``device`` since the last
    ``start_memory_probe`` (``torch.cuda.max_memory_allocated``); None on the CPU."""
    if device.type != "cuda":
        return None
    return int(torch.cuda.max_memory_allocated(device))


def cuda_rng_state():
    """The default CUDA generator's state (None without CUDA): saved and restored around a
    re-seeded model build (``integration.v_layout_models``)."""
    return torch.cuda.get_rng_state() if torch.cuda.is_available() else None


def set_cuda_rng_state(state) -> None:
    if state is not None:
        torch.cuda.set_rng_state(state)
