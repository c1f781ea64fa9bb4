"""``train``: train a tiny real Megatron-Core GPT under a schedule and compare the measured
timeline with the simulator's.

Megatron's DDP and optimizer (Adam, fp32), ``megatron_pp_ext.install(schedule, trace=True)`` and
Megatron's own ``get_forward_backward_func()`` every step, exactly as Megatron-LM would call it.
Started plainly it runs ``--pp`` gloo processes on this machine's CPUs; under torchrun or a
multi-task srun it uses their ranks (NCCL on GPUs). Writes summary.json, timeline.html and
trace.json into ``--out``.
"""

from __future__ import annotations

import argparse

from ..schedules import schedule_names
from ..train.settings import TrainSettings

DEFAULTS = TrainSettings()


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "train", help="train a tiny Megatron-Core GPT with a schedule; measured vs predicted",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    d = DEFAULTS
    parser.add_argument("--schedule", default=d.schedule, metavar="NAME",
                        help=f"one of {', '.join(schedule_names())}, or auto (measure the "
                        f"first step, then run the fastest that fits; default {d.schedule})")
    parser.add_argument("--pp", type=int, default=d.pp, metavar="P",
                        help=f"pipeline ranks (default {d.pp})")
    parser.add_argument("--microbatches", "-m", type=int, default=d.microbatches, metavar="M",
                        help=f"microbatches per step (default {d.microbatches})")
    parser.add_argument("--chunks", "-v", type=int, default=None, metavar="V",
                        help="model chunks per rank: interleaved >= 2 (default 2); zb-v and "
                        "dualpipev 2 (V layout); others 1")
    parser.add_argument("--steps", type=int, default=d.steps, help=f"(default {d.steps})")
    parser.add_argument("--out", default=d.out, metavar="DIR",
                        help=f"folder for summary.json, timeline.html, trace.json ({d.out})")
    parser.add_argument("--trace", action=argparse.BooleanOptionalAction, default=d.trace,
                        help="record measured timelines: per-step bubble, timeline.html, "
                        "trace.json (default on)")
    parser.add_argument("--seed", type=int, default=d.seed, help=f"(default {d.seed})")
    parser.add_argument("--lr", type=float, default=d.lr, help=f"Adam's rate (default {d.lr})")
    parser.add_argument("--layers", type=int, default=None,
                        help="decoder layers, a multiple of pp*v (default: the smallest "
                        "multiple of pp*v that is >= 8)")
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
    return TrainSettings(
        schedule=args.schedule, pp=args.pp, microbatches=args.microbatches, chunks=args.chunks,
        steps=args.steps, out=args.out, trace=args.trace, seed=args.seed, lr=args.lr,
        layers=args.layers, hidden=args.hidden, heads=args.heads, seq_length=args.seq_length,
        micro_batch_size=args.micro_batch_size, vocab=args.vocab,
        p2p_timeout_s=args.p2p_timeout_s, timeout_s=args.timeout_s,
    )


def run(args) -> int:
    settings = settings_from(args)
    settings.check()  # ValueError: one 'error:' line, exit 2, before any process starts
    from ..train.launcher import run as launch

    return launch(settings)
