"""The plan a rank logs before the first step of a schedule: who warms up how far, how many
activations each rank will hold, and the bubble the simulator predicts.

    >>> print(plan_text(build_schedule("1f1b", 4, 8), tensor_shape=(1024, 1, 4096),
    ...                 dtype=torch.bfloat16))
"""

from __future__ import annotations

import math

from ..analysis.simulate import CostModel, simulate
from ..schedules.validate import peak_activations
from ..ir import BACKWARD, BACKWARD_INPUT, FORWARD, Schedule


def forwards_before_first_backward(actions) -> int:
    count = 0
    for action in actions:
        if action.kind in (BACKWARD, BACKWARD_INPUT):
            return count
        if action.kind == FORWARD:
            count += 1
    return count


def warmup_counts(schedule: Schedule) -> list[int | None]:
    """Forwards each rank runs before its steady state: the forwards before its first backward,
    less the one that the steady state pairs with that backward (Megatron's
    ``num_warmup_microbatches``: p-1-r for 1F1B). ``None`` for a rank that runs no backward
    (forward-only)."""
    counts = []
    for row in schedule.actions:
        has_backward = any(a.kind in (BACKWARD, BACKWARD_INPUT) for a in row)
        counts.append(max(0, forwards_before_first_backward(row) - 1) if has_backward else None)
    return counts


def tensor_bytes(tensor_shape, dtype) -> int | None:
    """Bytes of one pipeline tensor (shape x dtype size), or None when either is unknown."""
    if tensor_shape is None or dtype is None:
        return None
    itemsize = getattr(dtype, "itemsize", None)
    if itemsize is None:  # a name such as "bfloat16"
        import torch

        itemsize = getattr(torch, str(dtype).replace("torch.", "")).itemsize
    return int(math.prod(int(d) for d in tensor_shape)) * int(itemsize)


def _human(num_bytes: int) -> str:
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{num_bytes} B"


def plan_text(schedule: Schedule, tensor_shape=None, dtype=None) -> str:
    """What ``schedule`` will do, per rank, in a few lines (logged at INFO before its first
    step): schedule, p, m, v; each rank's stages, warmup forwards and predicted peak of held
    activations (and their bytes as pipeline tensors, when the shape and dtype are known: a
    lower bound, the layers inside a stage keep more per microbatch); and the bubble the
    simulator predicts with unit costs (t_F = t_I = t_W = 1, t_B = 2, no message time)."""
    p, m, v = schedule.num_ranks, schedule.num_microbatches, schedule.chunks
    warmups = warmup_counts(schedule)
    peaks = peak_activations(schedule)
    per_tensor = tensor_bytes(tensor_shape, dtype)
    lines = [
        f"pipeline plan: schedule {schedule.name}, p={p} pipeline ranks, m={m} microbatches, "
        f"v={v} model chunk(s) per rank ({schedule.num_stages} stages)"
    ]
    if per_tensor is not None:
        lines.append(f"one pipeline tensor: shape {tuple(int(d) for d in tensor_shape)} x "
                     f"{str(dtype).replace('torch.', '')} = {_human(per_tensor)}")
    header = f"{'rank':>4}  {'stages':<10}  {'warmup F':>8}  {'peak activations':>16}"
    if per_tensor is not None:
        header += f"  {'peak bytes':>12}"
    lines.append(header)
    for rank in range(p):
        stages = ",".join(str(s) for s in schedule.stages_of(rank))
        warmup = "-" if warmups[rank] is None else str(warmups[rank])
        line = f"{rank:>4}  {stages:<10}  {warmup:>8}  {peaks[rank]:>16}"
        if per_tensor is not None:
            line += f"  {_human(peaks[rank] * per_tensor):>12}"
        lines.append(line)
    predicted = simulate(schedule, CostModel(), validate=False)
    lines.append(
        f"predicted bubble: {100 * predicted.bubble_fraction:.2f}% (unit costs t_F=t_I=t_W=1, "
        f"t_B=2, no message time; makespan {predicted.makespan:g} t)"
    )
    return "\n".join(lines)


__all__ = ["plan_text", "warmup_counts", "forwards_before_first_backward", "tensor_bytes"]
