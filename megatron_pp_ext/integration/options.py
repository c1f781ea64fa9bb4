"""The plugin's settings, as ``install()`` takes them."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, fields

ENV_SCHEDULE = "MEGATRON_PP_SCHEDULE"
AUTO = "auto"  # measure the first step(s), then run the fastest schedule that fits
DEFAULT_P2P_TIMEOUT_S = 600.0
SAFE_FRACTION = 0.45  # of the process group's timeout, for each of the plugin's timeouts


@dataclass(frozen=True)
class PipelineOptions:
    schedule: str = "1f1b"
    chunks: int | None = None  # model chunks per rank (interleaved: v; V schedules: 2)
    max_pending_backward: int | None = None  # zb-h1 / zb-h2: bound on pending W's
    microbatch_group_size_per_vp_stage: int | None = None  # interleaved; default from config
    # every wait on a peer; None: derived from the process group's timeout (``timeouts``)
    p2p_timeout_s: float | None = None
    first_step_timeout_s: float | None = None  # the first step (start-up, lazy NCCL init)
    trace: bool = False  # record measured timelines (cheap when off)
    # schedule="auto": measuring steps, and the memory figures when not measured (CPU)
    auto_measure_steps: int = 1
    auto_memory_budget_bytes: float | None = None
    auto_activation_bytes: float | None = None

    def __post_init__(self):
        from ..schedules import get_spec

        if self.schedule != AUTO:
            get_spec(self.schedule)  # unknown names fail here, with the closest suggested
        for name in ("p2p_timeout_s", "first_step_timeout_s"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name}={value} must be > 0 seconds")
        if self.chunks is not None and self.chunks < 1:
            raise ValueError(f"chunks={self.chunks} must be >= 1")
        if self.auto_measure_steps < 1:
            raise ValueError(f"auto_measure_steps={self.auto_measure_steps} must be >= 1")
        if self.max_pending_backward is not None and self.max_pending_backward < 1:
            raise ValueError(f"max_pending_backward={self.max_pending_backward} must be >= 1")

    def timeouts(self, group_timeout_s: float | None) -> tuple[float, float]:
        """(first step, later steps) timeouts of a wait on a peer, in seconds.

        Unset ones are derived from the process group's timeout G so that the plugin's named
        error, and the failure notes it then waits for (up to one more timeout), come before
        NCCL's watchdog aborts the op at G: at most 0.45 G each (later steps also at most 600
        s). Without G: 600 s, the first step 3x that."""
        bound = SAFE_FRACTION * group_timeout_s if group_timeout_s else None
        p2p = self.p2p_timeout_s or (min(DEFAULT_P2P_TIMEOUT_S, bound) if bound
                                      else DEFAULT_P2P_TIMEOUT_S)
        first = self.first_step_timeout_s or (min(3 * p2p, max(p2p, bound)) if bound
                                               else 3 * p2p)
        return first, p2p

    def unsafe_timeouts(self, group_timeout_s: float | None) -> list[str]:
        """The timeouts set above 0.45 x the group's timeout (NCCL's watchdog may then kill
        the process before the plugin's error names the peer), as text; [] if none."""
        if not group_timeout_s:
            return []
        bound = SAFE_FRACTION * group_timeout_s
        return [f"{name}={value:g}" for name, value in (
            ("p2p_timeout_s", self.p2p_timeout_s),
            ("first_step_timeout_s", self.first_step_timeout_s))
            if value is not None and value > bound]

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
