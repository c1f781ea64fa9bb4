"""megatron_pp_ext: pipeline-parallel schedules for Megatron-Core as a drop-in
``forward_backward_func``, with a validator, a cost-model simulator and timelines."""

__version__ = "0.1.0"
