"""``train``: train a tiny real Megatron-Core GPT under a schedule and compare the measured
timeline with the simulator's.

Megatron's DDP and optimizer (Adam, fp32), ``megatron_pp_ext.install(schedule, trace=True)`` and
Megatron's own ``get_forward_backward_func()`` every step, exactly as Megatron-LM would call it.
Started plainly it runs ``-p`` gloo processes on this machine's CPUs; under torchrun or a
multi-task srun it uses their ranks (NCCL on GPUs). Writes summary.json, timeline.html and
trace.json into ``--out``.

The schedule is a name (any case; PyTorch's names such as Interleaved1F1B or ZBVZeroBubble
too), auto, or a schedule file: ``--csv FILE`` (or ``--schedule FILE.csv``; .json too), in
PyTorch's compute-only CSV format, checked (validator, NCCL's rules) before any process
starts. -p defaults to 4 and -m to 8, or to the schedule file's; -v is the schedule's own.
Megatron-Core's warnings (apex and Transformer Engine missing on a CPU, deprecations) are kept
out of the output under every launcher; set PYTHONWARNINGS (e.g. =default) to see them.
"""

from __future__ import annotations

import argparse

from ..schedules import is_schedule_file, load_schedule_file, schedule_names
from ..train.settings import TrainSettings
from .common import add_size_args
from .hints import warn_p_exceeds_m

DEFAULTS = TrainSettings()


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "train", help="train a tiny Megatron-Core GPT with a schedule; measured vs predicted",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    d = DEFAULTS
    parser.add_argument("--schedule", default=None, metavar="NAME",
                        help=f"one of {', '.join(schedule_names())} (any case, or PyTorch's "
                        "name for it), auto (measure the first step, then run the fastest "
                        f"that fits), or a schedule file FILE.csv / FILE.json (default "
                        f"{d.schedule}); asynchronous, opt-in: pipedream, pipedream-2bw "
                        "(docs/pipedream.md)")
    parser.add_argument("--vertical-sync", action="store_true",
                        help="pipedream only: every stage runs a microbatch on the weight "
                        "version it entered the pipeline with")
    parser.add_argument("--csv", metavar="FILE",
                        help="run the schedule in this file (PyTorch's compute-only CSV, or "
                        ".json); -p and -m default to the file's")
    add_size_args(parser)  # -p/--ranks/--pp, -m/--microbatches: as in every command
    parser.add_argument("--chunks", "-v", type=int, default=None, metavar="V",
                        help="model chunks per rank: interleaved >= 2 (default 2); zb-v and "
                        "dualpipev 2 (V layout); a schedule file its own; others 1")
    parser.add_argument("--steps", type=int, default=d.steps, help=f"(default {d.steps})")
    parser.add_argument("--out", default=d.out, metavar="DIR",
                        help=f"folder for summary.json, timeline.html, trace.json ({d.out})")
    parser.add_argument("--trace", action=argparse.BooleanOptionalAction, default=d.trace,
                        help="record measured timelines: per-step bubble, timeline.html, "
                        "trace.json (default on)")
    parser.add_argument("--seed", type=int, default=d.seed, help=f"(default {d.seed})")
    parser.add_argument("--lr", type=float, default=d.lr, help=f"Adam's rate (default {d.lr})")
    parser.add_argument("--layers", type=int, default=None,
                        help="decoder layers, a multiple of p*v (default: the smallest "
                        "multiple of p*v that is >= 8)")
    parser.add_argument("--hidden", type=int, default=d.hidden, help=f"(default {d.hidden})")
    parser.add_argument("--heads", type=int, default=d.heads, help=f"(default {d.heads})")
    parser.add_argument("--seq-length", type=int, default=d.seq_length,
                        help=f"(default {d.seq_length})")
    parser.add_argument("--micro-batch-size", type=int, default=d.micro_batch_size,
                        help=f"sequences per microbatch (default {d.micro_batch_size})")
    parser.add_argument("--vocab", type=int, default=d.vocab, help=f"(default {d.vocab})")
    parser.add_argument("--p2p-timeout-s", type=float, default=d.p2p_timeout_s,
                        help="the plugin's wait on any peer before PipelineTimeoutError "
                        f"(default {d.p2p_timeout_s:g})")
    parser.add_argument("--timeout-s", type=float, default=None,
                        help="stop a local run after this long (default: from its size)")
    parser.set_defaults(func=run)


def settings_from(args) -> TrainSettings:
    """The settings the command line asks for; -p and -m default to a schedule file's."""
    if args.csv and args.schedule:
        raise ValueError(f"give either --schedule {args.schedule} or --csv {args.csv}, not both")
    if args.csv and not is_schedule_file(args.csv):
        raise ValueError(f"--csv {args.csv}: a schedule file ends in .csv (PyTorch's "
                         "compute-only format) or .json")
    schedule = args.csv or args.schedule or DEFAULTS.schedule
    pp, microbatches = DEFAULTS.pp, DEFAULTS.microbatches
    if is_schedule_file(schedule):  # the file's sizes, unless given (then check() compares)
        loaded = load_schedule_file(schedule)
        pp, microbatches = loaded.num_ranks, loaded.num_microbatches
    return TrainSettings(
        schedule=schedule,
        pp=args.ranks if args.ranks is not None else pp,
        microbatches=args.microbatches if args.microbatches is not None else microbatches,
        chunks=args.chunks, steps=args.steps, out=args.out, trace=args.trace, seed=args.seed,
        lr=args.lr, layers=args.layers, hidden=args.hidden, heads=args.heads,
        seq_length=args.seq_length, micro_batch_size=args.micro_batch_size, vocab=args.vocab,
        p2p_timeout_s=args.p2p_timeout_s, timeout_s=args.timeout_s,
        vertical_sync=getattr(args, "vertical_sync", False),
    )


def run(args) -> int:
    settings = settings_from(args)
    settings.check()  # ValueError: one 'error:' line, exit 2, before any process starts
    from ..train.launcher import detect, run as launch, start_local_server

    launcher = detect()
    if launcher.kind == "local":
        start_local_server()  # the ranks' server imports Megatron while we go on
    if launcher.rank == 0 and not settings.is_async:  # under torchrun / srun every rank runs
        # this command: say it once
        warn_p_exceeds_m(settings.pp, settings.microbatches)
    return launch(settings)
