"""GPipe: every forward, then every backward (in forward order, so the FIFO of saved
activations and the messages between ranks keep one order)."""

from __future__ import annotations

from ..ir import Action, Schedule
from ._common import check_sizes, loop_placement


def build_gpipe(num_ranks: int, num_microbatches: int, chunks: int = 1, forward_only: bool = False,
                **_options) -> Schedule:
    check_sizes("gpipe", num_ranks, num_microbatches)
    p, m = num_ranks, num_microbatches
    actions = []
    for rank in range(p):
        row = [Action(rank, "F", mb) for mb in range(m)]
        if not forward_only:
            row += [Action(rank, "B", mb) for mb in range(m)]
        actions.append(row)
    return Schedule("gpipe", m, loop_placement(p, 1), actions, {"forward_only": forward_only})
