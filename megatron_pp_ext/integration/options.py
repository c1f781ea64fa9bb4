"""The plugin's settings, as ``install()`` takes them."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, fields

ENV_SCHEDULE = "MEGATRON_PP_SCHEDULE"
AUTO = "auto"  # measure the first step(s), then run the fastest schedule that fits


@dataclass(frozen=True)
class PipelineOptions:
    schedule: str = "1f1b"
    chunks: int | None = None  # model chunks per rank (interleaved: v; V schedules: 2)
    max_pending_backward: int | None = None  # zb-h1 / zb-h2: bound on pending W's
    microbatch_group_size_per_vp_stage: int | None = None  # interleaved; default from config
    p2p_timeout_s: float = 600.0  # every wait on a peer
    first_step_timeout_s: float | None = None  # the first step (start-up, lazy NCCL init): 3x
    trace: bool = False  # record measured timelines (cheap when off)
    # schedule="auto": measuring steps, and the memory figures when not measured (CPU)
    auto_measure_steps: int = 1
    auto_memory_budget_bytes: float | None = None
    auto_activation_bytes: float | None = None

    def __post_init__(self):
        from ..schedules import get_spec

        if self.schedule != AUTO:
            get_spec(self.schedule)  # unknown names fail here, with the closest suggested
        if self.p2p_timeout_s <= 0:
            raise ValueError(f"p2p_timeout_s={self.p2p_timeout_s} must be > 0 seconds")
        if self.chunks is not None and self.chunks < 1:
            raise ValueError(f"chunks={self.chunks} must be >= 1")
        if self.auto_measure_steps < 1:
            raise ValueError(f"auto_measure_steps={self.auto_measure_steps} must be >= 1")
        if self.max_pending_backward is not None and self.max_pending_backward < 1:
            raise ValueError(f"max_pending_backward={self.max_pending_backward} must be >= 1")

    @property
    def first_timeout_s(self) -> float:
        return self.first_step_timeout_s or 3 * self.p2p_timeout_s

    def builder_options(self) -> dict:
        """What the schedule builder takes (beyond p, m, v)."""
        options = {}
        if self.max_pending_backward is not None:
            options["max_pending_backward"] = self.max_pending_backward
        if self.microbatch_group_size_per_vp_stage is not None:
            options["microbatch_group_size_per_vp_stage"] = self.microbatch_group_size_per_vp_stage
        return options

    def to_dict(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_kwargs(schedule: str | None = None, **kwargs) -> "PipelineOptions":
        known = {f.name for f in fields(PipelineOptions)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"unknown option(s) {unknown}; known: {sorted(known - {'schedule'})}")
        schedule = schedule or os.environ.get(ENV_SCHEDULE) or "1f1b"
        return PipelineOptions(schedule=schedule, **{k: v for k, v in kwargs.items()
                                                     if v is not None})
