"""megatron_pp_ext: pipeline-parallel schedules for Megatron-Core as a drop-in
``forward_backward_func``, with a validator, a cost-model simulator and timelines.

The pure parts (IR, builders, validator, simulator) import without torch.distributed or
Megatron; the runtime names below load Megatron only when first used.
"""

__version__ = "0.1.0"

_LAZY = {
    "install": "megatron_pp_ext.integration.install",
    "uninstall": "megatron_pp_ext.integration.install",
    "Installation": "megatron_pp_ext.integration.install",
    "ScheduleFunction": "megatron_pp_ext.integration.forward_backward",
    "PipelineOptions": "megatron_pp_ext.integration.options",
    "PipelineTimeoutError": "megatron_pp_ext.runtime.errors",
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'megatron_pp_ext' has no attribute {name!r}")


__all__ = sorted(_LAZY)
