"""The expert groups' collectives, agreed before the first step (``analysis.collectives``).

A Megatron MoE model's forward and backward issue all-to-alls on the expert-model-parallel
group, whose ranks hold the same pipeline stage in different data-parallel replicas. Before the
first step of each schedule the ranks of that group all-gather a fingerprint of the sequence
their program issues there (one int64 per rank); on a mismatch every rank raises the same
``ValueError`` naming the ranks and the first collective where they part, before any
point-to-point byte moves. Costs one small all-gather on the expert group, once.
"""

from __future__ import annotations

from megatron.core import parallel_state
from megatron.core.transformer.moe.moe_layer import MoELayer

from ..analysis.collectives import (
    EXPERT,
    issued,
    moe_collectives,
    sequence_difference,
    with_collectives,
)
from ..ir import Schedule
from ..program import Program
from . import agreement


def moe_layers_by_stage(models, schedule: Schedule, rank: int) -> dict[int, int]:
    """{stage: number of Megatron MoE layers in the chunk that holds it on this rank}."""
    return {stage: sum(isinstance(m, MoELayer) for m in chunk.modules())
            for stage, chunk in zip(schedule.stages_of(rank), models)}


def expert_group(pg_collection):
    """The expert-model-parallel group when it has more than one rank, else None."""
    group = getattr(pg_collection, "ep", None)
    if group is None:
        group = parallel_state.get_expert_model_parallel_group(check_initialized=False)
    return group if group is not None and group.size() > 1 else None


def check_expert_group(program: Program, schedule: Schedule, rank: int, models, config,
                       pg_collection, device, timeout_s: float, polled: bool) -> None:
    """Raise ``ValueError`` on every rank of an expert group whose ranks would issue its
    collectives in different orders (``program`` with the MoE collectives recorded, this
    rank's sequence against the others')."""
    per_action = moe_collectives(moe_layers_by_stage(models, schedule, rank),
                                 getattr(config, "moe_token_dispatcher_type", "alltoall"))
    group = expert_group(pg_collection) if per_action else None
    if group is None:
        return
    sequence = tuple(issued(with_collectives(program, per_action), rank))
    agreement.check_agreement(
        {"collectives": sequence}, group, group.rank(), device, timeout_s=timeout_s,
        polled=polled, purpose="the order of their collectives", who="expert-group",
        describe=_describe)


def _describe(values_by_rank: list[dict], global_ranks: list[int] | None) -> str:
    """The error: the first collective where two ranks of the group part (global ranks)."""
    names = global_ranks or list(range(len(values_by_rank)))
    sequences = {names[r]: values["collectives"] for r, values in enumerate(values_by_rank)}
    return sequence_difference(sequences, EXPERT) or "the expert group's fingerprints differ"
