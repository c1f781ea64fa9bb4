"""Medians with their spread: every figure the bench reports comes with the range it took
over the repeated runs (rounds) behind it."""

from __future__ import annotations

import statistics


def median(values) -> float:
    return statistics.median(list(values))


def quartiles(values) -> tuple[float, float]:
    values = sorted(values)
    if len(values) < 2:
        return values[0], values[0]
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q3


def with_range(values, digits: int = 3, scale: float = 1.0) -> str:
    """``median (min-max)`` of ``values`` times ``scale``, e.g. ``0.823 (0.810-0.836)``."""
    values = [scale * x for x in values]
    if not values:
        return "-"
    text = f"{median(values):.{digits}f}"
    if len(values) > 1:
        text += f" ({min(values):.{digits}f}-{max(values):.{digits}f})"
    return text


def ms_range(seconds, digits: int = 1) -> str:
    return with_range(seconds, digits, scale=1e3)
