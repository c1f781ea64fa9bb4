"""Activation memory in bytes: what one rank holds for its in-flight microbatches.

The executor counts held activations (``StepResult.peak_activations``: a COUNT of
chunk-activations, +1 at the end of an F, -1 at the end of the B or W that frees it, equal to
the simulator's count by construction). :class:`ActivationMemory` measures the same thing in
BYTES, on the CPU and on a GPU alike:

* **saved tensors**: at the end of every F the executor walks the autograd graph the F built
  (from its output back to the stage's input and the parameters) and reads the tensors each
  node saved for its backward: a built-in node's ``_saved_*`` attributes, a custom
  ``autograd.Function``'s ``saved_tensors`` (Megatron's linears, its activation
  checkpointing). These are the F's activations, attributed to its (stage, microbatch). They
  are released by the action that frees the graph: its B; its I where the I frees the graph
  (Megatron's split: only the W queue keeps what W needs), found after the I by the F's output
  being gone or, where the work still holds it, by walking its graph again (a freed node
  refuses to be read); else its W. Only weak references to the outputs are kept: the
  measurement never keeps a graph alive. Parameters are not activations: an
  ``nn.Parameter``, and any leaf that requires grad and is not a stage input the executor
  received (:meth:`ActivationMemory.note_input`), is never counted.
* **the W queue**: the tensors the pending weight-gradient tasks hold (a linear's input and
  output gradient; TE's stored tensors), from the work's ``held_tensors()``;
* **waiting arrivals**: tensors received before their action needs them (the inbox's stash)
  and tensors handed between two stages of the same rank, waiting for their consumer.

Why a walk and not ``torch.autograd.graph.saved_tensors_hooks``: with hooks installed, every
saved tensor comes back from ``ctx.saved_tensors`` as a NEW tensor object (autograd wraps what
the unpack hook returns), so a saved parameter loses its identity and attributes; Megatron's
linear sets ``weight.grad_added_to_main_grad`` and reads ``weight.main_grad`` on it, and
Megatron DDP's hooks then find a parameter without a gradient (gradient-accumulation fusion
with overlap_grad_reduce fails). The walk reads the same saved tensors and changes nothing.

Bytes are those of unique storages (``untyped_storage().nbytes()``): views of one storage
count once, and a storage shared by a saved tensor, a W task and an arrival counts once. The
executor samples after every action, after every arrival that lands in the stash early and
after every local hand-over; the peak over those samples is ``StepResult.peak_bytes``. The sum
is sampled between actions, as the count is: transient tensors inside an action (the autograd
engine's gradients, a recomputation) are not activations held and are not in it. Tensors a
custom Function keeps as plain ``ctx`` attributes instead of ``save_for_backward`` are not
seen.

Attribution per (stage, microbatch): the bytes of the unique storages one F saved
(``saved_bytes``) calibrate the simulator's count into bytes (:func:`predicted_peak_bytes`).
"""

from __future__ import annotations

import weakref
from typing import Iterable, Mapping

import torch

from ..ir import BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, Schedule


def storage_key_and_bytes(tensor) -> tuple[tuple, int] | None:
    """((device, storage address), storage bytes) of a tensor; None for a non-tensor. A
    tensor without a plain storage (a wrapper subclass) counts its own elements."""
    if not isinstance(tensor, torch.Tensor):
        return None
    try:
        storage = tensor.untyped_storage()
        ptr, nbytes = storage.data_ptr(), storage.nbytes()
    except Exception:  # noqa: BLE001 - subclasses without a storage
        return ("id", id(tensor)), tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return ("empty",), 0
    return (str(tensor.device), ptr), int(nbytes)


def unique_bytes(tensors: Iterable) -> int:
    """Bytes of the unique storages of ``tensors`` (non-tensors ignored)."""
    seen: dict[tuple, int] = {}
    for tensor in _flatten(tensors):
        entry = storage_key_and_bytes(tensor)
        if entry is not None:
            seen[entry[0]] = entry[1]
    return sum(seen.values())


def _flatten(items) -> Iterable:
    for item in items:
        if isinstance(item, torch.Tensor):
            yield item
        elif isinstance(item, (list, tuple)):
            yield from _flatten(item)


_SAVED_ATTRS: dict[type, tuple[str, ...]] = {}  # node type -> its ``_saved_*`` attributes


def _saved_accessors(node) -> tuple[str, ...]:
    kind = type(node)
    names = _SAVED_ATTRS.get(kind)
    if names is None:
        if isinstance(node, torch.autograd.function.BackwardCFunction):
            names = ("saved_tensors",)
        else:
            names = tuple(a for a in dir(node) if a.startswith("_saved_")
                          and not a.endswith(("_sym_sizes", "_sym_strides", "_sym_argsize",
                                              "_sym_storage_offset")))
        _SAVED_ATTRS[kind] = names
    return names


def _read(node, name: str):
    """The tensors ``node`` saved under ``name``; raises RuntimeError once freed."""
    value = getattr(node, name)
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for t in _flatten(value)]
    return []


class ActivationMemory:
    """One rank's activation bytes over one step (see the module docstring)."""

    def __init__(self):
        # storage key -> weak reference to the received stage input (a leaf) it belongs to
        self._inputs: dict[tuple, weakref.ref] = {}
        # (stage, mb) -> {storage key: bytes} of the F's saved tensors still held
        self._held: dict[tuple[int, int], dict[tuple, int]] = {}
        self._outputs: dict[tuple[int, int], list] = {}  # (stage, mb) -> weakrefs to outputs
        self.saved_bytes: dict[tuple[int, int], int] = {}  # (stage, mb) -> bytes its F saved
        self.peak_bytes = 0
        self.peak_parts = {"saved": 0, "w_queue": 0, "waiting": 0}

    def note_input(self, tensor) -> None:
        """A stage input received (or handed over) by the executor: an activation even though
        it is a leaf that requires grad."""
        entry = storage_key_and_bytes(tensor)
        if entry is not None:
            self._inputs[entry[0]] = weakref.ref(tensor)

    def _is_activation(self, tensor: torch.Tensor) -> bool:
        if isinstance(tensor, torch.nn.Parameter):
            return False
        if tensor.is_leaf and tensor.requires_grad:
            entry = storage_key_and_bytes(tensor)
            return entry is not None and self._is_received_input(entry[0])
        return True

    def _is_received_input(self, key: tuple) -> bool:
        """Whether the storage at ``key`` is a received input's. An address alone is not
        enough: once an input is freed, the allocator reuses its address, and a leaf that
        requires grad made later there (PipeDream's weight versions) is not an activation.
        So the input must still be alive and still on that storage."""
        ref = self._inputs.get(key)
        received = ref() if ref is not None else None
        if received is None:
            return False
        current = storage_key_and_bytes(received)
        return current is not None and current[0] == key

    # ------------------------------------------------------------------ attribution
    def record_forward(self, stage: int, microbatch: int, outputs) -> int:
        """Walk the graph of an F's ``outputs``: its saved tensors, attributed to (stage,
        microbatch). Returns their bytes (unique storages)."""
        tensors = [t for t in _flatten([outputs]) if t.grad_fn is not None]
        held = self._walk(tensors)
        self._held[(stage, microbatch)] = held
        self._outputs[(stage, microbatch)] = [weakref.ref(t) for t in tensors]
        total = sum(held.values())
        self.saved_bytes[(stage, microbatch)] = total
        return total

    def _walk(self, tensors) -> dict[tuple, int]:
        """{storage key: bytes} of the activations saved in the graph behind ``tensors``."""
        roots = [t.grad_fn for t in tensors]
        held: dict[tuple, int] = {}
        seen: set[int] = set()
        visited = []  # alive for the walk: a node's Python object (and id) is not reused
        stack = list(roots)
        while stack:
            node = stack.pop()
            if node is None or id(node) in seen:
                continue
            seen.add(id(node))
            visited.append(node)
            for name in _saved_accessors(node):
                try:
                    tensors = _read(node, name)
                except Exception:  # noqa: BLE001 - freed, or modified in place: not held
                    continue
                for tensor in tensors:
                    if self._is_activation(tensor):
                        entry = storage_key_and_bytes(tensor)
                        if entry is not None:
                            held[entry[0]] = entry[1]
            for child, _index in getattr(node, "next_functions", ()):
                if child is not None and id(child) not in seen:
                    stack.append(child)
        return held

    def after_backward(self, stage: int, microbatch: int, kind: str) -> None:
        """After a B or W: the F's saved tensors are released. After an I: those the I freed
        (a graph freed by the backward refuses to be read) are released, the rest stay until
        the W (a graph the work retained)."""
        key = (stage, microbatch)
        if key not in self._held:
            return
        if kind in (BACKWARD, BACKWARD_WEIGHT):
            self._held.pop(key)
            self._outputs.pop(key, None)
            return
        if kind != BACKWARD_INPUT:
            return
        alive = [t for t in (ref() for ref in self._outputs.get(key, ())) if t is not None
                 and t.grad_fn is not None]
        readable = self._walk(alive) if alive else {}
        self._held[key] = {k: b for k, b in self._held[key].items() if k in readable}

    # ------------------------------------------------------------------ sampling
    def sample(self, w_queue: Iterable = (), waiting: Iterable = ()) -> int:
        """Bytes held now (saved tensors, the W queue, waiting arrivals: unique storages);
        updates the peak and its parts."""
        seen: dict[tuple, tuple[int, str]] = {}
        for held in self._held.values():
            for storage, nbytes in held.items():
                seen.setdefault(storage, (nbytes, "saved"))
        for part, tensors in (("w_queue", _flatten(w_queue)), ("waiting", _flatten(waiting))):
            for tensor in tensors:
                entry = storage_key_and_bytes(tensor)
                if entry is not None and entry[0] not in seen:
                    seen[entry[0]] = (entry[1], part)
        total = sum(nbytes for nbytes, _part in seen.values())
        if total > self.peak_bytes:
            self.peak_bytes = total
            parts = {"saved": 0, "w_queue": 0, "waiting": 0}
            for nbytes, part in seen.values():
                parts[part] += nbytes
            self.peak_parts = parts
        return total

    def saved_bytes_per_stage(self) -> dict[int, int]:
        """Bytes one F saved, per stage: the lowest-numbered microbatch's F of each stage."""
        out: dict[int, int] = {}
        for (stage, mb) in sorted(self.saved_bytes):
            out.setdefault(stage, self.saved_bytes[(stage, mb)])
        return out

    def release_all(self) -> None:
        """Drop every reference to the step's graphs (end of the step)."""
        self._held.clear()
        self._outputs.clear()


# ---------------------------------------------------------------------- prediction in bytes
def predicted_peak_bytes(schedule: Schedule, bytes_per_stage: Mapping[int, float]) -> list[int]:
    """Per rank, the simulator's held-activation walk (``schedules.validate.activation_trace``)
    in bytes: + the stage's bytes at the end of an F, - at the end of the B or W that frees
    it. ``bytes_per_stage``: one F's saved bytes for each stage (one chunk: a chunk-activation
    is 1/v of a rank's layers, so each stage brings its own)."""
    peaks = []
    for actions in schedule.actions:
        freed_later = {(a.stage, a.microbatch) for a in actions
                       if a.kind in (BACKWARD, BACKWARD_WEIGHT)}
        held = peak = 0.0
        for action in actions:
            size = float(bytes_per_stage.get(action.stage, 0.0))
            if action.kind == FORWARD and (action.stage, action.microbatch) in freed_later:
                held += size
            elif action.kind in (BACKWARD, BACKWARD_WEIGHT):
                held -= size
            peak = max(peak, held)
        peaks.append(int(round(peak)))
    return peaks
