"""Interleaved 1F1B (Megatron's virtual pipeline), in exactly the order Megatron-Core 0.19.2's
``forward_backward_pipelining_with_interleaving`` executes it.

Chunk c of rank r is stage c*p + r. Megatron walks a table of (microbatch, chunk) pairs in
groups of ``microbatch_group_size_per_vp_stage`` microbatches (default p): the k-th forward
of a rank runs table[k]; the k-th backward runs the same microbatch on chunk v-1-chunk.
"""

from __future__ import annotations

from ..ir import Action, Schedule
from ._common import check_sizes, loop_placement, require


def interleaved_table(num_microbatches: int, chunks: int, group: int) -> list[tuple[int, int]]:
    """(microbatch, chunk) in the order a rank runs its forwards (Megatron's schedule table)."""
    table = []
    for first in range(0, num_microbatches, group):
        last = num_microbatches if first + group >= num_microbatches else first + group
        table += [(mb, chunk) for chunk in range(chunks) for mb in range(first, last)]
    return table


def build_interleaved(num_ranks: int, num_microbatches: int, chunks: int = 2,
                      microbatch_group_size_per_vp_stage: int | None = None,
                      forward_only: bool = False, **_options) -> Schedule:
    check_sizes("interleaved", num_ranks, num_microbatches)
    p, m, v = num_ranks, num_microbatches, chunks
    require(isinstance(v, int) and v >= 2, "interleaved",
            f"chunks v={v!r} must be >= 2 (use '1f1b' for one chunk per rank)")
    group = p if microbatch_group_size_per_vp_stage is None else microbatch_group_size_per_vp_stage
    require(p <= group <= m, "interleaved",
            f"microbatch_group_size_per_vp_stage={group} must lie in [p={p}, m={m}] "
            f"(Megatron's rule); use m >= p microbatches")
    remainder = m % group
    require(remainder == 0 or remainder >= p, "interleaved",
            f"m={m} mod microbatch_group_size_per_vp_stage={group} is {remainder}: it must be 0 "
            f"or >= p={p} (Megatron's rule); pick m as a multiple of {group}")

    table = interleaved_table(m, v, group)
    total = m * v
    actions = []
    for rank in range(p):
        def forward(k):
            mb, chunk = table[k]
            return Action(chunk * p + rank, "F", mb)

        def backward(k):
            mb, chunk = table[k]
            return Action((v - 1 - chunk) * p + rank, "B", mb)

        if forward_only:
            actions.append([forward(k) for k in range(total)])
            continue
        warmup = min((p - rank - 1) * 2 + (v - 1) * group, total)
        steady = total - warmup
        row = [forward(k) for k in range(warmup)]
        for k in range(steady):
            row += [forward(warmup + k), backward(k)]
        row += [backward(steady + k) for k in range(warmup)]
        actions.append(row)
    return Schedule("interleaved", m, loop_placement(p, v), actions,
                    {"chunks": v, "microbatch_group_size_per_vp_stage": group,
                     "forward_only": forward_only})
