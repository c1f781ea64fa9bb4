"""One rank of the tests' Megatron-LM loop (:func:`support.megatron_loop.run_pretrain`) as a
process of its own, started by ``srun`` (one task per rank) or ``torchrun``:

    srun --ntasks 4 python tests/support/pretrain_rank.py OUT [--kill-at-iteration K] \\
        -- <pretrain_gpt.py arguments>

The rank, the world size and the rendezvous come from the launcher as the ``train`` command
reads them (``megatron_pp_ext.train.launcher.detect``: ``SLURM_PROCID``, the first node of the
allocation, a port from the job id); the rank joins the gloo process group (env://) before
Megatron's ``initialize_megatron``, which then finds it joined. Each rank writes its history to ``OUT/history-rank<r>.json``
after every step, so a killed run leaves what it did. The weights are Megatron's own
initialisation, as a user's run has them.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/


def main(argv: list[str] | None = None) -> int:
    import megatron_pp_ext.train.preload  # noqa: F401 (before Megatron: 2.8 s less CPU)
    from megatron_pp_ext.train.launcher import detect

    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        raise SystemExit("usage: pretrain_rank.py OUT [--kill-at-iteration K] -- "
                         "<pretrain_gpt.py arguments>")
    split = argv.index("--")
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", help="folder for history-rank<r>.json")
    parser.add_argument("--kill-at-iteration", type=int, default=None,
                        help="SIGKILL every rank when the loop starts this iteration")
    args = parser.parse_args(argv[:split])
    megatron_argv = argv[split + 1:]
    launch = detect()
    if launch.kind == "local":
        parser.error("not a rank of an srun step or a torchrun launch")
    launch.export()
    os.makedirs(args.out, exist_ok=True)

    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    # joined here, as the spawn harness does: Megatron's initialize (seeing one CUDA device
    # through the CPU patches) would bind a GPU before joining
    dist.init_process_group("gloo", init_method="env://", rank=launch.rank,
                            world_size=launch.world_size,
                            timeout=datetime.timedelta(seconds=300))
    from support.megatron_loop import run_pretrain

    run_pretrain(launch.rank, launch.world_size, megatron_argv,
                 kill_at_iteration=args.kill_at_iteration, record_to=args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
