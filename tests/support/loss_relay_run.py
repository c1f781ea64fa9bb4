"""Spawn target: the V layout's loss relay between pipeline rank 0 (the loss rank) and the last
rank, with Megatron's parallel state (pp = world size), two steps. The last rank posts its
receive of a step only after rank 0 has said, through the rendezvous store, that its relay of
that step returned: a relay whose send waits for the receive never returns and the run times
out. No clock decides anything."""

from __future__ import annotations

import datetime

import torch


def run_relay(rank: int, world_size: int) -> dict:
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_pp_ext.integration.loss_relay import _IN_FLIGHT, relay_group, relay_losses
    from megatron_pp_ext.schedules import build_schedule
    from megatron_pp_ext.train.processes import init_megatron

    init_megatron(pp_size=world_size, vp_size=2)
    schedule = build_schedule("zb-v", world_size, 4, 2)
    pp_group = parallel_state.get_pipeline_model_parallel_group()
    store = dist.distributed_c10d._get_default_store()
    last = world_size - 1
    out = {"received": [], "in_flight": [], "group_ranks": None}
    for step in range(2):
        losses = [{"lm loss": torch.tensor([float(step), 10.0 + mb])} for mb in range(4)]
        if rank == last:
            store.wait([f"relay-returned-{step}"], datetime.timedelta(seconds=60))
        got = relay_losses(losses if rank == 0 else [], schedule, rank, pp_group,
                           torch.device("cpu"), step, timeout_s=60)
        if rank == 0:
            store.set(f"relay-returned-{step}", "1")
            out["in_flight"].append([sent.step for sent in _IN_FLIGHT])
        if rank == last:
            out["received"].append([{k: v.tolist() for k, v in d.items()} for d in got])
        if rank in (0, last):
            out["group_ranks"] = dist.get_process_group_ranks(relay_group(schedule, pp_group))
    dist.barrier()
    return out
