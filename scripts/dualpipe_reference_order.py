"""Record the compute order of DeepSeek's own ``DualPipe.step`` (deepseek-ai/DualPipe), rank
by rank, for tests/data/dualpipe_reference_orders.json: what tests/test_dualpipe.py compares
``dualpipe``'s builder with.

    git clone https://github.com/deepseek-ai/DualPipe /tmp/DualPipe   # or any checkout
    .venv/bin/python scripts/dualpipe_reference_order.py /tmp/DualPipe \
        --out tests/data/dualpipe_reference_orders.json

Their ``step`` runs unchanged on one process per (p, rank): only the methods that compute or
communicate are replaced by recorders. A recorder does what the original does to the
step's bookkeeping (the phase of the rank's second half flipped to a direction, the
per-direction chunk counters, the FIFO of deferred weight gradients) and writes the action,
so the order is the one their loops produce. Nothing of their code is copied here; it is
imported from the checkout given.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections import deque
from pathlib import Path


def record(dualpipe_cls, p: int, m: int, rank: int) -> list[str]:
    """Rank ``rank``'s actions as ``"{F|B|I|W} {direction} {chunk}"``: direction 0 runs from
    rank 0 to rank p-1, direction 1 back; chunk: the microbatch's index in its direction."""
    import torch

    pipe = dualpipe_cls.__new__(dualpipe_cls)
    torch.nn.Module.__init__(pipe)
    pipe.num_ranks, pipe.rank = p, rank
    pipe.is_first_rank, pipe.is_last_rank = rank == 0, rank == p - 1
    pipe.is_in_second_half = rank >= p // 2
    pipe.is_middle_rank = rank in (p // 2 - 1, p // 2)
    pipe.overlapped_forward_backward, pipe.batch_dim = False, 0
    out: list[str] = []
    deferred: deque = deque()
    counters = {"F": [0, 0], "B": [0, 0]}

    def take(kind: str, phase: int) -> tuple[int, int]:
        direction = phase ^ pipe.is_in_second_half
        chunk = counters[kind][direction]
        counters[kind][direction] += 1
        return direction, chunk

    def forward(phase):
        direction, chunk = take("F", phase)
        out.append(f"F {direction} {chunk}")
        pipe.loss_chunks.append(torch.zeros(()))  # what step stacks at its end

    def backward(phase, enable_zb=False):
        direction, chunk = take("B", phase)
        out.append(f"{'I' if enable_zb else 'B'} {direction} {chunk}")
        if enable_zb:
            deferred.append((direction, chunk))

    def forward_backward(phase0, phase1):
        forward(phase0)
        backward(phase1)

    def weight():
        direction, chunk = deferred.popleft()
        out.append(f"W {direction} {chunk}")

    pipe._forward_compute_chunk = forward
    pipe._backward_compute_chunk = backward
    pipe._forward_backward_compute_chunk = forward_backward
    pipe._weight_chunk = weight
    for name in ("_recv_forward", "_send_forward", "_recv_backward", "_send_backward",
                 "_commit_and_wait_comm", "_free_tensors"):
        setattr(pipe, name, lambda *args, **kwargs: None)
    import dualpipe.comm as comm
    comm.TENSOR_SHAPES, comm.TENSOR_DTYPE = [(1,)], torch.float32
    pipe.step(num_chunks=m, criterion=lambda *args: None)
    assert not deferred, f"p={p} m={m} rank {rank}: W's owed at the end"
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkout", type=Path, help="a checkout of deepseek-ai/DualPipe")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    sys.path.insert(0, str(args.checkout))
    from dualpipe import DualPipe

    commit = subprocess.run(["git", "-C", str(args.checkout), "rev-parse", "HEAD"],
                            capture_output=True, text=True).stdout.strip() or "unknown"
    orders = {}
    for p in (2, 4, 6, 8):
        for m in sorted({2 * p, 2 * p + 2, 3 * p + (3 * p) % 2, 4 * p}):
            orders[f"p{p}_m{m}"] = [record(DualPipe, p, m, rank) for rank in range(p)]
    data = {"source": f"deepseek-ai/DualPipe {commit}, dualpipe/dualpipe.py DualPipe.step",
            "recorded_by": "scripts/dualpipe_reference_order.py",
            "action": "'{F|B|I|W} {direction} {chunk}': direction 0 from rank 0 to p-1, 1 back; "
                      "chunk: the microbatch's index within its direction",
            "orders": orders}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(data, indent=0) + "\n")
    print(f"{len(orders)} (p, m) pairs written to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
