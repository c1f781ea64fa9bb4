"""dualpipe's two copies of every model part: one gradient, one norm.

Rank r holds part r (chunk 0) and a copy of part p-1-r (chunk 1), and rank p-1-r the same two
parts the other way round, so every part is held by exactly one pair of ranks, once on each.
Each copy's gradient covers the microbatches of its direction only; 1F1B's covers all of
them. :func:`sum_stage_copies` gives both copies the sum, after Megatron's
``finalize_model_grads`` (data-parallel reduction, tied-embedding sum), once per step: one
exchange per rank pair, every gradient buffer of both parts in one batch, in part order on
both sides (NCCL matches a pair's messages in order), each side adding the other's to its own
(a + b on one side, b + a on the other: the same bits). With the distributed optimizer each
data-parallel rank's shard is already reduced and the pair's shards line up (the two copies
build the same buffers), so the whole buffer is summed and the shard is what the optimizer
reads. Both copies start equal (the model provider), get equal gradients and take equal
optimizer steps, so they stay equal.

:func:`mark_copies` marks chunk 1's parameters as Megatron marks the tied output layer's copy
of the embedding (``shared``): Megatron's grad norm and zero count skip them, so every part
counts once, as under 1F1B.
"""

from __future__ import annotations

import torch

from ..ir import Schedule
from ..runtime.errors import PipelineTimeoutError
from ..runtime.transport import RecvRequest, TransportTimeout


def mark_copies(model) -> None:
    """Megatron's grad norm (``param_is_not_shared``) leaves these parameters out."""
    for param in model.parameters():
        param.shared = True


def gradient_tensors(chunk) -> list[torch.Tensor]:
    """A chunk's gradients: Megatron DDP's grad buffers (dense and expert), else each
    parameter's ``main_grad`` or ``grad``."""
    buffers = [*(getattr(chunk, "buffers", None) or ()),
               *(getattr(chunk, "expert_parallel_buffers", None) or ())]
    if buffers:
        return [buffer.grad_data for buffer in buffers]
    grads = []
    for param in chunk.parameters():
        grad = getattr(param, "main_grad", None)
        grads.append(param.grad if grad is None else grad)
    return [grad for grad in grads if grad is not None]


def partner_of(schedule: Schedule, rank: int) -> int:
    """The rank holding the other copy of this rank's parts."""
    return schedule.num_ranks - 1 - rank


def sum_stage_copies(models, schedule: Schedule, rank: int, transport,
                     timeout_s: float) -> None:
    """Both copies of each of this rank's parts get their summed gradient (see the module)."""
    if schedule.second_direction_from is None:
        return
    partner = partner_of(schedule, rank)
    by_part = sorted(zip((schedule.model_stage(s) for s in schedule.stages_of(rank)), models),
                     key=lambda pair: pair[0])
    own = [grad for _, chunk in by_part for grad in gradient_tensors(chunk)]
    sends = [(grad, partner) for grad in own]
    recvs = [RecvRequest(partner, tuple(grad.shape), grad.dtype, grad.device) for grad in own]
    send_handles, recv_handles = transport.exchange_many(sends, recvs, variable_shapes=False)
    pending = "exchange of the stage copies' gradients (dualpipe)"
    try:
        received = [handle.wait(timeout_s) for handle in recv_handles]
        for handle in send_handles:
            handle.wait(timeout_s, transport.poll)
    except TransportTimeout:
        raise PipelineTimeoutError(rank, partner, pending, timeout_s, []) from None
    for grad, other in zip(own, received):
        grad.add_(other)
