"""Costly results built once per test run, whichever pytest-xdist worker asks first.

    runs = once("memory_train-runs", lambda: build_the_runs())

A module fixture is built once per worker that runs one of its tests, and again after another
module's test ran in between; the suite's workers are dealt tests one by one, so a module's
tests may land on both. ``once`` keeps the result in the run's shared folder (``conftest.py``
makes it, named by xdist's run id, and removes it): the first caller builds it holding a file
lock, the others wait for the lock and read it back. A build that raises leaves nothing, so the
next caller builds it again (and fails the same way, in its own test)."""

from __future__ import annotations

import fcntl
import os
import pickle
import time
from pathlib import Path
from typing import Callable, TypeVar

SHARED_ENV = "MEGATRON_PP_TEST_SHARED"
WAIT_S = 900.0  # longer than any build (each has its own timeouts): a stuck lock fails loudly

T = TypeVar("T")


def shared_folder() -> Path:
    return Path(os.environ[SHARED_ENV])


def once(name: str, build: Callable[[], T]) -> T:
    """``build()``'s result, built once per test run (``name``: a file name, unique per result)."""
    folder = shared_folder()
    result = folder / f"{name}.pickle"
    with open(folder / f"{name}.lock", "w") as lock:
        deadline = time.monotonic() + WAIT_S
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{name}: another test worker held its lock for "
                                       f"{WAIT_S:.0f} s while building it") from None
                time.sleep(0.2)
        if result.exists():
            return pickle.loads(result.read_bytes())
        value = build()
        result.write_bytes(pickle.dumps(value))
        return value
