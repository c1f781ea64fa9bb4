"""Reproduce, with torch alone (no Megatron, no plugin), the race in Megatron-LM's
test_schedules.py helper ``_populate_embedding_and_position_groups``: every rank calls
``dist.new_group`` but the two pipelines of tp=2 x pp=4 pass DIFFERENT rank lists
([0, 6] on pipeline {0,2,4,6}, [1, 7] on pipeline {1,3,5,7}). torch names a group by a
per-process counter (``str(_world.group_count)``), so both calls create a group with the same
name, and gloo's connection rendezvous keys (``<name>/rank_<group rank>``) in the shared store
collide: a rank can read the other pipeline's address and connect to the wrong process (a
hang, or a collective that mixes the two pipelines' data).

    .venv/bin/python tests_megatron_lm/peer_schedules/new_group_race.py [--iters 30] [--world 4]

``--control``: every rank creates both pairs' groups in the same order (torch's rule); no
failure is expected. Each iteration: all ranks call new_group with their pipeline's [first, last] pair, all-reduce
their global rank over it, and check the sum. Prints per iteration failures; exit 1 if any.
"""

from __future__ import annotations

import argparse
import datetime
import os
import random
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def worker(rank: int, world: int, port: int, iters: int, tp: int, control: bool, q) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=15))
    pipeline = [r for r in range(world) if r % tp == rank % tp]  # tp-fastest, like Megatron
    pair = [pipeline[0], pipeline[-1]]
    bad = []
    rng = random.Random(rank)
    for i in range(iters):
        time.sleep(rng.random() * 0.02)  # the pipelines reach the call at different times
        try:
            if control:  # torch's rule: every rank creates every group, in the same order
                pairs = [[p[0], p[-1]] for p in
                         ([r for r in range(world) if r % tp == t] for t in range(tp))]
                group = [dist.new_group(ranks=pr) for pr in pairs][rank % tp]
            else:
                group = dist.new_group(ranks=pair)  # what the Megatron-LM test helper does
            if rank in pair:
                t = torch.tensor([float(rank)])
                dist.all_reduce(t, group=group)
                if t.item() != float(sum(pair)):
                    bad.append(f"iter {i} rank {rank}: all_reduce over {pair} gave {t.item()}, "
                               f"expected {sum(pair)} (connected to the other pipeline)")
        except Exception as exc:  # noqa: BLE001
            bad.append(f"iter {i} rank {rank}: {type(exc).__name__}: "
                       f"{' '.join(str(exc).split())[:200]}")
            break
    q.put((rank, bad))
    q.close()
    q.join_thread()  # the result is out before the process ends
    os._exit(0)  # a rank left connected to the wrong peer must not block the exit


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--control", action="store_true",
                        help="create both pipelines' groups on every rank (torch's rule)")
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, args.world, port, args.iters, args.tp, args.control, q))
             for r in range(args.world)]
    for p in procs:
        p.start()
    results = {}
    deadline = time.monotonic() + 60 + 3 * args.iters
    while len(results) < args.world and time.monotonic() < deadline:
        try:
            rank, bad = q.get(timeout=1)
            results[rank] = bad
        except Exception:  # noqa: BLE001
            pass
    for p in procs:
        if p.is_alive():
            p.kill()
    failures = [line for bad in results.values() for line in bad]
    missing = sorted(set(range(args.world)) - set(results))
    for line in failures:
        print(line)
    if missing:
        print(f"ranks {missing} never finished (hung in new_group or its all_reduce)")
    print(f"{'control: ' if args.control else ''}{args.iters} iterations x {args.world} ranks: "
          f"{'RACE SEEN' if failures or missing else 'no failure seen'}")
    return 1 if failures or missing else 0


if __name__ == "__main__":
    sys.exit(main())
