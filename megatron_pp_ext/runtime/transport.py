"""The transport seam: how one pipeline rank moves tensors to and from its peers.

``TorchDistTransport`` is production (torch.distributed: gloo on the CPU, NCCL on GPUs).
``InMemoryFabric`` runs every rank of a pipeline as threads of one process (our "mock
process group"), so every schedule x (p, m, v) can be executed in seconds.

Peers are ranks *within the pipeline group*. Messages between two ranks are matched in the
order they are posted (NCCL has no tags), which the validator checks for every schedule.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .. import device as device_helper
from .errors import PipelineTimeoutError

# dtype <-> small integer code for the shape header of variable-length messages
_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32]
_HEADER_LEN = 8  # [dtype code, ndim, dim0, ..., dim5]


class TransportTimeout(Exception):
    """A wait expired; the executor turns it into a PipelineTimeoutError with context."""


@dataclass
class RecvRequest:
    peer: int
    shape: tuple | None  # None: the shape travels with the tensor (variable_seq_lengths)
    dtype: torch.dtype
    device: torch.device


def encode_header(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    if tensor.dim() > _HEADER_LEN - 2:
        raise ValueError(f"cannot send a {tensor.dim()}-d tensor with a shape header (max 6-d)")
    values = [_DTYPES.index(tensor.dtype), tensor.dim(), *tensor.shape]
    values += [0] * (_HEADER_LEN - len(values))
    return torch.tensor(values, dtype=torch.int64, device=device)


def decode_header(header: torch.Tensor) -> tuple[tuple, torch.dtype]:
    values = header.tolist()
    dtype, ndim = _DTYPES[values[0]], values[1]
    return tuple(values[2 : 2 + ndim]), dtype


# ----------------------------------------------------------------------------- torch.distributed
class _DistSend:
    """A send's Works: on the batched path every Work of its batch (NCCL returns one)."""

    def __init__(self, works, watch=None):
        self.works, self.watch = works, watch

    def done(self) -> bool:
        return all(w.is_completed() for w in self.works)

    def wait(self, timeout_s: float, poll: bool) -> None:
        _wait_all(self.works, timeout_s, poll, self.watch)


class _DistRecv:
    """A receive's Works and buffer; the buffer is handed out only after every Work is waited
    on. ``header`` (gloo's direct path only): the shape arrives first, the payload is
    received once it is known."""

    def __init__(self, transport, request: RecvRequest, works, buffer, header=None):
        self.transport, self.request = transport, request
        self.works, self.buffer, self.header = works, buffer, header

    def wait(self, timeout_s: float) -> torch.Tensor:
        deadline = time.monotonic() + timeout_s
        _wait_all(self.works, timeout_s, self.transport.poll, self.transport.watch)
        if self.header is not None:  # second phase: the payload, now that its shape is known
            shape, dtype = decode_header(self.header)
            self.buffer = torch.empty(shape, dtype=dtype, device=self.request.device)
            work = dist.irecv(self.buffer, group=self.transport.group,
                              group_src=self.request.peer)
            _wait_work(work, max(0.0, deadline - time.monotonic()), self.transport.poll,
                       self.transport.watch)
        return self.buffer


def _wait_all(works, timeout_s: float, poll: bool, watch=None) -> None:
    deadline = time.monotonic() + timeout_s
    for work in works:
        _wait_work(work, max(0.0, deadline - time.monotonic()), poll, watch)


WATCH_EVERY_S = 1.0  # how often a polled wait asks ``watch`` whether a peer has failed


def _wait_work(work, timeout_s: float, poll: bool, watch=None) -> None:
    """Wait for ``work`` (TransportTimeout after ``timeout_s``). Polled waits (NCCL) call
    ``watch()`` about once a second: it raises when a peer has reported a failure, so a rank
    does not sit out its whole timeout on a peer that already gave up."""
    if not poll:
        try:
            if not work.wait(timeout=_timedelta(timeout_s)):
                raise TransportTimeout()
        except RuntimeError as exc:  # gloo reports an expired wait as a RuntimeError
            if "timed out" in str(exc).lower() or "timeout" in str(exc).lower():
                raise TransportTimeout() from exc
            raise
        return
    deadline = time.monotonic() + timeout_s
    next_watch = time.monotonic() + WATCH_EVERY_S
    while not work.is_completed():
        now = time.monotonic()
        if now > deadline:
            raise TransportTimeout()
        if watch is not None and now >= next_watch:
            watch()
            next_watch = now + WATCH_EVERY_S
        time.sleep(0.0001)
    work.wait()  # NCCL: makes the current stream wait, so the data is there for compute


def _timedelta(seconds: float):
    import datetime

    return datetime.timedelta(seconds=max(seconds, 0.001))


class TorchDistTransport:
    """P2P over a torch.distributed process group (the pipeline-parallel group).

    Two code paths, chosen once (``batched``; None: ``device.p2p_batched``, i.e. NCCL):

    * batched (NCCL): each call is one ``batch_isend_irecv``. NCCL returns ONE Work for the
      whole batch (gloo one per op), so every handle of a batch, send or receive, waits on
      every Work the batch returned. Waits are polled (NCCL's wait does not block the host),
      and no receive is posted ahead (NCCL runs a rank's batches in order: an early receive
      would hold up the sends behind it). With variable shapes the headers go in a batch of
      their own, waited on before the payload batch is posted (Megatron's
      ``_communicate_shapes``): a payload received later, on its own, could wait for a peer
      whose next batch waits for this rank's.
    * direct (gloo): each op posted by itself (about half the cost of a gloo batch), one
      Work per op; the payload of a variable-shape receive is posted once its header is in.
    """

    def __init__(self, group=None, batched: bool | None = None, timeout_s: float = 600.0):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.device = device_helper.comm_device(group)
        self.batched = device_helper.p2p_batched(group) if batched is None else batched
        self.poll = self.batched or not device_helper.waits_block_host(group)
        # polled waits call it about once a second; it raises PeerReported when a peer has
        # failed (the drop-in sets it each step: runtime.errors, integration.agreement)
        self.watch = None
        # NCCL runs a pair's operations in order: an early receive would hold up a send
        self.prefetch_receives = not self.poll
        # the longest wait for shape headers inside a call (exchange takes no timeout)
        self.timeout_s = timeout_s

    def exchange(self, send, recv: RecvRequest | None, variable_shapes: bool,
                 timeout_s: float | None = None):
        """Post one send (tensor, peer) and/or one receive together (Megatron's fused calls)."""
        send_handles, recv_handles = self.exchange_many(
            [send] if send is not None else [], [recv] if recv is not None else [],
            variable_shapes, timeout_s)
        return (send_handles[0] if send_handles else None,
                recv_handles[0] if recv_handles else None)

    def exchange_many(self, sends: list, recvs: list[RecvRequest], variable_shapes: bool,
                      timeout_s: float | None = None):
        """Sends (tensor, peer) and receives in one call (one batch on the batched path: a
        DualPipe pair's two sends and its round's receives); returns (one send handle per
        send, one receive handle per request). The lowering checks the program against
        NCCL's rules, shape headers included: two messages of one peer received in one call
        were sent in one call too."""
        if self.batched:
            return self._exchange_batched(sends, recvs, variable_shapes, timeout_s)
        return self._exchange_direct(sends, recvs, variable_shapes)

    # ---------------------------------------------------------------- batched (NCCL)
    def _exchange_batched(self, sends, recvs, variable_shapes: bool, timeout_s):
        shapes = [(r.shape, r.dtype) for r in recvs]
        if variable_shapes:
            shapes = self._exchange_headers(sends, recvs, timeout_s)
        ops = [self._op(dist.isend, tensor.contiguous(), peer) for tensor, peer in sends]
        buffers = []
        for request, (shape, dtype) in zip(recvs, shapes):
            buffers.append(torch.empty(shape, dtype=dtype, device=request.device))
            ops.append(self._op(dist.irecv, buffers[-1], request.peer))
        works = self._batch(ops)
        return ([_DistSend(works, self.watch) for _ in sends],
                [_DistRecv(self, r, works, b) for r, b in zip(recvs, buffers)])

    def _exchange_headers(self, sends, recvs, timeout_s) -> list[tuple]:
        """The shape-header phase: one batch, both directions, waited on; the shapes in."""
        ops = [self._op(dist.isend, encode_header(tensor, self.device), peer)
               for tensor, peer in sends]
        headers = [torch.empty(_HEADER_LEN, dtype=torch.int64, device=self.device)
                   for _ in recvs]
        ops += [self._op(dist.irecv, h, r.peer) for h, r in zip(headers, recvs)]
        limit = self.timeout_s if timeout_s is None else timeout_s
        try:
            _wait_all(self._batch(ops), limit, self.poll)
        except TransportTimeout:
            raise self._header_timeout(sends, recvs, limit) from None
        return [decode_header(h) for h in headers]

    def _header_timeout(self, sends, recvs, waited_s: float) -> PipelineTimeoutError:
        peers = [r.peer for r in recvs] or [peer for _, peer in sends]
        parts = [f"send to rank {peer}" for _, peer in sends] + [
            f"receive from rank {r.peer}" for r in recvs]
        return PipelineTimeoutError(
            self.rank, peers[0], f"the shape headers of one call ({', '.join(parts)}), "
            "exchanged before its tensors (variable_seq_lengths)", waited_s, [])

    def _batch(self, ops) -> list:
        return list(dist.batch_isend_irecv(ops)) if ops else []

    def _op(self, op, tensor, peer: int):
        return dist.P2POp(op, tensor, group=self.group, group_peer=peer)

    # ---------------------------------------------------------------- direct (gloo)
    def _exchange_direct(self, sends, recvs, variable_shapes: bool):
        """Each op posted by itself, one Work each: each handle waits on its own Works.
        Variable shapes: every header first (so the receiver can allocate), then the payloads,
        a receive's posted once its header is in (``_DistRecv.wait``)."""
        send_works: list[list] = [[] for _ in sends]
        headers, buffers = [None] * len(recvs), [None] * len(recvs)
        recv_works: list[list] = [[] for _ in recvs]
        if variable_shapes:
            for works, (tensor, peer) in zip(send_works, sends):
                works.append(self._post(dist.isend, encode_header(tensor, self.device), peer))
            for i, request in enumerate(recvs):
                headers[i] = torch.empty(_HEADER_LEN, dtype=torch.int64, device=self.device)
                recv_works[i].append(self._post(dist.irecv, headers[i], request.peer))
        for works, (tensor, peer) in zip(send_works, sends):
            works.append(self._post(dist.isend, tensor.contiguous(), peer))
        if not variable_shapes:
            for i, request in enumerate(recvs):
                buffers[i] = torch.empty(request.shape, dtype=request.dtype,
                                         device=request.device)
                recv_works[i].append(self._post(dist.irecv, buffers[i], request.peer))
        return ([_DistSend(works, self.watch) for works in send_works],
                [_DistRecv(self, r, w, b, h)
                 for r, w, b, h in zip(recvs, recv_works, buffers, headers)])

    def _post(self, op, tensor, peer: int):
        key = "group_dst" if op is dist.isend else "group_src"
        return op(tensor, group=self.group, **{key: peer})


# ----------------------------------------------------------------------------- in memory
class _DoneSend:
    def done(self) -> bool:
        return True

    def wait(self, timeout_s: float, poll: bool = False) -> None:
        return None


class _QueueRecv:
    def __init__(self, channel: queue.Queue, request: RecvRequest, abort: threading.Event):
        self.channel, self.request, self.abort = channel, request, abort

    def wait(self, timeout_s: float) -> torch.Tensor:
        deadline = time.monotonic() + timeout_s
        while True:
            if self.abort.is_set():
                raise TransportTimeout()
            try:
                tensor = self.channel.get(timeout=min(0.05, max(0.0, deadline - time.monotonic())))
                break
            except queue.Empty:
                if time.monotonic() >= deadline:
                    raise TransportTimeout() from None
        expected = self.request.shape
        if expected is not None and (tuple(tensor.shape) != tuple(expected)
                                     or tensor.dtype != self.request.dtype):
            raise ValueError(
                f"received a tensor of shape {tuple(tensor.shape)} and dtype {tensor.dtype} from "
                f"rank {self.request.peer}, expected {tuple(expected)} and {self.request.dtype}; "
                "set variable_seq_lengths=True if microbatches differ in length"
            )
        return tensor


class InMemoryFabric:
    """A channel per (src, dst) pair; each rank gets its transport with ``transport(rank)``."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self.channels = {(s, d): queue.Queue() for s in range(world_size)
                         for d in range(world_size) if s != d}
        self.abort = threading.Event()  # set when a rank fails, so its peers stop waiting

    def transport(self, rank: int) -> "InMemoryTransport":
        return InMemoryTransport(self, rank)


class InMemoryTransport:
    poll = False
    prefetch_receives = True
    device = torch.device("cpu")

    def __init__(self, fabric: InMemoryFabric, rank: int):
        self.fabric, self.rank, self.world_size = fabric, rank, fabric.world_size

    def exchange(self, send, recv: RecvRequest | None, variable_shapes: bool,
                 timeout_s: float | None = None):
        send_handles, recv_handles = self.exchange_many(
            [send] if send is not None else [], [recv] if recv is not None else [],
            variable_shapes)
        return (send_handles[0] if send_handles else None,
                recv_handles[0] if recv_handles else None)

    def exchange_many(self, sends: list, recvs: list[RecvRequest], variable_shapes: bool,
                      timeout_s: float | None = None):
        handles = []
        for tensor, peer in sends:
            # A copy, as a wire would make: the sender may deallocate its output right after.
            self.fabric.channels[(self.rank, peer)].put(tensor.detach().clone())
            handles.append(_DoneSend())
        return handles, [self._recv(r, variable_shapes) for r in recvs]

    def _recv(self, recv: RecvRequest, variable_shapes: bool) -> _QueueRecv:
        request = RecvRequest(recv.peer, None if variable_shapes else recv.shape,
                              recv.dtype, recv.device)
        return _QueueRecv(self.fabric.channels[(recv.peer, self.rank)], request,
                          self.fabric.abort)
