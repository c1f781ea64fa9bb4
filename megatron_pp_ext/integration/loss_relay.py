"""Hand the loss outputs to the last pipeline rank when the last *stage* lives elsewhere.

On the V layout (zb-v, dualpipev) rank 0 holds the last stage and computes the losses, but
Megatron-LM's ``train_step`` reads them on the last pipeline rank. The relay sends the
per-microbatch loss dicts there once per step, so training logs work unchanged.
"""

from __future__ import annotations

import torch.distributed as dist

from ..ir import Schedule


def loss_rank(schedule: Schedule) -> int:
    return schedule.rank_of(schedule.num_stages - 1)


def needs_relay(schedule: Schedule) -> bool:
    return schedule.num_ranks > 1 and loss_rank(schedule) != schedule.num_ranks - 1


def relay_losses(forward_data_store: list, schedule: Schedule, rank: int, pp_group,
                 device) -> list:
    """Returns what this rank should return: the losses on both the computing and the last
    rank, ``[]`` elsewhere."""
    source, target = loss_rank(schedule), schedule.num_ranks - 1
    if rank == source:
        dist.send_object_list([forward_data_store], group=pp_group, group_dst=target,
                              device=device)
        return forward_data_store
    if rank == target:
        received = [None]
        dist.recv_object_list(received, group=pp_group, group_src=source, device=device)
        return received[0]
    return []
