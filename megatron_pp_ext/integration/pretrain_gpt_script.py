"""Megatron-LM's own ``pretrain_gpt.py`` with the plugin's flag, as ``scripts/pretrain_gpt_pp.py``
runs it (see that script for its command line): the script is imported as a module from
PYTHONPATH (its ``__main__`` block skipped) and ``pretrain()`` is called as that release's block
calls it, through :func:`pretrain_entry.run_pretrain`, with the schedule installed on every rank
once the arguments are validated and the script's batch reading adapted to the schedule's
layout (``script_batches``).

``verify`` and the tests run the same function: ``on_args(args)`` is called on every rank once
the arguments are validated (after the schedule is installed, before the model is built).
"""

from __future__ import annotations

import time
from functools import partial
from typing import Any, Callable, Optional

from .. import megatron_compat
from .pretrain_entry import run_pretrain
from .script_batches import adapt_pretrain_gpt_for_args


def import_pretrain_gpt():
    """Megatron-LM's ``pretrain_gpt`` module (its ``__main__`` block is not run); a
    SystemExit naming the fix when it is not on the path."""
    try:
        import pretrain_gpt
    except ImportError as error:
        raise SystemExit(
            f"cannot import Megatron-LM's pretrain_gpt ({error}): put a Megatron-LM checkout "
            "(a release branch core_r0.17.0 to core_r0.19.0, or main) on PYTHONPATH"
        ) from error
    return pretrain_gpt


def run_pretrain_gpt(main_entry_time: Optional[float] = None,
                     on_args: Optional[Callable[[Any], None]] = None) -> None:
    """``pretrain_gpt.py``'s ``__main__`` block with the plugin's argument group, on the
    arguments in ``sys.argv``."""
    gpt = import_pretrain_gpt()
    from megatron.training import inprocess_restart, pretrain, set_startup_timestamps

    megatron_compat.check_supported()
    entry = main_entry_time or time.time()
    set_startup_timestamps(program_start=getattr(gpt, "_PROGRAM_START_TIME", entry),
                           main_entry=entry)
    setattr(gpt.train_valid_test_datasets_provider, "is_distributed", True)
    run_pretrain_fn, store = inprocess_restart.maybe_wrap_for_inprocess_restart(pretrain)
    modelopt = getattr(gpt, "has_nvidia_modelopt", False)

    def prepared(args):  # after the schedule is installed, before the model is built
        if modelopt and hasattr(gpt, "maybe_enable_modelopt"):  # 0.19+
            gpt.maybe_enable_modelopt(args)
        # the V layout and dualpipe: get_batch / the dataset provider asked which ranks
        # hold the model's entries and exits (script_batches)
        adapt_pretrain_gpt_for_args(gpt, args)
        if on_args is not None:
            on_args(args)

    def model_config(args):  # 0.19+: the GPT config pretrain() builds the model from
        if modelopt and getattr(args, "modelopt_enabled", False):
            return megatron_compat.gpt_model_config(
                args, model_config_cls=gpt.ModelOptModelConfig)
        return megatron_compat.gpt_model_config(args)

    # 0.17 / 0.18: pretrain() takes pretrain_gpt.py's model provider (the V layout wraps it)
    loop_provider = (partial(gpt.model_provider, gpt.gpt_builder)
                     if hasattr(gpt, "model_provider") and hasattr(gpt, "gpt_builder") else None)
    run_pretrain(
        gpt.train_valid_test_datasets_provider,
        gpt.forward_step,
        model_provider=loop_provider,
        extra_args_provider=gpt.add_modelopt_args if modelopt else None,
        args_defaults={"tokenizer_type": "GPT2BPETokenizer"},
        on_args=prepared,
        model_config=model_config,
        pretrain=run_pretrain_fn,
        store=store,
        get_embedding_ranks=gpt.get_embedding_ranks,
    )
