"""gloo made to batch as NCCL does (test support; the package never imports this).

Inside one rank process, ``nccl_rules()`` replaces ``torch.distributed.batch_isend_irecv``
with one that keeps NCCL's rules (DESIGN.md, "NCCL's rules"):

* ONE Work per batch, whatever the number of ops (gloo returns one per op);
* a rank's batches run one after another, in the order they were issued (NCCL runs them on
  one stream): a per-process thread posts each batch's ops with gloo's isend/irecv and waits
  for all of them before it starts the next batch;
* received data reaches the caller's tensors only when the batch's Work is waited on
  (``wait()`` returns) or first reports ``is_completed()``: a receive read before its wait
  holds whatever the buffer held before, and if autograd saved it, the late copy makes the
  backward fail ("modified by an inplace operation");
* ``wait(timeout)`` gives up after ``timeout`` as torch's Work does (a RuntimeError).

gloo's send completes only once its receive is posted, so rendezvous holds at any size.
Lone ``isend``/``irecv`` are left to gloo (on NCCL they run on a per-pair communicator).

It also makes the plugin's transport take its NCCL code path (``device.p2p_batched``: one
batch per call, polled waits, no receive posted ahead). Megatron's p2p_communication calls
``torch.distributed.batch_isend_irecv`` by attribute at each call, so with
``batch_p2p_comm=True`` Megatron's own schedules run under the same rules.

    with nccl_rules():
        run_step(...)

``run_steps_under_rules`` is the spawn target: like ``support.reference.run_steps``, each run
dict may say ``nccl_rules=True``.
"""

from __future__ import annotations

import contextlib
import datetime
import queue
import threading
from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

from megatron_pp_ext import device as device_helper


class _Batch:
    """One batch_isend_irecv call: what to send, where to receive, whether it has run."""

    def __init__(self, ops: Sequence[dist.P2POp]):
        self.posts = []  # (op function, tensor gloo sends from / receives into, group, peer)
        self.deliveries = []  # (caller's tensor, private buffer), copied when waited on
        for op in ops:
            if op.op is dist.isend:
                # the tensor as it is now (NCCL keeps the pointer): Megatron may swap the
                # output's .data right after the call (deallocate_output_tensor)
                self.posts.append((dist.isend, op.tensor.detach(), op.group, op.group_peer))
            else:
                private = torch.empty_like(op.tensor)
                self.posts.append((dist.irecv, private, op.group, op.group_peer))
                self.deliveries.append((op.tensor, private))
        self.finished = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            works = [self._post(*post) for post in self.posts]
            for work in works:
                work.wait()
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on the Work
            self.error = exc
        self.finished.set()

    @staticmethod
    def _post(op, tensor, group, peer):
        key = "group_dst" if op is dist.isend else "group_src"
        return op(tensor, group=group, **{key: peer})


class BatchWork:
    """What NCCL's batch_isend_irecv returns: one Work for the whole batch."""

    def __init__(self, batch: _Batch):
        self._batch = batch
        self._delivered = False

    def is_completed(self) -> bool:
        if not self._batch.finished.is_set():
            return False
        if self._batch.error is None:
            self._deliver()
        return True

    def wait(self, timeout=None) -> bool:
        seconds = _seconds(timeout)
        if not self._batch.finished.wait(seconds):
            raise RuntimeError(
                f"Timed out waiting {seconds * 1000:.0f}ms for a batch of "
                f"{len(self._batch.posts)} p2p ops (gloo under NCCL's rules)")
        if self._batch.error is not None:
            raise RuntimeError(f"a batch of p2p ops failed: {self._batch.error}") \
                from self._batch.error
        self._deliver()
        return True

    def is_success(self) -> bool:
        return self._batch.finished.is_set() and self._batch.error is None

    def exception(self):
        return self._batch.error

    def _deliver(self) -> None:
        """Received data becomes visible here, once: on NCCL, after the wait."""
        if self._delivered:
            return
        self._delivered = True
        with torch.no_grad():
            for caller, private in self._batch.deliveries:
                caller.copy_(private)


def _seconds(timeout) -> float | None:
    """torch's Work.wait(timeout): a timedelta; zero (its default) or None: no limit here."""
    if timeout is None:
        return None
    seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) \
        else float(timeout)
    return seconds if seconds > 0 else None


class _BatchRunner:
    """One per process: runs the rank's batches strictly one after another."""

    def __init__(self):
        self._pending: queue.Queue = queue.Queue()
        self.batches = 0  # how many batches were issued (a check that callers reach it)
        self._thread = threading.Thread(target=self._loop, name="nccl-rules-batches",
                                        daemon=True)
        self._thread.start()

    def submit(self, ops: Sequence[dist.P2POp]) -> list[BatchWork]:
        batch = _Batch(ops)
        self.batches += 1
        self._pending.put(batch)
        return [BatchWork(batch)]

    def stop(self) -> None:
        self._pending.put(None)

    def _loop(self) -> None:
        while (batch := self._pending.get()) is not None:
            batch.run()


_active: list = []  # the runner while nccl_rules() is active in this process


@contextlib.contextmanager
def nccl_rules():
    """Within: batch_isend_irecv as on NCCL, and the transport's NCCL code path."""
    if _active:
        raise RuntimeError("nccl_rules() is already active in this process")
    runner = _BatchRunner()
    _active.append(runner)
    saved = (dist.batch_isend_irecv, distributed_c10d.batch_isend_irecv,
             device_helper.p2p_batched)

    def batch_isend_irecv(p2p_op_list):
        if not p2p_op_list:
            raise ValueError("batch_isend_irecv got no ops")  # as torch's check does
        return runner.submit(p2p_op_list)

    dist.batch_isend_irecv = distributed_c10d.batch_isend_irecv = batch_isend_irecv
    device_helper.p2p_batched = lambda group=None: True
    try:
        yield runner
    finally:
        (dist.batch_isend_irecv, distributed_c10d.batch_isend_irecv,
         device_helper.p2p_batched) = saved
        runner.stop()
        _active.clear()


def run_steps_under_rules(rank: int, world_size: int,
                          runs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Spawn target: ``support.reference.run_step`` for each run dict, in these processes;
    a run with ``nccl_rules=True`` runs inside ``nccl_rules()``, and its result also holds
    ``"nccl_batches"``: how many batches this rank issued through the replacement."""
    from support.reference import run_step

    results = []
    for run in runs:
        kwargs = dict(run)
        if not kwargs.pop("nccl_rules", False):
            results.append(run_step(rank, world_size, **kwargs))
            continue
        with nccl_rules() as runner:
            result = run_step(rank, world_size, **kwargs)
        results.append(dict(result, nccl_batches=runner.batches))
    return results


def probe_under_rules(rank: int, world_size: int, *args, **kwargs) -> dict[str, Any]:
    """Spawn target: ``support.probes.probe_step`` inside ``nccl_rules()``; the result also
    holds ``"nccl_batches"``."""
    from support.probes import probe_step

    with nccl_rules() as runner:
        result = probe_step(rank, world_size, *args, **kwargs)
    return dict(result, nccl_batches=runner.batches)


__all__ = ["nccl_rules", "BatchWork", "run_steps_under_rules", "probe_under_rules"]
