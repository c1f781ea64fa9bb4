"""Which pipeline ranks read Megatron-LM's ``pretrain_gpt.py`` batches, for the layout a
schedule builds, and the adaptation of that script (imported as a module) that makes them do so.

``pretrain_gpt.py``'s ``get_batch`` and ``is_dataset_built_on_rank`` ask
``is_first_or_last_pipeline_stage`` (Megatron's placement: pipeline ranks 0 and p-1) which
chunks read data, and its TP helper ``get_batch_on_this_tp_rank`` keeps (and broadcasts from
TP rank 0) the tokens on the first stage and the labels on the last. Where the schedule moves
the model's entries and exits, those answers are wrong:

=========  ===========================  =====================================================
layout     ranks that read the batch    what they hold
=========  ===========================  =====================================================
loop       0 and p-1 (Megatron's own)   nothing changes
V          0                            stage 0 (embedding) and stage 2p-1 (loss, MTP)
dual       0 and p-1                    part 0 (embedding) and part p-1 (loss, MTP), each
                                        rank once in each direction
=========  ===========================  =====================================================

A reading rank of the V or dual layout holds an entry *and* an exit, so its TP helper is told
to keep every tensor, as for a one-stage pipeline (``megatron_compat.whole_batch_kwargs``):
tokens and position ids for its entry chunk, labels and the loss mask for its exit chunk, on
every TP rank (TP rank 0 reads and broadcasts them to the others).
"""

from __future__ import annotations

import functools
from typing import Any

from .. import megatron_compat
from .dual_layout_models import uses_dual_layout
from .v_layout_models import uses_v_layout


def v_layout_reads_batch(vp_stage=None) -> bool:
    """``is_first_or_last_pipeline_stage`` for the V layout: rank 0 holds the first stage and
    the last."""
    from megatron.core import parallel_state

    return parallel_state.get_pipeline_model_parallel_rank() == 0


def dual_layout_reads_batch(vp_stage=None) -> bool:
    """``is_first_or_last_pipeline_stage`` for dualpipe: ranks 0 and p-1 each hold part 0 (an
    entry) and part p-1 (an exit), one in each direction."""
    from megatron.core import parallel_state

    rank = parallel_state.get_pipeline_model_parallel_rank()
    return rank in (0, parallel_state.get_pipeline_model_parallel_world_size() - 1)


def batch_reader_for_args(args: Any):
    """The ``is_first_or_last_pipeline_stage`` the run's layout needs, or None (loop layout:
    Megatron's own placement is right)."""
    if uses_dual_layout(args):
        return dual_layout_reads_batch
    if uses_v_layout(args):
        return v_layout_reads_batch
    return None


def adapt_pretrain_gpt(pretrain_gpt_module, reads_batch) -> None:
    """Make ``pretrain_gpt.py`` (imported as a module) feed the chunks of a layout whose
    batch-reading ranks ``reads_batch(vp_stage)`` names: those ranks read data and keep every
    tensor of the batch (see the module). Idempotent."""
    pretrain_gpt_module.is_first_or_last_pipeline_stage = reads_batch
    original = pretrain_gpt_module.get_batch_on_this_tp_rank
    original = getattr(original, "megatron_get_batch_on_this_tp_rank", original)
    whole = megatron_compat.whole_batch_kwargs(original)  # tokens *and* labels

    @functools.wraps(original)
    def get_batch_on_this_tp_rank(batch, *args, **kwargs):
        return original(batch, *args, **{**kwargs, **whole})

    get_batch_on_this_tp_rank.megatron_get_batch_on_this_tp_rank = original
    pretrain_gpt_module.get_batch_on_this_tp_rank = get_batch_on_this_tp_rank


def adapt_pretrain_gpt_for_args(pretrain_gpt_module, args: Any) -> bool:
    """:func:`adapt_pretrain_gpt` for the layout ``--pipeline-schedule`` builds (V: zb-v,
    dualpipev, v-half, v-min, zb-auto on two chunks; dual: dualpipe); returns whether the
    script was adapted (a loop layout leaves it as it is)."""
    reads_batch = batch_reader_for_args(args)
    if reads_batch is None:
        return False
    adapt_pretrain_gpt(pretrain_gpt_module, reads_batch)
    return True


def adapt_pretrain_gpt_for_v_layout(pretrain_gpt_module) -> None:
    """:func:`adapt_pretrain_gpt` for the V layout (the name scripts written for earlier
    releases of the plugin import)."""
    adapt_pretrain_gpt(pretrain_gpt_module, v_layout_reads_batch)
