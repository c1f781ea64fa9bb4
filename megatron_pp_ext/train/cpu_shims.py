"""CPU shims that let Megatron-Core's *model code* and Megatron-Core's *own schedules* run on a
machine without a GPU (torch.distributed with the gloo backend).

The CPU backend of the ``train`` command (and of the tests, which import it from here): applied
only by ``train.processes.init_megatron`` on a machine without a GPU. The plugin's own schedule
path (``megatron_pp_ext.runtime``, ``megatron_pp_ext.integration``) never imports it
(``tests/test_layout.py`` checks). This file and
``megatron_pp_ext/device.py`` are the only places in the package that touch ``torch.cuda``.

Every shim is applied only when ``torch.cuda.is_available()`` is False, is idempotent, and is
undone by :func:`remove_cpu_shims` (or on leaving :func:`cpu_shims`). One shim per line of
``_SHIMS`` below, each with the reason it is needed (Megatron-Core 0.19.2):

* ``torch.cuda.current_device`` -> ``"cpu"``: Megatron allocates on "the current device" all over
  the exercised paths: the attention's global memory buffer, P2PCommunicator's receive buffers,
  DDP's grad buffers, RoPE's inv_freq. Returning the string ``"cpu"`` makes every
  ``device=torch.cuda.current_device()`` a CPU allocation.
* ``torch.cuda.synchronize`` -> no-op: P2PCommunicator calls it after ``batch_isend_irecv``
  (``batch_p2p_sync=True`` is the default) and when exchanging shapes.
* ``torch.cuda.current_stream`` -> a do-nothing stream: DDP's bucket group calls
  ``torch.cuda.current_stream()`` in ``start_grad_sync`` (to wait on CUDA-graph events).
* ``CudaRNGStatesTracker.add`` / ``.fork`` -> the same bookkeeping on the *CPU* generator:
  ``add`` reads/sets the CUDA RNG state (needs a driver, so ``model_parallel_cuda_manual_seed``
  fails without one); ``fork`` swaps CUDA RNG states (dropout, GPU weight init). On the CPU the
  named states are CPU generator states, forked exactly like the CUDA ones would be.
* ``megatron.core.pipeline_parallel.schedules.torch`` -> a proxy of ``torch``: the three schedule
  functions hard-code ``torch.zeros([], dtype=torch.int, device="cuda")`` for
  ``total_num_tokens``. The proxy maps ``device="cuda"`` to the CPU for tensor factories, for
  that module only; every other attribute is the real ``torch``.
* the same proxy for Megatron's optimizer (``megatron.core.optimizer.optimizer``: the FP32
  optimizer's loss scale), ``clip_grads`` (the grad-norm accumulator and overflow buffer) and
  ``megatron.core.utils`` (``local_multi_tensor_l2_norm``'s result), which also allocate with
  ``device='cuda'``. Gradient clipping itself cannot run on the CPU
  (``clip_grad_by_total_norm_fp32`` asserts CUDA gradients): CPU runs use ``clip_grad=0``.
"""

from __future__ import annotations

import contextlib
import threading
import types
from typing import Any, Callable, Iterator

import torch

from .. import device as device_helper
from .. import megatron_compat

__all__ = ["apply_cpu_shims", "remove_cpu_shims", "cpu_shims", "shims_active", "needs_cpu_shims"]

_LOCK = threading.Lock()
# (owner object, attribute name, original value) for every attribute we replaced.
_ORIGINALS: list[tuple[Any, str, Any]] = []


def needs_cpu_shims() -> bool:
    """True when there is no usable GPU, i.e. when the shims would be applied."""
    return not device_helper.cuda_available()


def shims_active() -> bool:
    """True while the shims are applied."""
    return bool(_ORIGINALS)


# --------------------------------------------------------------------------------------------
# The replacements
# --------------------------------------------------------------------------------------------


def _current_device() -> str:
    return "cpu"


def _synchronize(device: Any = None) -> None:
    return None


class NullEvent:
    """Stands in for a ``torch.cuda.Event`` a stream recorded on the CPU: already complete
    (Megatron's MoE token dispatcher synchronizes on the event of its device-to-host copies)."""

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True

    def wait(self, stream: Any = None) -> None:
        return None

    def record(self, stream: Any = None) -> None:
        return None


class NullStream:
    """Stands in for ``torch.cuda.Stream`` on the CPU: every wait is already satisfied; as a
    context (``with torch.cuda.stream(s)``) it changes nothing."""

    device = torch.device("cpu")

    def __enter__(self) -> "NullStream":
        return self

    def __exit__(self, *exc: Any) -> bool:
        return False

    def wait_event(self, event: Any) -> None:
        return None

    def wait_stream(self, stream: Any) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True

    def record_event(self, event: Any = None) -> Any:
        return NullEvent() if event is None else event


def _current_stream(device: Any = None) -> NullStream:
    return NullStream()


def _cpu_tracker_add(self, name: str, seed: int) -> None:
    """CudaRNGStatesTracker.add on the CPU: same checks, a CPU generator state per name."""
    self._is_initialized = True
    if seed in self.seeds_:
        raise Exception("seed {} already exists".format(seed))
    self.seeds_.add(seed)
    if name in self.states_:
        raise Exception("cuda rng state {} already exists".format(name))
    self.states_[name] = torch.Generator(device="cpu").manual_seed(int(seed)).get_state()


@contextlib.contextmanager
def _cpu_tracker_fork(self, name: str | None = None) -> Iterator[None]:
    """CudaRNGStatesTracker.fork on the CPU: run the body on the named CPU RNG state, save the
    advanced state back under that name, and restore the caller's CPU RNG state."""
    if name is None:
        name = megatron_compat.model_parallel_rng_tracker_name()
    if name not in self.states_:
        raise Exception("cuda rng state {} is not added".format(name))
    orig_state = torch.get_rng_state()
    orig_name = self._current_state_name
    torch.set_rng_state(self.states_[name])
    self._current_state_name = name
    try:
        yield
    finally:
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(orig_state)
        self._current_state_name = orig_name


def _cpu_device(device: Any) -> Any:
    """Map a CUDA device spec ("cuda", "cuda:0", torch.device("cuda"), an int) to the CPU."""
    if device is None:
        return None
    if isinstance(device, int) and not isinstance(device, bool):
        return "cpu"
    if isinstance(device, str) and device.startswith("cuda"):
        return "cpu"
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    return device


def _on_cpu(factory: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    def wrapper(*args: Any, **kwargs: Any) -> torch.Tensor:
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        return factory(*args, **kwargs)

    wrapper.__name__ = getattr(factory, "__name__", "factory")
    wrapper.__doc__ = factory.__doc__
    return wrapper


class _CpuTorchProxy(types.ModuleType):
    """``torch`` as seen by Megatron's schedules module: tensor factories put ``device="cuda"``
    on the CPU; every other attribute is looked up on the real ``torch``."""

    _FACTORIES = ("zeros", "ones", "empty", "full", "tensor")

    def __init__(self) -> None:
        super().__init__("torch")
        for name in self._FACTORIES:
            setattr(self, name, _on_cpu(getattr(torch, name)))

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


# --------------------------------------------------------------------------------------------
# apply / remove
# --------------------------------------------------------------------------------------------


def _shim_table() -> list[tuple[Any, str, Any]]:
    """(owner, attribute, replacement): one shim per line; the reasons are in the module doc."""
    from megatron.core import utils as megatron_utils
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer import optimizer as megatron_optimizer
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.tensor_parallel import random as mp_random

    return [
        # CPU buffers wherever Megatron allocates on "the current device":
        (torch.cuda, "current_device", _current_device),
        # P2PCommunicator synchronizes after batch_isend_irecv:
        (torch.cuda, "synchronize", _synchronize),
        # DDP's bucket groups wait on the current stream for CUDA-graph events:
        (torch.cuda, "current_stream", _current_stream),
        # model_parallel_cuda_manual_seed adds states by reading the CUDA RNG:
        (mp_random.CudaRNGStatesTracker, "add", _cpu_tracker_add),
        # dropout and GPU weight init fork the CUDA RNG:
        (mp_random.CudaRNGStatesTracker, "fork", _cpu_tracker_fork),
        # the schedules hard-code torch.zeros([], dtype=torch.int, device="cuda"):
        (schedules, "torch", _CpuTorchProxy()),
        # Megatron's optimizer: the FP32 optimizer's loss scale, the grad norm's buffers and
        # local_multi_tensor_l2_norm's result are made with device="cuda":
        (megatron_optimizer, "torch", _CpuTorchProxy()),
        (clip_grads, "torch", _CpuTorchProxy()),
        (megatron_utils, "torch", _CpuTorchProxy()),
    ]


def apply_cpu_shims(force: bool = False) -> bool:
    """Apply the CPU shims if there is no GPU (or ``force``). Idempotent.

    Returns True if the shims are active after the call."""
    with _LOCK:
        if _ORIGINALS:
            return True
        if not force and not needs_cpu_shims():
            return False
        for owner, attr, replacement in _shim_table():
            _ORIGINALS.append((owner, attr, owner.__dict__.get(attr, _MISSING)))
            setattr(owner, attr, replacement)
        return True


def remove_cpu_shims() -> None:
    """Undo :func:`apply_cpu_shims`. Idempotent."""
    with _LOCK:
        while _ORIGINALS:
            owner, attr, original = _ORIGINALS.pop()
            if original is _MISSING:
                delattr(owner, attr)
            else:
                setattr(owner, attr, original)


@contextlib.contextmanager
def cpu_shims(force: bool = False) -> Iterator[bool]:
    """Context manager: the shims are active inside (if they apply); restored on exit when this
    call applied them. Yields whether the shims are active."""
    already = shims_active()
    active = apply_cpu_shims(force=force)
    try:
        yield active
    finally:
        if active and not already:
            remove_cpu_shims()


class _Missing:
    def __repr__(self) -> str:
        return "<missing>"


_MISSING = _Missing()
