"""The plugin's settings, as ``install()`` takes them.

``schedule`` is a schedule's name (any case, or PyTorch's name for it; stored as the registry's
name), ``auto``, or the path of a schedule file (``.csv`` in PyTorch's compute-only format, or
``.json``): the file is read when the options are made, and its schedule checked then, before
anything is patched or sent: the validator, the layout (loop or V, from its stage-to-rank
mapping), and NCCL's rules (``analysis.lowering.nccl_posting``). Its text travels with the
options (``schedule_text``), so every process runs what was read.
"""

from __future__ import annotations

import functools
import hashlib
import os
from dataclasses import asdict, dataclass, fields

from ..analysis import lowering
from ..ir import ScheduleError
from ..schedules import (SHAPING_OPTIONS, is_schedule_file, parse_schedule_file,
                         read_schedule_file, resolve_schedule, takes_option)

ENV_SCHEDULE = "MEGATRON_PP_SCHEDULE"
DEFAULT_P2P_TIMEOUT_S = 600.0
SAFE_FRACTION = 0.45  # of the process group's timeout, for each of the plugin's timeouts


@dataclass(frozen=True)
class PipelineOptions:
    schedule: str = "1f1b"
    chunks: int | None = None  # model chunks per rank (interleaved: v; V schedules: 2)
    max_pending_backward: int | None = None  # zb-h1 / zb-h2: bound on pending W's
    #: zb-v: chunk-0 forwards before the first chunk-1 input gradient, p (default) to 2p-1
    #: (memory 2 x that in microbatch-chunks; 2p-1 lets consecutive steps overlap)
    warmup_forwards: int | None = None
    microbatch_group_size_per_vp_stage: int | None = None  # interleaved; default from config
    # every wait on a peer; None: derived from the process group's timeout (``timeouts``)
    p2p_timeout_s: float | None = None
    first_step_timeout_s: float | None = None  # the first step (start-up, lazy NCCL init)
    trace: bool = False  # record measured timelines (cheap when off)
    #: with ``trace``: write each step's measured timeline as a Chrome trace to
    #: ``trace_dir/pp_trace.json`` on pipeline rank 0 (``select --costs`` reads it)
    trace_dir: str | None = None
    #: measure activation bytes (runtime/memory.py) every step; None: on the traced steps and
    #: auto's measuring steps only (the graph walk costs host time on every F)
    memory: bool | None = None
    # schedule="auto": measuring steps, and the memory figures when not measured (CPU)
    auto_measure_steps: int = 1
    auto_memory_budget_bytes: float | None = None
    auto_activation_bytes: float | None = None
    #: a schedule file's text (``schedule`` is then its path); read from the file when None
    schedule_text: str | None = None
    #: wrap the optimizer Megatron-LM builds (``get_megatron_optimizer``) in a
    #: ``post_validation.PostValidatedOptimizer``: each rank steps before the global grad norm
    #: and found-inf arrive, and rolls back exactly when they say otherwise
    post_validate: bool = False
    #: replace Megatron-LM's ``train_step`` with ``run_ahead_step.RunAheadTrainStep``: each
    #: rank starts its next step before this one is validated (needs ``post_validate``)
    run_ahead: bool = False

    def __post_init__(self):
        if is_schedule_file(self.schedule):
            self._check_schedule_file()
        elif self.schedule_text is not None:
            raise ValueError(f"schedule_text is the text of a schedule file: give the file's "
                             f"path (.csv or .json) as the schedule, not {self.schedule!r}")
        else:  # unknown names fail here, with the closest suggested
            object.__setattr__(self, "schedule", resolve_schedule(self.schedule))
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
        for option, value in self.builder_options().items():
            # auto refuses them too: it switches schedules
            if not takes_option(self.schedule, option):
                takers = SHAPING_OPTIONS[option]
                raise ValueError(
                    f"{option}={value} shapes {' and '.join(takers)} only, and {self.schedule} "
                    f"would ignore it: drop it or use schedule="
                    f"{' or '.join(repr(t) for t in takers)}")
        if self.run_ahead and not self.post_validate:
            raise ValueError("run_ahead=True starts the next step before this one is "
                             "validated, which needs the post-validated optimizer step: add "
                             "post_validate=True (Megatron-LM: --pp-post-validate)")

    # ---- schedule files
    @property
    def is_file(self) -> bool:
        return self.schedule_text is not None

    def file_schedule(self, forward_only: bool = False):
        """The schedule file's ``Schedule`` (None for a named schedule), validated and checked
        against NCCL's rules; ``forward_only``: its forwards only (evaluation steps)."""
        if self.schedule_text is None:
            return None
        return _checked_file_schedule(self.schedule_text, self.schedule, forward_only)

    def _check_schedule_file(self) -> None:
        if self.schedule_text is None:
            object.__setattr__(self, "schedule_text", read_schedule_file(self.schedule))
        schedule = self.file_schedule()
        builder_only = list(self.builder_options())
        if builder_only:
            raise ValueError(
                f"{', '.join(builder_only)} shape a built schedule, but the schedule file "
                f"{self.schedule} fixes every rank's order: drop {' and '.join(builder_only)}")
        if self.chunks is not None and self.chunks != schedule.chunks:
            raise ValueError(
                f"chunks={self.chunks}, but the schedule file {self.schedule} places "
                f"{schedule.chunks} stage(s) on each rank: drop chunks (the file decides)")

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
        # the registry's shaping options that are fields here (match_dualpipe is offered by
        # the builder's Python API only)
        return {option: getattr(self, option) for option in SHAPING_OPTIONS
                if getattr(self, option, None) is not None}

    def to_dict(self) -> dict:
        """The options as plain values; a schedule file's text as its SHA-256 (16 hex digits),
        so ranks that read different files disagree without printing them."""
        data = asdict(self)
        text = data.pop("schedule_text")
        if text is not None:
            data["schedule_sha256"] = hashlib.sha256(text.encode()).hexdigest()[:16]
        return data

    @staticmethod
    def from_kwargs(schedule: str | None = None, **kwargs) -> "PipelineOptions":
        known = {f.name for f in fields(PipelineOptions)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"unknown option(s) {unknown}; known: {sorted(known - {'schedule'})}")
        schedule = schedule or os.environ.get(ENV_SCHEDULE) or "1f1b"
        return PipelineOptions(schedule=schedule, **{k: v for k, v in kwargs.items()
                                                     if v is not None})


@functools.lru_cache(maxsize=32)
def _checked_file_schedule(text: str, path: str, forward_only: bool):
    """Parse and validate a schedule file (``schedules.parse_schedule_file``), then check that
    the executor's P2P program for it passes NCCL's rules (``analysis.lowering.nccl_posting``:
    Megatron's fused calls, else one batch per round); raises ``ScheduleError`` naming the
    file otherwise. Cached per text: the same ``Schedule`` object each time."""

    schedule = parse_schedule_file(text, path, forward_only)
    try:
        lowering.nccl_posting(schedule)
    except ScheduleError as exc:
        raise ScheduleError(
            f"schedule file {path} could hang on NCCL (no P2P program for it passes NCCL's "
            f"rules): {exc}") from None
    return schedule
