"""An in-memory fabric with NCCL's point-to-point rules, for threads standing in for ranks.

A mock of NCCL (which cannot run here), faithful to the rules that make NCCL hang where gloo
does not (DESIGN.md, "NCCL's rules"):

* one Work per batch: every handle of a batch completes when the whole batch has;
* a rank's batches run one after another (one stream): a batch starts only when the rank's
  previous batch has completed;
* rendezvous, no buffering: a send completes only when the matching receive is running
  (its batch has started on the receiver's stream), and vice versa;
* per ordered pair of ranks, the k-th send matches the k-th receive (no tags);
* received data is visible only after the wait.

Each rank's stream is a worker thread. A rank whose stream cannot progress blocks only its
own later batches, as on a GPU; the host side sees it as a wait that times out.
"""

from __future__ import annotations

import collections
import threading
import time

import torch

from megatron_pp_ext.runtime.transport import RecvRequest, TransportTimeout


class _Op:
    def __init__(self, batch: "_Batch", kind: str, peer: int, tensor=None,
                 request: RecvRequest | None = None):
        self.batch, self.kind, self.peer = batch, kind, peer
        self.tensor, self.request = tensor, request
        self.received: torch.Tensor | None = None
        self.done = False


class _Batch:
    def __init__(self, rank: int):
        self.rank, self.ops = rank, []
        self.finished = threading.Event()


class _SendHandle:
    def __init__(self, fabric: "NcclRulesFabric", batch: _Batch):
        self.fabric, self.batch = fabric, batch

    def done(self) -> bool:
        return self.batch.finished.is_set()

    def wait(self, timeout_s: float, poll: bool = True) -> None:
        self.fabric.wait_batch(self.batch, timeout_s)


class _RecvHandle(_SendHandle):
    def __init__(self, fabric, batch: _Batch, op: _Op):
        super().__init__(fabric, batch)
        self.op = op

    def wait(self, timeout_s: float, poll: bool = True) -> torch.Tensor:
        self.fabric.wait_batch(self.batch, timeout_s)
        tensor, request = self.op.received, self.op.request
        if request.shape is not None and (tuple(tensor.shape) != tuple(request.shape)
                                          or tensor.dtype != request.dtype):
            raise ValueError(
                f"received a tensor of shape {tuple(tensor.shape)} and dtype {tensor.dtype} "
                f"from rank {request.peer}, expected {tuple(request.shape)} and "
                f"{request.dtype}; set variable_seq_lengths=True if microbatches differ in "
                "length")
        return tensor


class NcclRulesFabric:
    """Each rank's transport comes from ``transport(rank)``; ``close()`` stops the streams.
    ``device``: where the ranks' tensors live (the transports' ``device``; default the CPU).
    The fabric's copies stay on the sent tensor's device."""

    def __init__(self, world_size: int, device=None):
        self.world_size = world_size
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        # one lock; each rank's stream waits on a condition of its own, so that a post or a
        # match wakes only the streams it concerns (not every stream at every op)
        self.lock = threading.Lock()
        self.wake = [threading.Condition(self.lock) for _ in range(world_size)]
        self.abort = threading.Event()
        self.queues = [collections.deque() for _ in range(world_size)]  # posted, not started
        # per ordered pair (src, dst): running sends / receives not yet matched, in order
        self.sends = collections.defaultdict(collections.deque)
        self.recvs = collections.defaultdict(collections.deque)
        self.batches_run = [0] * world_size
        # per rank, each posted batch as [(kind, peer), ...]: what ran, to hold against the
        # lowered program
        self.posted: list[list[list[tuple[str, int]]]] = [[] for _ in range(world_size)]
        self.streams = [threading.Thread(target=self._stream, args=(r,), daemon=True,
                                         name=f"nccl-stream-{r}") for r in range(world_size)]
        for stream in self.streams:
            stream.start()

    def transport(self, rank: int) -> "NcclRulesTransport":
        return NcclRulesTransport(self, rank)

    def close(self) -> None:
        self.abort.set()
        with self.lock:
            for wake in self.wake:
                wake.notify_all()

    # ------------------------------------------------------------------ host side
    def post(self, batch: _Batch) -> None:
        with self.lock:
            self.posted[batch.rank].append([(op.kind, op.peer) for op in batch.ops])
            self.queues[batch.rank].append(batch)
            self.wake[batch.rank].notify()

    def wait_batch(self, batch: _Batch, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not batch.finished.wait(0.05):
            if self.abort.is_set() or time.monotonic() >= deadline:
                raise TransportTimeout()

    # ------------------------------------------------------------------ the streams
    def _stream(self, rank: int) -> None:
        """Run the rank's batches one after another; each finishes when all its ops have."""
        wake = self.wake[rank]
        with self.lock:
            while not self.abort.is_set():
                if not self.queues[rank]:
                    wake.wait(0.05)
                    continue
                batch = self.queues[rank].popleft()
                for op in batch.ops:  # the batch is running: its ops can now be matched
                    pair = (rank, op.peer) if op.kind == "send" else (op.peer, rank)
                    (self.sends if op.kind == "send" else self.recvs)[pair].append(op)
                    self._match(pair)
                while not all(op.done for op in batch.ops) and not self.abort.is_set():
                    wake.wait(0.05)
                if self.abort.is_set():
                    return
                self.batches_run[rank] += 1
                batch.finished.set()

    def _match(self, pair) -> None:
        sends, recvs = self.sends[pair], self.recvs[pair]
        while sends and recvs:
            send, recv = sends.popleft(), recvs.popleft()
            recv.received = send.tensor.detach().clone()  # the wire's copy
            self._complete(send, recv)

    def _complete(self, send: _Op, recv: _Op) -> None:
        """A matched pair has moved (under the lock): wake the two streams it concerns."""
        send.done = recv.done = True
        self.wake[send.batch.rank].notify()
        self.wake[recv.batch.rank].notify()


class NcclRulesTransport:
    """The executor's transport seam over ``NcclRulesFabric``, on the NCCL code path."""

    poll = True  # NCCL: waits are polled by the host
    prefetch_receives = False  # NCCL: an early receive would hold up the stream
    batched = True
    device = torch.device("cpu")

    def __init__(self, fabric: NcclRulesFabric, rank: int):
        self.fabric, self.rank, self.world_size = fabric, rank, fabric.world_size
        self.device = getattr(fabric, "device", self.device)

    def exchange(self, send, recv: RecvRequest | None, variable_shapes: bool):
        send_handles, recv_handles = self.exchange_many(
            [send] if send is not None else [], [recv] if recv is not None else [],
            variable_shapes)
        return (send_handles[0] if send_handles else None,
                recv_handles[0] if recv_handles else None)

    timeout_s = 60.0  # the header batch's wait inside a call (the drop-in sets it per step)

    def exchange_many(self, sends: list, recvs: list[RecvRequest], variable_shapes: bool):
        if variable_shapes:
            # As the transport on NCCL: the shapes in a batch of their own, waited on before
            # the payload batch is posted.
            header = _Batch(self.rank)
            for tensor, peer in sends:
                header.ops.append(_Op(header, "send", peer,
                                      tensor=torch.tensor(list(tensor.shape))))
            for request in recvs:
                header.ops.append(_Op(header, "recv", request.peer, request=RecvRequest(
                    request.peer, None, torch.int64, request.device)))
            self.fabric.post(header)
            self.fabric.wait_batch(header, self.timeout_s)
        batch = _Batch(self.rank)
        for tensor, peer in sends:
            batch.ops.append(_Op(batch, "send", peer, tensor=tensor))
        handles = []
        for request in recvs:
            request = RecvRequest(request.peer, None if variable_shapes else request.shape,
                                  request.dtype, request.device)
            op = _Op(batch, "recv", request.peer, request=request)
            batch.ops.append(op)
            handles.append(_RecvHandle(self.fabric, batch, op))
        self.fabric.post(batch)
        return [_SendHandle(self.fabric, batch) for _ in sends], handles
