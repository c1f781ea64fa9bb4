"""Data for dualpipe's two directions: each chunk reads the microbatches of its own direction.

Megatron hands every model chunk an iterator over the step's microbatches (one per chunk, or
one shared), and a chunk that reads data calls ``next`` once per forward. Under dualpipe rank
r's chunk 0 runs the first direction (microbatches 0..m0-1) and its chunk 1 the second
(m0..m-1), so a plain ``next`` would feed chunk 1 the first direction's data. Here each
chunk's iterator is a :class:`DirectionIterator` that serves the batch of the microbatch being
computed: the underlying iterator is read in order, the batches this rank's chunks will take
are kept until taken, the others dropped as read; at the end of the step an iterator that was
read at all is read up to m batches, so every step starts where 1F1B's would. An iterator that
is never read (a middle stage whose ``get_batch`` reads nothing) stays where it was.
"""

from __future__ import annotations

from ..ir import Schedule


class _StepBatches:
    """One underlying iterator's batches of one step."""

    def __init__(self, iterator, num_microbatches: int, wanted: set[int]):
        self.iterator, self.num_microbatches, self.wanted = iterator, num_microbatches, wanted
        self.read = 0
        self.kept: dict[int, object] = {}

    def take(self, microbatch: int):
        while self.read <= microbatch:
            batch = next(self.iterator)
            if self.read in self.wanted:
                self.kept[self.read] = batch
            self.read += 1
        try:
            return self.kept.pop(microbatch)
        except KeyError:
            raise RuntimeError(
                f"microbatch {microbatch}'s batch was read twice on this rank: a chunk's "
                "forward step called next() more than once per microbatch") from None

    def finish(self) -> None:
        if not self.read:
            return
        while self.read < self.num_microbatches:
            try:
                next(self.iterator)
            except StopIteration:
                break
            self.read += 1


class DirectionIterator:
    """What one chunk's forward step reads: the batch of ``microbatch`` (set before each F)."""

    def __init__(self, batches: _StepBatches):
        self.batches = batches
        self.microbatch: int | None = None

    def __iter__(self):
        return self

    def __next__(self):
        if self.microbatch is None:
            raise RuntimeError("DirectionIterator read outside a forward (no microbatch set)")
        microbatch, self.microbatch = self.microbatch, None
        return self.batches.take(microbatch)


def direction_iterators(schedule: Schedule, rank: int, iterators: list) -> tuple[list, list]:
    """``(the chunks' iterators, the step's batch readers)`` for a dualpipe schedule; call
    :func:`finish_step` with the readers after the step. Any other schedule: unchanged."""
    if schedule.second_direction_from is None:
        return iterators, []
    stages = schedule.stages_of(rank)
    wanted: dict[int, set[int]] = {}
    for stage, iterator in zip(stages, iterators):
        if iterator is not None:
            wanted.setdefault(id(iterator), set()).update(
                mb for mb in range(schedule.num_microbatches) if stage in schedule.path(mb))
    readers: dict[int, _StepBatches] = {}
    out = []
    for iterator in iterators:
        if iterator is None:
            out.append(None)
            continue
        reader = readers.get(id(iterator))
        if reader is None:
            reader = readers[id(iterator)] = _StepBatches(
                iterator, schedule.num_microbatches, wanted[id(iterator)])
        out.append(DirectionIterator(reader))
    return out, list(readers.values())


def select_microbatch(iterator, microbatch: int) -> None:
    """Before a forward: the chunk's iterator serves ``microbatch`` (a no-op on any other)."""
    if isinstance(iterator, DirectionIterator):
        iterator.microbatch = microbatch


def finish_step(readers: list) -> None:
    for reader in readers:
        reader.finish()
