"""Small helpers the schedule builders share: argument checks and placements."""

from __future__ import annotations

from ..ir import FORWARD, Schedule, ScheduleError


def require(condition: bool, schedule: str, message: str) -> None:
    """Reject a builder argument: the message names the values, the rule and the fix."""
    if not condition:
        raise ScheduleError(f"{schedule}: {message}")


def check_sizes(schedule: str, num_ranks: int, num_microbatches: int) -> None:
    require(
        isinstance(num_ranks, int) and num_ranks >= 1,
        schedule,
        f"pipeline size p={num_ranks!r} must be an integer >= 1",
    )
    require(
        isinstance(num_microbatches, int) and num_microbatches >= 1,
        schedule,
        f"num_microbatches m={num_microbatches!r} must be an integer >= 1 "
        "(raise the global batch size or lower the micro-batch size)",
    )


def loop_placement(num_ranks: int, chunks: int) -> tuple[int, ...]:
    """Megatron's layout: chunk c of rank r is stage c*p + r."""
    return tuple(stage % num_ranks for stage in range(num_ranks * chunks))


def v_placement(num_ranks: int) -> tuple[int, ...]:
    """V layout: rank r holds stages r and 2p-1-r (rank 0 holds the first and the last)."""
    return tuple(list(range(num_ranks)) + list(reversed(range(num_ranks))))


def forwards_only(schedule: Schedule) -> Schedule:
    """The run Megatron makes for evaluation: every rank's forwards in the schedule's order
    (dropping the backwards only removes waits, so it cannot deadlock)."""
    return Schedule(schedule.name, schedule.num_microbatches, schedule.stage_to_rank,
                    [[a for a in row if a.kind == FORWARD] for row in schedule.actions],
                    {**schedule.options, "forward_only": True})
