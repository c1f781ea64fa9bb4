"""Schedule builders and their registry.

Each builder is a pure function ``(num_ranks, num_microbatches, chunks, **options) -> Schedule``;
the registry states each one's layout and constraints, and ``build_schedule`` validates
every schedule it returns.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Callable

from ..ir import Schedule, ScheduleError
from .dualpipev import build_dualpipev
from .gpipe import build_gpipe
from .interleaved import build_interleaved
from .one_f_one_b import build_1f1b
from .zero_bubble import build_zb_h1, build_zb_h2
from .zb_v import build_zb_v


@dataclass(frozen=True)
class ScheduleSpec:
    name: str
    builder: Callable[..., Schedule]
    layout: str  # "loop" (chunk c of rank r is stage c*p+r) or "v" (rank r: stages r, 2p-1-r)
    default_chunks: int
    split_backward: bool  # uses I/W actions
    constraints: str  # what the builder demands, in words

    def allowed_chunks(self, chunks: int) -> bool:
        if self.layout == "v":
            return chunks == 2
        if self.name == "interleaved":
            return chunks >= 2
        return chunks == 1


REGISTRY: dict[str, ScheduleSpec] = {
    spec.name: spec
    for spec in (
        ScheduleSpec("gpipe", build_gpipe, "loop", 1, False, "any p >= 1, m >= 1; v = 1"),
        ScheduleSpec("1f1b", build_1f1b, "loop", 1, False, "any p >= 1, m >= 1; v = 1"),
        ScheduleSpec(
            "interleaved", build_interleaved, "loop", 2, False,
            "v >= 2; p <= microbatch_group_size_per_vp_stage (default p) <= m; "
            "m mod group is 0 or >= p",
        ),
        ScheduleSpec("zb-h1", build_zb_h1, "loop", 1, True,
                     "any p >= 1, m >= 1; v = 1; max_pending_backward >= 1 (default p)"),
        ScheduleSpec("zb-h2", build_zb_h2, "loop", 1, True,
                     "any p >= 1, m >= 1; v = 1; max_pending_backward >= 1 (default 2p-1)"),
        ScheduleSpec("zb-v", build_zb_v, "v", 2, True, "v = 2 (V layout); any p >= 1, m >= 1"),
        ScheduleSpec("dualpipev", build_dualpipev, "v", 2, True,
                     "v = 2 (V layout); any p >= 1, m >= 1 (m < 2p: the order for 2p "
                     "microbatches, cut to m); match_dualpipe=True: DualPipe's own order"),
    )
}


def schedule_names() -> list[str]:
    return list(REGISTRY)


def get_spec(name: str) -> ScheduleSpec:
    if name not in REGISTRY:
        close = difflib.get_close_matches(name, REGISTRY, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ScheduleError(
            f"unknown schedule {name!r}: choose one of {', '.join(REGISTRY)}.{hint}"
        )
    return REGISTRY[name]


def build_schedule(name: str, num_ranks: int, num_microbatches: int, chunks: int | None = None,
                   validate: bool = True, **options) -> Schedule:
    """Build a registered schedule and validate it before anyone runs it."""
    spec = get_spec(name)
    chunks = spec.default_chunks if chunks is None else chunks
    if not spec.allowed_chunks(chunks):
        rule = {"v": "exactly 2 (the V layout)", "loop": "1"}[spec.layout]
        if name == "interleaved":
            rule = ">= 2"
        raise ScheduleError(
            f"{name}: chunks v={chunks} is not allowed; v must be {rule} "
            f"(constraints: {spec.constraints})"
        )
    schedule = spec.builder(num_ranks, num_microbatches, chunks=chunks, **options)
    if validate:
        from ..analysis.validate import validate_schedule

        validate_schedule(schedule)
    return schedule
