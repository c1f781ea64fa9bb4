"""What ``verify`` is asked to do (the command line's settings), without importing torch or
Megatron: the CLI builds it before anything heavy is loaded."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

#: Megatron's own schedules a run is compared with
AGAINST = ("1f1b", "interleaved")


@dataclass
class VerifySettings:
    schedule: str
    job_argv: list[str]
    against: str | None = None  # default: interleaved for interleaved, else 1f1b
    steps: int = 3
    num_layers: int | None = None
    out: str = "out/verify"
    world_size: int | None = None  # local launch: processes (default tp x pp x cp)
    p2p_timeout_s: float = 120.0
    run_timeout_s: float = 1800.0
    keep_dropout: bool = False


def settings_from_namespace(args: argparse.Namespace) -> VerifySettings:
    return VerifySettings(schedule=args.schedule, job_argv=list(args.job), against=args.against,
                          steps=args.steps, num_layers=args.num_layers, out=args.out,
                          world_size=args.world_size, p2p_timeout_s=args.p2p_timeout_s,
                          run_timeout_s=args.timeout_s, keep_dropout=args.keep_dropout)
