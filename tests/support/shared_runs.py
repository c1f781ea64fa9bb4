"""Results of deterministic runs shared by the session's test modules, across pytest-xdist's
workers: a Megatron-LM loop run with the same arguments in two modules (Megatron's own 1F1B as
the reference of the flag tests and of the resume tests, say) is launched once.

``conftest.py`` names a folder for the session in ``SHARED_RUNS_ENV`` before the workers
start; a result is a pickle there named by its key's hash, written whole (``os.replace``), so
a reader sees all of it or nothing. Two workers that need the same result at the same moment
both compute it (nobody waits on anybody); any later caller reads it. Only for runs whose
*returned* results are what the tests read (not their side effects: checkpoints, records)."""

from __future__ import annotations

import hashlib
import os
import pickle
from pathlib import Path
from typing import Callable, TypeVar

#: environment variable naming the session's folder of shared results (conftest.py sets it)
SHARED_RUNS_ENV = "MEGATRON_PP_TEST_SHARED_RUNS"

T = TypeVar("T")


def computed_once(key: tuple, compute: Callable[[], T]) -> T:
    """``compute()``'s result for ``key`` (a tuple whose ``repr`` names every input that
    decides the result), computed at most once a session where the folder is set."""
    named = repr(key)
    if " at 0x" in named:  # another process may hold another object at that address
        raise ValueError(f"computed_once: the key {named[:300]} names an object by its memory "
                         "address, which does not identify it across workers; key by the "
                         "values that decide the result (numbers, strings, tuples)")
    folder = os.environ.get(SHARED_RUNS_ENV)
    if not folder:
        return compute()
    path = Path(folder) / f"{hashlib.sha256(named.encode()).hexdigest()}.pickle"
    if path.exists():
        return pickle.loads(path.read_bytes())
    result = compute()
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
    partial.write_bytes(pickle.dumps(result))
    os.replace(partial, path)
    return result
