"""Regressions found by running Megatron-LM's own tests/unit_tests/pipeline_parallel/
test_schedules.py with the plugin installed (docs/megatron-lm-peer-tests.md). These run
without a Megatron-LM checkout: they call the drop-in as those tests do.

Megatron's interleaved schedule raises RuntimeError when the last microbatch group is shorter
than p (m=7 at p=4), and checks that before it reads the data iterators;
test_forward_backward_func_with_interleaving and ..._with_uneven_interleaving expect
``pytest.raises(RuntimeError)`` for exactly that call (the second with one iterator for two
chunks).
"""

from types import SimpleNamespace

import pytest
import torch

from megatron_pp_ext.integration.forward_backward import (
    MicrobatchGroupError,
    RunState,
    run_step,
    schedule_for,
)
from megatron_pp_ext.integration.options import PipelineOptions


def _group(size: int, rank: int = 0):
    return SimpleNamespace(size=lambda: size, rank=lambda: rank)


def _chunk():
    from megatron.core import ModelParallelConfig

    model = torch.nn.Linear(4, 1)
    model.config = ModelParallelConfig(pipeline_model_parallel_size=4,
                                       pipeline_dtype=torch.float)
    model.config.hidden_size = 256
    return model


def test_interleaved_short_last_group_is_a_runtime_error_as_in_megatron():
    options = PipelineOptions.from_kwargs("interleaved")
    with pytest.raises(RuntimeError) as info:
        schedule_for(options, 4, 7, 2, forward_only=True)
    assert isinstance(info.value, ValueError)  # still the plugin's bad-input error
    assert isinstance(info.value, MicrobatchGroupError)
    assert "m=7" in str(info.value) and "p=4" in str(info.value)
    assert schedule_for(options, 4, 8, 2, forward_only=True).num_microbatches == 8


def test_group_outside_p_m_stays_a_value_error_as_in_megatron():
    options = PipelineOptions.from_kwargs("interleaved")
    with pytest.raises(ValueError) as info:
        schedule_for(options, 4, 3, 2, forward_only=True)  # group p=4 > m=3
    assert not isinstance(info.value, RuntimeError)


def test_microbatch_rule_is_checked_before_the_iterators_as_in_megatron():
    """One iterator for two chunks and m=7: Megatron raises its RuntimeError (m rule)."""
    collection = SimpleNamespace(pp=_group(4), tp=_group(1), cp=_group(1))
    with pytest.raises(RuntimeError):
        run_step(RunState(options=PipelineOptions.from_kwargs("interleaved")),
                 forward_step_func=lambda it, m: None, data_iterator=[range(100)],
                 model=[_chunk(), _chunk()], num_microbatches=7, seq_length=512,
                 micro_batch_size=8, decoder_seq_length=512, forward_only=True,
                 pg_collection=collection)
    # with a valid m the iterator count is still refused before any communication
    with pytest.raises(ValueError, match="data_iterator"):
        run_step(RunState(options=PipelineOptions.from_kwargs("interleaved")),
                 forward_step_func=lambda it, m: None, data_iterator=[range(100)],
                 model=[_chunk(), _chunk()], num_microbatches=8, seq_length=512,
                 micro_batch_size=8, forward_only=True, pg_collection=collection)
