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
It reuses pretrain_gpt.py's dataset provider, forward_step, get_batch, model provider (0.17,
0.18) and embedding ranks, and calls pretrain() the way that release's pretrain_gpt.py __main__
block does (megatron_pp_ext.integration.pretrain_gpt_script); the schedule is installed right
after the arguments are validated, on every rank (0.17, whose pretrain() parses them: at the
model provider's first call), and with a V or dualpipe schedule the script's get_batch is told
which ranks hold the model's entries and exits (integration/script_batches.py).
(patches/pretrain_gpt_core_r0.19.0.patch installs the schedule inside pretrain_gpt.py but does
not adapt its get_batch: the V-layout schedules and dualpipe need this script.)
"""

import time

_MAIN_ENTRY_TIME = time.time()


def main():
    from megatron_pp_ext.integration.pretrain_gpt_script import run_pretrain_gpt

    run_pretrain_gpt(main_entry_time=_MAIN_ENTRY_TIME)


if __name__ == "__main__":
    main()
