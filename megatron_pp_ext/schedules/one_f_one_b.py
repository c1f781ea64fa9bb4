"""PipeDream-Flush (1F1B), in exactly the order Megatron-Core's
``forward_backward_pipelining_without_interleaving`` executes it."""

from __future__ import annotations

from ..ir import Action, Schedule
from ._common import check_sizes, loop_placement


def build_1f1b(num_ranks: int, num_microbatches: int, chunks: int = 1, forward_only: bool = False,
               split_backward: bool = False, **_options) -> Schedule:
    """Rank r: warmup min(p-1-r, m) forwards, then steady F/B pairs, then cooldown backwards.

    ``split_backward`` writes each B as I then W at once (the same order and arithmetic),
    so a run can time the two halves apart (``schedule="auto"`` measures with it)."""
    check_sizes("1f1b", num_ranks, num_microbatches)
    p, m = num_ranks, num_microbatches
    actions = []
    for rank in range(p):
        if forward_only:
            actions.append([Action(rank, "F", mb) for mb in range(m)])
            continue
        row = one_f_one_b_row(rank, p, m)
        if split_backward:
            row = [half for a in row for half in (
                (Action(a.stage, "I", a.microbatch), Action(a.stage, "W", a.microbatch))
                if a.kind == "B" else (a,))]
        actions.append(row)
    return Schedule("1f1b", m, loop_placement(p, 1), actions,
                    {"forward_only": forward_only, "split_backward": split_backward})


def one_f_one_b_row(rank: int, num_ranks: int, num_microbatches: int) -> list[Action]:
    """Rank ``rank``'s 1F1B list: warmup forwards, steady F/B pairs, cooldown backwards."""
    warmup = min(num_ranks - 1 - rank, num_microbatches)
    steady = num_microbatches - warmup
    row = [Action(rank, "F", mb) for mb in range(warmup)]
    for i in range(steady):
        row.append(Action(rank, "F", warmup + i))
        row.append(Action(rank, "B", i))
    return row + [Action(rank, "B", steady + i) for i in range(warmup)]
