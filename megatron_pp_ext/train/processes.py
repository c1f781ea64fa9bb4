"""Run a function in ``world_size`` local processes joined by a gloo process group, and set up
Megatron-Core's parallel state inside them.

    results = spawn(4, run_step, "1f1b", pp=4, num_microbatches=8)   # list, one per rank

``fn`` must be picklable by reference (a module-level function). Each rank runs
``fn(rank, world_size, *args, **kwargs)``; its return value comes back to the parent through a
queue. If any rank raises, or the whole run exceeds ``timeout_s``, every rank is stopped and the
parent raises with the failing rank's traceback (or, on a timeout, the ranks that had not
finished; their Python stacks are dumped to stderr first, so a hang shows where it waits).

Processes start from a ``forkserver`` that has already imported torch and Megatron-Core (a
Megatron import costs ~5 s of CPU per process otherwise), so a 4-rank run starts in well under
a second after the first one. Each rank uses one torch thread. Forked ranks cannot initialize
CUDA (torch refuses in a forked child); the demo runs on the CPU anyway (``init_megatron``
forces the CPU shims), and ``start_method="spawn"`` is there for anything that needs a GPU.
"""

from __future__ import annotations

import datetime
import faulthandler
import io
import multiprocessing as mp
import os
import pickle
import queue as queue_mod
import signal
import socket
import sys
import time
import traceback
from typing import Any, Callable, Optional

__all__ = ["spawn", "start_server", "free_port", "host_store", "init_megatron", "destroy",
           "preload", "RankFunction", "SpawnError"]

# Modules the forkserver imports once, so that every rank forks with them already loaded.
_PRELOAD = [
    "torch",
    "megatron_pp_ext.train.preload",  # Megatron without compiling its fusions on a CPU
    "megatron.core.models.gpt",
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.distributed",
    "megatron_pp_ext.models.tiny_gpt",
    # torch.optim's Optimizer.__init__ imports TorchDynamo at its first call (to disable it
    # around itself): once here, not in every rank (~1.2 s of CPU each). After Megatron, so its
    # fusions stay uncompiled (integration/megatron_import.py).
    "torch._dynamo",
    # imported by every rank otherwise: the drop-in (train.loop installs it) and the MIMO model
    # that Megatron's get_megatron_optimizer imports to ask whether the model is one
    "megatron_pp_ext.integration.install",
    "megatron.core.models.mimo.model.base",
]
_CONTEXTS: dict[str, Any] = {}


class SpawnError(RuntimeError):
    """A rank raised, died, or the run timed out. ``rank`` is the first failing rank (or None)."""

    def __init__(self, message: str, rank: Optional[int] = None):
        super().__init__(message)
        self.rank = rank


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (another process may take it before
    it is used: for ranks, prefer ``host_store``, which never races)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def host_store(timeout_s: float):
    """The ranks' rendezvous store, served on a port the kernel picks as it binds: no window in
    which another process can take the port (a port found free and bound later by rank 0 can
    be, under load: EADDRINUSE), and the store outlives a rank that dies. Served by this
    process where torch is loaded already (the tests); else by a process forked from the
    forkserver, which has loaded it (``train``'s command process never imports torch: ~5 s of
    CPU on a small machine). Keep the returned store alive while the ranks run; ``.port``,
    ``close()``."""
    if "torch" in sys.modules:
        return _LocalStore(timeout_s)
    return _StoreProcess(timeout_s)


def _tcp_store(timeout_s: float):
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, None, True,
                         timeout=datetime.timedelta(seconds=max(1.0, float(timeout_s))),
                         wait_for_workers=False)


class _LocalStore:
    def __init__(self, timeout_s: float):
        self._store = _tcp_store(timeout_s)
        self.port = self._store.port

    def close(self) -> None:
        self._store = None


class _StoreProcess:
    """A TCPStore in a child of the forkserver: it sends its port, then serves until the
    pipe closes (this process's ``close()``, or its death)."""

    def __init__(self, timeout_s: float):
        ctx = _context("forkserver")
        ours, theirs = ctx.Pipe()
        self._proc = ctx.Process(target=_serve_store, args=(theirs, timeout_s),
                                 name="spawn-store", daemon=True)
        self._proc.start()
        theirs.close()
        self._conn = ours
        if not ours.poll(max(30.0, float(timeout_s))):
            self.close()
            raise SpawnError(f"the rendezvous store did not start within {timeout_s} s")
        self.port = ours.recv()

    def close(self) -> None:
        self._conn.close()  # the server's recv() ends: it exits
        self._proc.join(timeout=10)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(timeout=5)


def _serve_store(conn, timeout_s: float) -> None:
    store = _tcp_store(timeout_s)
    conn.send(store.port)
    try:
        conn.recv()  # nothing is sent: returns (EOFError) when the parent closes its end
    except EOFError:
        pass
    del store


class RankFunction:
    """A rank's function named by module and attribute, imported in the rank: the process that
    starts the ranks need not import it (nor torch, which it imports)."""

    def __init__(self, module: str, name: str):
        self.module, self.name = module, name
        self.__qualname__ = f"{module}.{name}"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        import importlib

        return getattr(importlib.import_module(self.module), self.name)(*args, **kwargs)

    def __repr__(self) -> str:
        return self.__qualname__


def preload(*modules: str) -> None:
    """Add modules for the forkserver to import before it forks any rank; only before the
    first :func:`spawn` of this process (the server starts then, once)."""
    if "forkserver" in _CONTEXTS:
        raise RuntimeError("the forkserver has started: preload modules before the first spawn")
    _PRELOAD.extend(m for m in modules if m not in _PRELOAD)


def start_server() -> None:
    """Start the forkserver now, so that it imports torch and Megatron-Core while this process
    goes on with its own imports (the two take both cores; the first :func:`spawn` then finds it
    ready). Optional: :func:`spawn` starts it otherwise."""
    _context("forkserver")


def _context(start_method: str):
    if start_method not in _CONTEXTS:
        ctx = mp.get_context(start_method)
        if start_method == "forkserver":
            ctx.set_forkserver_preload(_PRELOAD)
            _start_forkserver()
        _CONTEXTS[start_method] = ctx
    return _CONTEXTS[start_method]


def _start_forkserver() -> None:
    """Start the server with this process's ``sys.path``: CPython 3.12's forkserver is sent the
    parent's path but never applies it (``multiprocessing.forkserver.main``), so a preloaded
    module found only through a path the parent added (a test's support package) would fail to
    import there, silently."""
    from multiprocessing import forkserver

    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(path for path in sys.path if path)
    try:
        forkserver.ensure_running()
    finally:
        if saved is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved


class _HoldsTorch(Exception):
    pass


class _PlainPickler(pickle.Pickler):
    def reducer_override(self, obj):
        if type(obj).__module__.split(".")[0] == "torch":
            raise _HoldsTorch
        return NotImplemented


def _dumps(obj: Any) -> tuple[str, bytes]:
    """Serialize a rank's result by value: plain pickle where it holds no torch object (the
    parent then needs no torch to read it), else ``torch.save``: torch's multiprocessing
    pickler would share tensors through file descriptors that die with the rank, and plain
    pickle of a tensor, once Megatron is imported, names ``megatron.core.safe_globals``
    (Megatron registers its own storage reducer), which would make the parent import Megatron
    to read it."""
    buf = io.BytesIO()
    try:
        _PlainPickler(buf).dump(obj)
        return "pickle", buf.getvalue()
    except _HoldsTorch:
        import torch

        buf = io.BytesIO()
        torch.save(obj, buf)
        return "torch", buf.getvalue()


def _loads(data: tuple[str, bytes]) -> Any:
    kind, payload = data
    if kind == "pickle":
        return pickle.loads(payload)
    import torch

    return torch.load(io.BytesIO(payload), weights_only=False)  # our own child's bytes


def _worker(rank, world_size, port, timeout_s, fn, args, kwargs, results):
    """Body of one rank: environment, one thread, gloo group (rendezvous at the parent's
    store on ``port``), fn, result to the parent."""
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # parent asks for stacks on timeout
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        OMP_NUM_THREADS="1",
    )
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        timeout = datetime.timedelta(seconds=max(1.0, float(timeout_s)))
        store = dist.TCPStore("127.0.0.1", port, None, False, timeout=timeout)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                                timeout=timeout)
        out = _dumps(fn(rank, world_size, *args, **kwargs))
        destroy()
        dist.destroy_process_group()
        results.put((rank, True, out))
    except BaseException:  # noqa: BLE001 - everything goes back to the parent as text
        results.put((rank, False, traceback.format_exc()))
        # Stay alive (and connected) until the parent stops us: closing our sockets now would
        # make the peers fail with "connection reset", masking this rank's error.
        time.sleep(float(timeout_s))


def spawn(
    world_size: int,
    fn: Callable[..., Any],
    *args: Any,
    timeout_s: float = 120,
    start_method: str = "forkserver",
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` in ``world_size`` processes joined by a gloo
    process group (MASTER_ADDR=127.0.0.1, a free MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK set).

    Returns the ranks' return values, indexed by rank. Raises :class:`SpawnError` carrying the
    first failing rank's traceback if a rank raises or dies, and on a timeout (after asking the
    live ranks to dump their stacks to stderr); all ranks are stopped in both cases.
    ``start_method`` is "forkserver" (default, fast) or "spawn"."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    ctx = _context(start_method)
    results = ctx.Queue()
    store = host_store(timeout_s)
    port = store.port
    procs = [
        ctx.Process(
            target=_worker,
            args=(rank, world_size, port, timeout_s, fn, args, kwargs, results),
            name=f"spawn-rank{rank}",
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()

    outputs: dict[int, Any] = {}
    error: Optional[SpawnError] = None
    try:
        error = _collect(procs, results, outputs, fn, timeout_s)
    finally:
        _stop(procs, graceful=error is None)
        results.close()
        store.close()  # after the ranks: they rendezvoused and left notes there
    if error is not None:
        # The error's traceback keeps this frame, and a caller that keeps the error (pytest)
        # makes a cycle: without these names the queue's semaphores are freed now, not by a
        # later garbage collection that may run inside multiprocessing's resource tracker
        # (CPython 3.12 then warns "ResourceTracker called reentrantly": python/cpython#131788)
        del procs, results, store
        raise error
    return [outputs[r] for r in range(world_size)]


def _collect(
    procs, results, outputs: dict[int, Any], fn: Callable[..., Any], timeout_s: float
) -> Optional[SpawnError]:
    """Fill ``outputs`` with the ranks' results as they arrive; stop at the first failure
    (a rank raised, died without a word, or the run ran past ``timeout_s``) and return the
    error to raise, None when every rank answered."""
    world_size = len(procs)
    deadline = time.monotonic() + timeout_s
    while len(outputs) < world_size:
        try:
            rank, ok, payload = results.get(timeout=0.2)
        except queue_mod.Empty:
            if time.monotonic() > deadline:
                return _timed_out(procs, outputs, fn, timeout_s)
            error = _died_silently(procs, results, outputs)
            if error is not None:
                return error
            continue
        if not ok:
            return _first_cause(rank, payload, results, procs, outputs)
        outputs[rank] = _loads(payload)
    return None


def _timed_out(procs, outputs, fn, timeout_s: float) -> SpawnError:
    """The timeout's error, once the ranks that have not finished have dumped their stacks
    (so that a hang shows where it waits)."""
    world_size = len(procs)
    missing = sorted(set(range(world_size)) - set(outputs))
    _dump_stacks([procs[r] for r in missing])
    return SpawnError(
        f"spawn timed out after {timeout_s}s: ranks {missing} of {world_size} "
        f"did not finish {getattr(fn, '__qualname__', fn)!r} (their stacks were "
        "dumped to stderr)"
    )


def _died_silently(procs, results, outputs) -> Optional[SpawnError]:
    """The error for a rank that exited non-zero without putting a result (or a traceback) on
    the queue, if there is one; its message gets a moment to arrive first."""
    dead = [
        r
        for r, p in enumerate(procs)
        if r not in outputs and p.exitcode is not None and p.exitcode != 0
    ]
    if dead and results.empty():
        time.sleep(0.5)  # a result may still be in flight
        if results.empty():
            r = dead[0]
            return SpawnError(
                f"rank {r} died with exit code {procs[r].exitcode} without a result",
                rank=r,
            )
    return None


# Errors a rank gets because a *peer* failed: reported after the root cause, if both come.
_SECONDARY = ("Connection reset by peer", "Connection closed by peer", "Broken pipe")


def _first_cause(rank: int, text: str, results, procs, outputs) -> SpawnError:
    """The error to raise: collect the errors that arrive within a moment and prefer one that
    is not a consequence of a peer's failure (or a rank that died without a word); name the
    other failing ranks too."""
    world_size = len(procs)
    errors = [(rank, text)]
    end = time.monotonic() + 0.5
    while time.monotonic() < end:
        try:
            r, ok, payload = results.get(timeout=0.1)
        except queue_mod.Empty:
            continue
        if not ok:
            errors.append((r, payload))
    reported = {r for r, _ in errors} | set(outputs)
    dead = [r for r, p in enumerate(procs) if r not in reported and p.exitcode not in (None, 0)]
    primary = next((e for e in errors if not any(m in e[1] for m in _SECONDARY)), None)
    if primary is None and dead:
        r = dead[0]
        return SpawnError(
            f"rank {r} of {world_size} died with exit code {procs[r].exitcode} without a "
            f"result; then rank {errors[0][0]} raised:\n{errors[0][1]}",
            rank=r,
        )
    primary = primary or errors[0]
    others = sorted(r for r, _ in errors if r != primary[0])
    also = f" (ranks {others} failed too)" if others else ""
    return SpawnError(
        f"rank {primary[0]} of {world_size} raised{also}:\n{primary[1]}", rank=primary[0]
    )


def _dump_stacks(procs) -> None:
    """Ask each live rank, one at a time, to print its Python stacks to stderr."""
    for p in procs:
        if p.is_alive() and p.pid is not None:
            try:
                print(f"--- stacks of {p.name} (pid {p.pid}) ---", file=sys.stderr, flush=True)
                os.kill(p.pid, signal.SIGUSR1)
            except OSError:
                continue
            time.sleep(0.3)


def _stop(procs, graceful: bool) -> None:
    if graceful:
        for p in procs:
            p.join(timeout=10)
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join(timeout=5)


# --------------------------------------------------------------------------------------------
# Megatron parallel state
# --------------------------------------------------------------------------------------------


def init_megatron(
    pp_size: int,
    vp_size: Optional[int] = None,
    tp: int = 1,
    seed: int = 1234,
    force_cpu: bool = True,
) -> None:
    """Initialize Megatron-Core's model-parallel state in this (already gloo-initialized) process:
    ``initialize_model_parallel(tp, pp, vp)``, then seed the RNGs (torch's CPU RNG and
    ``model_parallel_cuda_manual_seed``, which works on the CPU through the CPU shims).
    Data-parallel size is ``world_size // (tp * pp_size)``.

    Applies the CPU shims: always with ``force_cpu`` (the default: the gloo demo runs on the
    CPU even where a GPU exists, so several ranks can share a machine and results do not
    depend on it), else only when there is no GPU."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_pp_ext.train.cpu_shims import apply_cpu_shims

    apply_cpu_shims(force=force_cpu)
    world = dist.get_world_size()
    if world % (tp * pp_size) != 0:
        raise ValueError(
            f"world_size={world} is not divisible by tp*pp={tp}*{pp_size}; launch "
            f"a multiple of {tp * pp_size} processes"
        )
    if vp_size is not None and vp_size < 2:
        vp_size = None  # Megatron treats vp=1 as "not interleaved"; None says it plainly.
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp_size,
        virtual_pipeline_model_parallel_size=vp_size,
    )
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


def destroy() -> None:
    """Tear down Megatron-Core's model-parallel state (safe to call when not initialized)."""
    if "megatron.core.parallel_state" not in sys.modules:
        return
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
