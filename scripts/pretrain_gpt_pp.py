"""Megatron-LM's pretrain_gpt.py with a megatron-pp-ext pipeline schedule, without patching it.

Put an unmodified Megatron-LM checkout (branch core_r0.19.0) on PYTHONPATH and use this script
where you would use pretrain_gpt.py; every pretrain_gpt.py argument works, plus the group
"pipeline schedule (megatron-pp-ext)":

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
It reuses pretrain_gpt.py's dataset provider, forward_step and embedding ranks, and calls
pretrain() the way pretrain_gpt.py's __main__ block does; the schedule is installed right after
the arguments are validated, on every rank. (patches/pretrain_gpt_core_r0.19.0.patch does the
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
            "(branch core_r0.19.0) on PYTHONPATH"
        ) from error
    from megatron.core.enums import ModelType
    from megatron.training import inprocess_restart, pretrain, set_startup_timestamps
    from megatron.training.argument_utils import (
        gpt_config_from_args,
        pretrain_cfg_container_from_args,
    )
    from megatron.training.arguments import parse_and_validate_args

    from megatron_pp_ext.integration.megatron_args import (
        adapt_pretrain_gpt_for_v_layout,
        add_pipeline_schedule_args,
        chain_args_providers,
        install_from_args,
        pretrain_model_for_args,
        uses_v_layout,
    )

    set_startup_timestamps(
        program_start=getattr(gpt, "_PROGRAM_START_TIME", _MAIN_ENTRY_TIME),
        main_entry=_MAIN_ENTRY_TIME,
    )
    setattr(gpt.train_valid_test_datasets_provider, "is_distributed", True)
    run_pretrain, store = inprocess_restart.maybe_wrap_for_inprocess_restart(pretrain)

    modelopt = gpt.has_nvidia_modelopt
    args = parse_and_validate_args(
        extra_args_provider=chain_args_providers(
            gpt.add_modelopt_args if modelopt else None, add_pipeline_schedule_args
        ),
        args_defaults={"tokenizer_type": "GPT2BPETokenizer"},
    )
    install_from_args(args)  # --pipeline-schedule / $MEGATRON_PP_SCHEDULE, else a no-op
    if modelopt:
        gpt.maybe_enable_modelopt(args)
    if modelopt and getattr(args, "modelopt_enabled", False):
        model_cfg = gpt_config_from_args(args, model_config_cls=gpt.ModelOptModelConfig)
    else:
        model_cfg = gpt_config_from_args(args)
    # zb-v / dualpipev: a provider that builds V-layout chunks from the same GPT config, and
    # get_batch / the dataset provider asked which chunks read data in the V layout
    if uses_v_layout(args):
        adapt_pretrain_gpt_for_v_layout(gpt)
    cfg_container, model_provider = pretrain_model_for_args(
        pretrain_cfg_container_from_args(args, model_cfg), args
    )
    run_pretrain(
        cfg_container,
        gpt.train_valid_test_datasets_provider,
        ModelType.encoder_or_decoder,
        gpt.forward_step,
        model_provider=model_provider,
        store=store,
        get_embedding_ranks=gpt.get_embedding_ranks,
    )


if __name__ == "__main__":
    main()
