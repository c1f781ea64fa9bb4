"""Run every rank of a pipeline as threads of one process over the in-memory transport."""

from __future__ import annotations

import threading
from typing import Callable

from .transport import InMemoryFabric
from .errors import PipelineTimeoutError


def run_ranks_in_threads(world_size: int, rank_fn: Callable[[int, object], object],
                         timeout_s: float = 60.0, fabric=None) -> list:
    """Call ``rank_fn(rank, transport)`` on one thread per rank; return their results.

    ``fabric``: any object with ``transport(rank)`` and an ``abort`` event (default: the
    buffering ``InMemoryFabric``); its ``close()``, if any, is called at the end. If a rank
    fails, its peers are told to stop waiting and the first error is raised.
    """
    fabric = fabric if fabric is not None else InMemoryFabric(world_size)
    try:
        return _run(world_size, rank_fn, timeout_s, fabric)
    finally:
        close = getattr(fabric, "close", None)
        if close is not None:
            close()


def _run(world_size: int, rank_fn, timeout_s: float, fabric) -> list:
    results: list = [None] * world_size
    errors: list = [None] * world_size

    def body(rank: int) -> None:
        try:
            results[rank] = rank_fn(rank, fabric.transport(rank))
        except BaseException as exc:  # noqa: BLE001 - reported to the caller below
            errors[rank] = exc
            fabric.abort.set()

    threads = [threading.Thread(target=body, args=(r,), daemon=True, name=f"pp-rank-{r}")
               for r in range(world_size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout_s)
    if any(thread.is_alive() for thread in threads):
        fabric.abort.set()
        stuck = [r for r, t in enumerate(threads) if t.is_alive()]
        raise TimeoutError(f"ranks {stuck} did not finish within {timeout_s} s")
    # The rank that failed first is the interesting one; the others stopped because of it.
    first = next((e for e in errors if e is not None and not _is_abort(e)), None)
    first = first or next((e for e in errors if e is not None), None)
    if first is not None:
        raise first
    return results


def _is_abort(exc: BaseException) -> bool:
    return isinstance(exc, PipelineTimeoutError)
