"""Activation memory in bytes: what one rank holds for its in-flight microbatches.

The executor counts held activations (``StepResult.peak_activations``: a COUNT of
chunk-activations, +1 at the end of an F, -1 at the end of the B or W that frees it, equal to
the simulator's count by construction). :class:`ActivationMemory` measures the same thing in
BYTES, on the CPU and on a GPU alike:

* **saved tensors**: every F (and every B / I, whose recomputations may save tensors for a
  moment) runs inside ``torch.autograd.graph.saved_tensors_hooks``. Each tensor autograd packs
  is wrapped in a small object that the graph holds instead of the tensor; the graph drops it
  when autograd frees the graph (a B, an I that does not retain it, or the W of a retained
  graph), so what is live is exactly what the graphs still hold. Parameters are not
  activations: an ``nn.Parameter``, and any leaf that requires grad and is not one of the
  stage inputs the executor received (noted with :meth:`ActivationMemory.note_input`), is
  passed through unwrapped and never counted.
* **the W queue**: the tensors the pending weight-gradient tasks hold (a linear's input and
  output gradient; TE's stored tensors), from the work's ``held_tensors()``;
* **waiting arrivals**: tensors received before their action needs them (the inbox's stash)
  and tensors handed between two stages of the same rank, waiting for their consumer.

Bytes are those of unique storages (``untyped_storage().nbytes()``), read when sampled: views
of one storage count once, a storage shared by a saved tensor, a W task and an arrival counts
once, and an output that Megatron has pseudo-freed after its send counts as what is left of
it. The executor samples after every action, after every arrival that lands in the stash and
after every local hand-over; the peak over those samples is ``StepResult.peak_bytes``. The
sum is sampled between actions, as the count is: transient tensors inside an action (the
autograd engine's gradients, a recomputation) are not activations held and are not in it.

Attribution per (stage, microbatch): the bytes of the unique storages one F packed, read at
the end of that F (``saved_bytes``), calibrate the simulator's count into bytes
(:func:`predicted_peak_bytes`).
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Iterable, Mapping

import torch

from ..ir import BACKWARD, BACKWARD_WEIGHT, FORWARD, Schedule


class _Saved:
    """What a graph holds instead of a saved tensor; dropped with the graph."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor


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
    for tensor in tensors:
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


class ActivationMemory:
    """One rank's activation bytes over one step (see the module docstring)."""

    def __init__(self):
        self._live: "weakref.WeakSet[_Saved]" = weakref.WeakSet()
        self._inputs: set[tuple] = set()  # storages of received stage inputs (leaves)
        self._packing: list[_Saved] | None = None
        self.saved_bytes: dict[tuple[int, int], int] = {}  # (stage, mb) -> bytes its F saved
        self.peak_bytes = 0
        self.peak_parts = {"saved": 0, "w_queue": 0, "waiting": 0}

    # ------------------------------------------------------------------ packing
    def note_input(self, tensor) -> None:
        """A stage input received (or handed over) by the executor: an activation even though
        it is a leaf that requires grad."""
        entry = storage_key_and_bytes(tensor)
        if entry is not None:
            self._inputs.add(entry[0])

    def _pack(self, tensor):
        if isinstance(tensor, torch.nn.Parameter):
            return tensor
        if tensor.is_leaf and tensor.requires_grad:
            entry = storage_key_and_bytes(tensor)
            if entry is None or entry[0] not in self._inputs:
                return tensor  # a weight (not an nn.Parameter): not an activation
        saved = _Saved(tensor)
        self._live.add(saved)
        if self._packing is not None:
            self._packing.append(saved)
        return saved

    @staticmethod
    def _unpack(saved):
        return saved.tensor if isinstance(saved, _Saved) else saved

    @contextlib.contextmanager
    def packing(self, stage: int | None = None, microbatch: int | None = None):
        """Around an F (``stage`` and ``microbatch`` given: its saved bytes are attributed to
        it) or a B / I (nothing attributed)."""
        record = stage is not None
        outer, self._packing = self._packing, ([] if record else None)
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield
            if record:
                self.saved_bytes[(stage, microbatch)] = unique_bytes(
                    s.tensor for s in self._packing)
        finally:
            self._packing = outer

    # ------------------------------------------------------------------ sampling
    def sample(self, w_queue: Iterable = (), waiting: Iterable = ()) -> int:
        """Bytes held now (saved tensors, the W queue, waiting arrivals: unique storages);
        updates the peak and its parts."""
        seen: dict[tuple, tuple[int, str]] = {}
        for part, tensors in (("saved", [s.tensor for s in list(self._live)]),
                              ("w_queue", _flatten(w_queue)), ("waiting", _flatten(waiting))):
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
        for (stage, mb) in sorted(self.saved_bytes, key=lambda k: (k[0], k[1])):
            out.setdefault(stage, self.saved_bytes[(stage, mb)])
        return out


# ---------------------------------------------------------------------- prediction in bytes
def predicted_peak_bytes(schedule: Schedule, bytes_per_stage: Mapping[int, float]) -> list[int]:
    """Per rank, the simulator's held-activation walk (``analysis.validate.activation_trace``)
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


def format_bytes_iec(value: float | None) -> str:
    """Bytes with a binary unit (B, KiB, MiB, GiB, TiB)."""
    if value is None:
        return "-"
    size = float(value)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(size) < 1024 or unit == "GiB":
            break
        size /= 1024
    else:  # pragma: no cover
        unit = "GiB"
    if unit == "B":
        return f"{int(value)} B"
    return f"{size:.1f} {unit}" if size < 100 else f"{size:.0f} {unit}"


def format_bytes_list(values) -> str:
    return "[" + ", ".join(format_bytes_iec(v) for v in values) + "]"
