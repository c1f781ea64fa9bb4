"""``verify``: your ``pretrain_gpt.py`` job under a schedule and under Megatron's own, from the
same weights, data and seed, compared step by step (loss, grad norm, every parameter's gradient
norm), timed and measured.

    python -m megatron_pp_ext verify --schedule zb-v -- [path/to/pretrain_gpt.py] <its args>
    torchrun --nproc-per-node 8 -m megatron_pp_ext verify --schedule zb-v -- <args>

Started plainly it runs each run as local gloo processes on this machine's CPUs (the world
size: --world-size, default tp x pp x cp); under torchrun or a multi-task srun it uses their
ranks (NCCL on GPUs). Megatron-LM's pretrain_gpt.py must be importable (its folder on
PYTHONPATH, or its path as the first argument after --). The verdict comes first: IDENTICAL,
WITHIN TOLERANCE (the tolerance from the dtypes and the reductions' order, printed), DIFFERENT
(the first step, rank, stage and parameter that differ), or the run that failed or hung. Exit
status 0 only for the first two. Writes verify.json, verify.html (both measured timelines on
one time axis) and costs-reference.json / costs-candidate.json (select --costs, plan --costs)
into --out. docs/verify.md.
"""

from __future__ import annotations

import argparse

from ..verify.settings import AGAINST, VerifySettings, settings_from_namespace

DEFAULTS = VerifySettings(schedule="", job_argv=[])


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "verify", help="your pretrain_gpt.py job under a schedule and under Megatron's own: "
        "the same training? how fast? how much memory?", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    d = DEFAULTS
    parser.add_argument("--schedule", required=True, metavar="NAME",
                        help="the schedule to verify (any name --pipeline-schedule takes)")
    parser.add_argument("--against", choices=AGAINST, default=None,
                        help="Megatron's own schedule to compare with (default: interleaved "
                        "for interleaved, else 1f1b)")
    parser.add_argument("--steps", type=int, default=d.steps,
                        help=f"training steps per run (default {d.steps}; timed: 2..N)")
    parser.add_argument("--num-layers", type=int, default=None, metavar="L",
                        help="shrink the model to L layers for a check in minutes (said in "
                        "every output); default: the job's model")
    parser.add_argument("--out", default=d.out, metavar="DIR", help=f"(default {d.out})")
    parser.add_argument("--world-size", type=int, default=None,
                        help="without a launcher: processes per run (default tp x pp x cp)")
    parser.add_argument("--p2p-timeout-s", type=float, default=d.p2p_timeout_s,
                        help="the plugin's wait on a pipeline peer before it names the hang "
                        f"(default {d.p2p_timeout_s:g})")
    parser.add_argument("--timeout-s", type=float, default=d.run_timeout_s,
                        help=f"stop a run after this long (default {d.run_timeout_s:g})")
    parser.add_argument("--keep-dropout", action="store_true",
                        help="keep the job's dropout (default: off in both runs, whose masks "
                        "would be drawn in another order)")
    parser.add_argument("job", nargs=argparse.REMAINDER,
                        help="-- then the job's pretrain_gpt.py arguments")
    parser.set_defaults(func=run)


def run(args) -> int:
    from ..verify.launch import verify

    job = list(args.job)
    if job and job[0] == "--":
        job = job[1:]
    args.job = job
    return verify(settings_from_namespace(args))
