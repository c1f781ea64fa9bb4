"""``install()`` / ``uninstall()``: make Megatron-Core run our schedules.

Megatron picks its schedule in ``schedules.get_forward_backward_func`` by looking up
``forward_backward_pipelining_without_interleaving`` / ``..._with_interleaving`` among that
module's globals, and ``megatron.training.training`` binds ``get_forward_backward_func`` at
import time. So we replace the two pipelined schedule functions wherever they are bound
(every loaded ``megatron`` module): every caller of ``get_forward_backward_func()`` then gets
ours whenever pp > 1, and Megatron's own ``forward_backward_no_pipelining`` at pp = 1.
"""

from __future__ import annotations

import sys

from .forward_backward import STATE, forward_backward_pipelining
from .options import PipelineOptions

_REPLACED_NAMES = (
    "forward_backward_pipelining_without_interleaving",
    "forward_backward_pipelining_with_interleaving",
)
_patched: list[tuple[object, str, object]] = []  # (module, attribute, original)


def install(schedule: str | None = None, **options) -> PipelineOptions:
    """Run ``schedule`` (default: $MEGATRON_PP_SCHEDULE, else '1f1b') for every pipelined
    step of Megatron-Core. Options: chunks, max_pending_backward,
    microbatch_group_size_per_vp_stage, p2p_timeout_s, first_step_timeout_s, trace."""
    active = PipelineOptions.from_kwargs(schedule, **options)
    STATE.activate(active)
    if not _patched:
        _patch_megatron()
    return active


def uninstall() -> None:
    """Put every replaced name back."""
    while _patched:
        module, name, original = _patched.pop()
        setattr(module, name, original)


def installed() -> bool:
    return bool(_patched)


def _patch_megatron() -> None:
    from megatron.core.pipeline_parallel import schedules

    originals = {getattr(schedules, name) for name in _REPLACED_NAMES}
    for module_name, module in list(sys.modules.items()):
        if module is None or not module_name.startswith("megatron"):
            continue
        for name, value in list(vars(module).items()):
            if callable(value) and any(value is original for original in originals):
                _patched.append((module, name, value))
                setattr(module, name, forward_backward_pipelining)


def install_from_env() -> bool:
    """Install when $MEGATRON_PP_SCHEDULE names a schedule (for unmodified scripts)."""
    import os

    from .options import ENV_SCHEDULE

    if os.environ.get(ENV_SCHEDULE):
        install()
        return True
    return False
