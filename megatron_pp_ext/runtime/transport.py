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
    def __init__(self, works):
        self.works = works

    def done(self) -> bool:
        return all(w.is_completed() for w in self.works)

    def wait(self, timeout_s: float, poll: bool) -> None:
        for work in self.works:
            _wait_work(work, timeout_s, poll)


class _DistRecv:
    def __init__(self, transport, request: RecvRequest, works, buffer, header=None):
        self.transport, self.request = transport, request
        self.works, self.buffer, self.header = works, buffer, header

    def wait(self, timeout_s: float) -> torch.Tensor:
        deadline = time.monotonic() + timeout_s
        for work in self.works:
            _wait_work(work, max(0.0, deadline - time.monotonic()), self.transport.poll)
        if self.header is not None:  # second phase: the payload, now that its shape is known
            shape, dtype = decode_header(self.header)
            self.buffer = torch.empty(shape, dtype=dtype, device=self.request.device)
            work = dist.irecv(self.buffer, group=self.transport.group,
                              group_src=self.request.peer)
            _wait_work(work, max(0.0, deadline - time.monotonic()), self.transport.poll)
        return self.buffer


def _wait_work(work, timeout_s: float, poll: bool) -> None:
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
    while not work.is_completed():
        if time.monotonic() > deadline:
            raise TransportTimeout()
        time.sleep(0.0001)
    work.wait()


def _timedelta(seconds: float):
    import datetime

    return datetime.timedelta(seconds=max(seconds, 0.001))


class TorchDistTransport:
    """P2P over a torch.distributed process group (the pipeline-parallel group)."""

    def _start(self, ops) -> list:
        """NCCL: one group (batch_isend_irecv), so a send and a receive of one call progress
        together. gloo cannot group them; posting each directly costs about half as much."""
        if not ops:
            return []
        if self.poll:  # NCCL
            return dist.batch_isend_irecv(ops)
        return [op.op(op.tensor, group=self.group,
                      **({"group_dst": op.group_peer} if op.op is dist.isend
                         else {"group_src": op.group_peer}))
                for op in ops]

    def __init__(self, group=None):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.device = device_helper.comm_device(group)
        self.poll = not device_helper.waits_block_host(group)
        # NCCL runs a pair's operations in order: an early receive would hold up a send
        self.prefetch_receives = not self.poll

    def exchange(self, send, recv: RecvRequest | None, variable_shapes: bool):
        """Post one send (tensor, peer) and/or one receive together (Megatron's fused calls)."""
        ops, header_recv = [], None
        if variable_shapes:
            # Shapes first, so the receiver can allocate; the payload follows in order.
            if send is not None:
                ops.append(dist.P2POp(dist.isend, encode_header(send[0], self.device),
                                      group=self.group, group_peer=send[1]))
            if recv is not None:
                header_recv = torch.empty(_HEADER_LEN, dtype=torch.int64, device=self.device)
                ops.append(dist.P2POp(dist.irecv, header_recv, group=self.group,
                                      group_peer=recv.peer))
        buffer = None
        if send is not None:
            ops.append(dist.P2POp(dist.isend, send[0].contiguous(), group=self.group,
                                  group_peer=send[1]))
        if recv is not None and not variable_shapes:
            buffer = torch.empty(recv.shape, dtype=recv.dtype, device=recv.device)
            ops.append(dist.P2POp(dist.irecv, buffer, group=self.group, group_peer=recv.peer))
        works = self._start(ops)
        send_works = [w for w, op in zip(works, ops) if op.op is dist.isend]
        recv_works = [w for w, op in zip(works, ops) if op.op is dist.irecv]
        send_handle = _DistSend(send_works) if send is not None else None
        recv_handle = (_DistRecv(self, recv, recv_works, buffer, header_recv)
                       if recv is not None else None)
        return send_handle, recv_handle


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

    def exchange(self, send, recv: RecvRequest | None, variable_shapes: bool):
        send_handle = recv_handle = None
        if send is not None:
            tensor, peer = send
            # A copy, as a wire would make: the sender may deallocate its output right after.
            self.fabric.channels[(self.rank, peer)].put(tensor.detach().clone())
            send_handle = _DoneSend()
        if recv is not None:
            request = RecvRequest(recv.peer, None if variable_shapes else recv.shape,
                                  recv.dtype, recv.device)
            recv_handle = _QueueRecv(self.fabric.channels[(recv.peer, self.rank)], request,
                                     self.fabric.abort)
        return send_handle, recv_handle
