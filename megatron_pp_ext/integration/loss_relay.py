"""Hand the loss outputs (and, for per-token loss, the token count) to the last pipeline rank
when the last *stage* lives elsewhere.

On the V layout (zb-v, dualpipev) rank 0 holds the last stage and computes the losses, but
Megatron-LM's ``train_step`` reads them on the last pipeline rank. The relay sends the
per-microbatch loss dicts there once per step, so training logs work unchanged. Under
dualpipe both rank p-1 (the first direction's microbatches) and rank 0 (the second's) compute
losses: rank 0's are relayed and the last rank returns its own followed by them, in
microbatch order.

The source does not wait for the send: on the V layout rank 0 finishes a step before the last
rank (by p-1 chunk-slots, more with zb-v's longer warm-up), and a blocking send would hold it
there until the last rank posts its receive, every step, which undoes any overlap of
consecutive steps (``integration.run_ahead_step``). It posts the send and waits for it at the
next step's relay (a bounded wait naming the peer), by then long complete. The messages go on
Megatron's embedding group when that group is exactly this pipeline's source and last rank
(always, with Megatron's parallel state): on the V layout the embeddings are untied, so the
group is otherwise idle, and on NCCL a send there does not sit in front of the pipeline
group's next batches on its stream. Without it, on the pipeline group.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from .. import megatron_compat
from ..ir import Schedule
from ..runtime.errors import PipelineTimeoutError


def loss_rank(schedule: Schedule) -> int:
    return schedule.rank_of(schedule.num_stages - 1)


def needs_relay(schedule: Schedule) -> bool:
    return schedule.num_ranks > 1 and loss_rank(schedule) != schedule.num_ranks - 1


@dataclass
class PendingRelay:
    """The source's send of one step, not waited for yet (its tensors and group kept alive)."""

    works: list
    tensors: tuple
    step: int
    group: object

    def done(self) -> bool:
        return all(work.is_completed() for work in self.works)


# This process's sends not yet waited for. Held here, not by a ScheduleFunction's state: a
# caller that drops its function, or Megatron's destroy_model_parallel() dropping the group,
# must not let the group be collected while a send is in flight (gloo would abort it and the
# last rank would wait for losses that never come).
_IN_FLIGHT: list[PendingRelay] = []


def relay_group(schedule: Schedule, pp_group):
    """Megatron's embedding group when it holds exactly this pipeline's loss rank and last rank
    (in that order of pipeline ranks), else ``pp_group``."""
    try:
        from megatron.core import parallel_state

        group = parallel_state.get_embedding_group(check_initialized=False)
    except (ImportError, AttributeError, AssertionError):
        return pp_group
    if group is None:
        return pp_group
    pp_ranks = dist.get_process_group_ranks(pp_group)
    wanted = [pp_ranks[loss_rank(schedule)], pp_ranks[schedule.num_ranks - 1]]
    return group if dist.get_process_group_ranks(group) == wanted else pp_group


def share_token_count(num_tokens: torch.Tensor, schedule: Schedule, pp_group) -> None:
    """Give every pipeline rank the step's token count (in place), for
    ``--calculate-per-token-loss``. Megatron's ``finalize_model_grads`` broadcasts the count
    from the last pipeline rank, which holds 0 when the loss is elsewhere (the V layout's
    rank 0) or part of it (dualpipe: ranks 0 and p-1 each count their direction's), and
    ``clamp(min=1)`` then leaves the gradients undivided or wrongly divided. Only the ranks
    that compute losses count tokens, so the sum over the pipeline group is the step's count;
    after it Megatron's own broadcast sends the right one. All pipeline ranks call it at the
    same point (after the step's last P2P, before finalize), so NCCL sees one collective in
    order."""
    dist.all_reduce(num_tokens, group=pp_group)


def _group_rank(group, pp_group, pp_rank: int) -> int:
    return dist.get_group_rank(group, dist.get_process_group_ranks(pp_group)[pp_rank])


def _wait(works: list, rank: int, peer: int, pending: str, timeout_s: float) -> None:
    """Wait for ``works`` at most ``timeout_s``; a timeout names the rank, peer and action."""
    for work in works:
        try:
            done = work.wait(timeout=timedelta(seconds=timeout_s))
        except RuntimeError:  # gloo raises on timeout
            done = False
        if done is False:
            raise PipelineTimeoutError(rank, peer, pending, timeout_s, [])


def _serialized(forward_data_store: list, device) -> tuple[torch.Tensor, torch.Tensor]:
    buffer = io.BytesIO()
    torch.save(forward_data_store, buffer)
    data = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8).to(device)
    return torch.tensor([data.numel()], dtype=torch.long, device=device), data


def relay_losses(forward_data_store: list, schedule: Schedule, rank: int, pp_group, device,
                 step: int, timeout_s: float) -> list:
    """Returns what this rank should return: the losses on both the computing and the last
    rank (the last rank's own first, dualpipe's), ``[]`` elsewhere. ``step`` names the step
    in a timeout's message."""
    source, target = loss_rank(schedule), schedule.num_ranks - 1
    if rank not in (source, target):
        return []
    group = relay_group(schedule, pp_group)
    if rank == source:
        while _IN_FLIGHT:  # the previous steps' sends: long received, normally
            earlier = _IN_FLIGHT.pop(0)
            _wait(earlier.works, rank, target, f"send of step {earlier.step}'s losses to the "
                  "last pipeline rank (loss relay)", timeout_s)
        size, data = _serialized(forward_data_store, device)
        peer = _group_rank(group, pp_group, target)
        works = [dist.isend(size, group=group, group_dst=peer),
                 dist.isend(data, group=group, group_dst=peer)]
        _IN_FLIGHT.append(PendingRelay(works, (size, data), step, group))
        return forward_data_store
    peer = _group_rank(group, pp_group, source)
    size = torch.zeros(1, dtype=torch.long, device=device)
    what = f"receive of step {step}'s losses from the loss rank (loss relay)"
    _wait([dist.irecv(size, group=group, group_src=peer)], rank, source, what, timeout_s)
    data = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    _wait([dist.irecv(data, group=group, group_src=peer)], rank, source, what, timeout_s)
    relayed = torch.load(io.BytesIO(data.cpu().numpy().tobytes()), map_location=device,
                         weights_only=True)
    return forward_data_store + relayed


def mtp_metrics_before(schedule: Schedule, config) -> dict | None:
    """dualpipe with multi-token prediction: the MTP metrics tracker's values before the
    step (what :func:`share_mtp_metrics` adds this step's to); None where nothing is shared."""
    if schedule.second_direction_from is None or not getattr(config, "mtp_num_layers", None):
        return None
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    tracker = MTPLossLoggingHelper.tracker
    return {key: tracker[key].clone() for key in megatron_compat.mtp_tracker_keys()
            if key in tracker}


def share_mtp_metrics(before: dict | None, config, pp_group, device) -> None:
    """Under dualpipe both loss ranks (p-1: the first direction's microbatches, 0: the
    second's) track MTP losses, and Megatron-LM logs the last rank's: this step's values are
    summed over the pipeline group, so each loss rank's tracker holds the step's whole MTP
    loss (as 1F1B's last rank does). Every pipeline rank calls it at the same point."""
    if before is None:
        return
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    tracker, layers = MTPLossLoggingHelper.tracker, config.mtp_num_layers
    for key in megatron_compat.mtp_tracker_keys():
        current = tracker.get(key)
        base = before.get(key)
        step = (torch.zeros(layers, device=device) if current is None else
                (current - base if base is not None else current.clone()).to(device))
        dist.all_reduce(step, group=pp_group)
        if current is not None:
            current.copy_((base if base is not None else torch.zeros_like(current))
                          + step.to(current.device))
