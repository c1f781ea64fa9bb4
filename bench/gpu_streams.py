"""The GPU check's CUDA streams (its part 2, and part 1's fabric on CUDA): a fabric with
NCCL's stream semantics on one GPU, each rank's own stream, and the control that shows a read
needs the wait.

On CUDA the fabric is ``CudaStreamFabric``: each rank computes on a stream of its own, each
transfer is a copy on the receiving rank's communication stream, ordered after the sender's
stream reached the post (an event) and held back by a GPU sleep; a wait makes the waiting
rank's current stream wait for every copy of its batch (NCCL's ``work.wait()``). Part 1's
gradients on that fabric show every received tensor was used on the current stream only after
its wait. The control here shows the check has teeth: a stream that reads the buffer without
the wait sees the stale data, with the wait the copied data; and one fabric transfer behind a
0.1 s GPU sleep is read correctly through the handle's wait.
"""

from __future__ import annotations

import contextlib

import torch

from bench.gpu_moe import moe_pair_check
from megatron_pp_ext.runtime.transport import RecvRequest
from support.nccl_fabric import NcclRulesFabric


class CudaStreamFabric(NcclRulesFabric):
    """NCCL's rules plus NCCL's stream semantics, on one GPU.

    Each transfer is a copy on the receiving rank's communication stream, ordered after the
    sender's stream reached the post (an event recorded there) and held back by a GPU sleep
    of ``sleep_cycles``; a wait makes the waiting rank's current stream wait for every copy of
    the batch (one Work per batch, as NCCL's ``work.wait()``). A received tensor read on the
    current stream before its wait would read an unfinished copy."""

    def __init__(self, world_size: int, device, sleep_cycles: int = 100_000):
        super().__init__(world_size, device=device)  # nothing is matched before a post
        self.sleep_cycles = sleep_cycles
        self.comm_streams = [torch.cuda.Stream(device=self.device) for _ in range(world_size)]

    def post(self, batch) -> None:  # the rank's host thread: its current stream
        batch.posted = torch.cuda.Event()
        batch.posted.record(torch.cuda.current_stream(self.device))
        super().post(batch)

    def _match(self, pair) -> None:  # a stream thread, under the fabric's lock
        sends, recvs = self.sends[pair], self.recvs[pair]
        while sends and recvs:
            send, recv = sends.popleft(), recvs.popleft()
            stream = self.comm_streams[recv.batch.rank]
            with torch.cuda.device(self.device), torch.cuda.stream(stream):
                stream.wait_event(send.batch.posted)
                if self.sleep_cycles:
                    torch.cuda._sleep(self.sleep_cycles)
                source = send.tensor.detach()
                recv.received = source.clone()
                source.record_stream(stream)  # not reused before the copy has read it
                ready = torch.cuda.Event()
                ready.record(stream)
            send.ready = recv.ready = ready
            self._complete(send, recv)

    def wait_batch(self, batch, timeout_s: float) -> None:  # the rank's host thread
        super().wait_batch(batch, timeout_s)
        current = torch.cuda.current_stream(self.device)
        for op in batch.ops:
            current.wait_event(op.ready)
            if op.received is not None:
                op.received.record_stream(current)


@contextlib.contextmanager
def rank_stream(device: torch.device, stream):
    if stream is None:
        yield
        return
    with torch.cuda.device(device), torch.cuda.stream(stream):
        yield


def stream_check(device: torch.device, dtype) -> tuple[bool, str]:
    """Do a consumer stream's reads need the wait? (control: without it, stale data)."""
    cycles = 200_000_000  # ~0.1 s at 2 GHz
    n = 1 << 20
    with torch.cuda.device(device):
        src = torch.full((n,), 7.0, device=device, dtype=dtype)
        dst = torch.zeros(n, device=device, dtype=dtype)
        comm, consumer = torch.cuda.Stream(device=device), torch.cuda.Stream(device=device)
        dst.clone().copy_(src)  # the kernels loaded before the race below
        torch.cuda.synchronize(device)
        with torch.cuda.stream(comm):
            torch.cuda._sleep(5 * cycles)  # ~0.5 s: the host reaches the read long before
            dst.copy_(src)
            ready = torch.cuda.Event()
            ready.record(comm)
        with torch.cuda.stream(consumer):
            early = dst.clone()  # no wait: the copy has not run yet
            consumer.wait_event(ready)
            late = dst.clone()
        torch.cuda.synchronize(device)
        stale, fresh = bool((early == 0).all()), bool((late == 7).all())

        # one transfer through the fabric, its copy behind a 0.1 s sleep, read after the wait
        fabric = CudaStreamFabric(2, device, sleep_cycles=cycles)
        try:
            payload = torch.arange(4096, device=device, dtype=dtype)
            torch.cuda.synchronize(device)
            with torch.cuda.stream(consumer):
                _, handle = fabric.transport(1).exchange(
                    None, RecvRequest(0, (4096,), dtype, device), False)
                fabric.transport(0).exchange((payload, 1), None, False)
                got = handle.wait(10.0).clone()  # read on the consumer stream after the wait
            torch.cuda.synchronize(device)
            through_fabric = bool(torch.equal(got, payload))
        finally:
            fabric.close()
    ok = stale and fresh and through_fabric
    detail = (f"a read without the wait saw {'stale' if stale else 'COPIED (no teeth)'} data, "
              f"after the wait {'the copy' if fresh else 'WRONG data'}; a fabric transfer "
              f"behind a 0.1 s GPU sleep read after its wait: "
              f"{'right' if through_fabric else 'WRONG'}; part 1 ran on this fabric (every "
              "copy on the receiver's stream behind a GPU sleep)")
    return ok, detail


def stream_part(device: torch.device, dtype) -> tuple[str, str]:
    """Part 2's (status, detail): ``stream_check`` and the MoE F&B pair's overlap
    (``bench.gpu_moe``), an exception counted as its failure."""
    results = []
    for check in (lambda: stream_check(device, dtype), lambda: moe_pair_check(device)):
        try:
            results.append(check())
        except Exception as exc:  # noqa: BLE001
            results.append((False, f"{type(exc).__name__}: {exc}"))
    ok = all(passed for passed, _ in results)
    return ("PASS" if ok else "FAIL"), "; ".join(detail for _, detail in results)
