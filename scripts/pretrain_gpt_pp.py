"""Megatron-LM's pretrain_gpt.py with a megatron-pp-ext pipeline schedule, without patching it.

Put an unmodified Megatron-LM checkout (a release branch core_r0.17.0, core_r0.18.0,
core_r0.19.0, or main) on PYTHONPATH and use this script where you would use pretrain_gpt.py;
every pretrain_gpt.py argument works, plus the group "pipeline schedule (megatron-pp-ext)":

    export PYTHONPATH=/path/to/Megatron-LM:$PYTHONPATH    # and megatron_pp_ext installed
    torchrun --nproc-per-node 8 scripts/pretrain_gpt_pp.py <pretrain_gpt.py args> \\
        --pipeline-model-parallel-size 4 --pipeline-schedule zb-h1 [--pp-max-pending-backward N]
        [--pp-p2p-timeout-s S] [--pp-trace] [--pp-schedule-chunks V] [--pp-post-validate]

    --pipeline-schedule interleaved   also needs --num-virtual-stages-per-pipeline-rank V (V >= 2)
    --pipeline-schedule zb-v|dualpipev also needs --num-virtual-stages-per-pipeline-rank 2 and
                                       --untie-embeddings-and-output-weights; the script then
                                       builds the V layout from the same GPT config
    --pipeline-schedule path/to/my.csv a schedule file (PyTorch's compute-only CSV, or .json):
                                       checked (validator, NCCL's rules) before training; its
                                       rows must be --pipeline-model-parallel-size and its
                                       microbatches global batch / (micro batch x data parallel);
                                       v stages per rank in the loop layout need
                                       --num-virtual-stages-per-pipeline-rank v (v >= 2), in
                                       the V layout as zb-v (V chunks built as for zb-v)

    --pp-post-validate                 wraps the optimizer pretrain() builds in
                                       megatron_pp_ext's PostValidatedOptimizer: each rank steps
                                       before the global grad norm / found-inf arrive and rolls
                                       back exactly when they say otherwise (bit-identical to
                                       Megatron's step; docs/choosing-a-schedule.md for its cost)

Names are case-insensitive, and PyTorch's names for the same schedules work (Interleaved1F1B,
ZBVZeroBubble, DualPipeV, ...).

Instead of --pipeline-schedule you may set MEGATRON_PP_SCHEDULE=<name> in the environment (the
flag wins). With neither, Megatron's own schedule runs, exactly as with pretrain_gpt.py.
It reuses pretrain_gpt.py's dataset provider, forward_step, model provider (0.17, 0.18) and
embedding ranks, and calls pretrain() the way that release's pretrain_gpt.py __main__ block
does (megatron_pp_ext.integration.pretrain_entry); the schedule is installed right after the
arguments are validated, on every rank (0.17, whose pretrain() parses them: at the model
provider's first call). (patches/pretrain_gpt_core_r0.19.0.patch does the
same inside pretrain_gpt.py.)
"""

import time

_MAIN_ENTRY_TIME = time.time()


def main():
    try:
        import pretrain_gpt as gpt  # Megatron-LM's script, as a module: its __main__ is skipped
    except ImportError as error:
        raise SystemExit(
            f"cannot import Megatron-LM's pretrain_gpt ({error}): put a Megatron-LM checkout "
            "(a release branch core_r0.17.0 to core_r0.19.0, or main) on PYTHONPATH"
        ) from error
    from functools import partial

    from megatron.training import inprocess_restart, pretrain, set_startup_timestamps

    from megatron_pp_ext import megatron_compat
    from megatron_pp_ext.integration.megatron_args import adapt_pretrain_gpt_for_args
    from megatron_pp_ext.integration.pretrain_entry import run_pretrain

    megatron_compat.check_supported()
    set_startup_timestamps(
        program_start=getattr(gpt, "_PROGRAM_START_TIME", _MAIN_ENTRY_TIME),
        main_entry=_MAIN_ENTRY_TIME,
    )
    setattr(gpt.train_valid_test_datasets_provider, "is_distributed", True)
    run_pretrain_fn, store = inprocess_restart.maybe_wrap_for_inprocess_restart(pretrain)
    modelopt = getattr(gpt, "has_nvidia_modelopt", False)

    def on_args(args):  # after the schedule is installed, before the model is built
        if modelopt and hasattr(gpt, "maybe_enable_modelopt"):  # 0.19+
            gpt.maybe_enable_modelopt(args)
        # the V layout and dualpipe: get_batch / the dataset provider asked which ranks hold
        # the model's entries and exits (integration/script_batches.py)
        adapt_pretrain_gpt_for_args(gpt, args)

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
        on_args=on_args,
        model_config=model_config,
        pretrain=run_pretrain_fn,
        store=store,
        get_embedding_ranks=gpt.get_embedding_ranks,
    )


if __name__ == "__main__":
    main()
