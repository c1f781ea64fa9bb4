"""``simulate``: build (or load) a schedule, validate it, predict its timeline, print it."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..analysis.render import render_ascii, render_chrome_trace, render_html
from ..analysis.simulate import CostModel, simulate
from ..analysis.validate import CHANNELS
from ..ir import Schedule
from ..schedules import build_schedule, schedule_names

FORMATS = ("ascii", "json", "html", "chrome")


def cost_value(text: str) -> float | list[float]:
    """``2`` -> 2.0; ``1,1,2,1`` -> one cost per stage (or per rank)."""
    try:
        values = [float(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a number or a comma-separated list of numbers"
        ) from None
    return values[0] if len(values) == 1 else values


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "simulate",
        help="predict a schedule's timeline under a cost model",
        description="Build a registered schedule (or load one from CSV / JSON), validate it, "
        "simulate it under the cost model and print the timeline. Costs are per action of one "
        "stage: one number, or a comma list with one per stage or one per rank.",
    )
    parser.add_argument("--schedule", metavar="NAME", help=f"one of {', '.join(schedule_names())}")
    parser.add_argument("--ranks", "-p", type=int, metavar="P", help="pipeline size")
    parser.add_argument("--microbatches", "-m", type=int, metavar="M")
    parser.add_argument("--chunks", "-v", type=int, metavar="V",
                        help="model chunks per rank (default: the schedule's own)")
    parser.add_argument("--csv", metavar="FILE",
                        help="load the schedule from a CSV (or .json) file instead of a builder")
    parser.add_argument("--t-f", type=cost_value, default=1.0, help="forward (default 1)")
    parser.add_argument("--t-b", type=cost_value, default=None,
                        help="full backward (default t_i + t_w)")
    parser.add_argument("--t-i", type=cost_value, default=1.0, help="input-gradient half (1)")
    parser.add_argument("--t-w", type=cost_value, default=1.0, help="weight-gradient half (1)")
    parser.add_argument("--t-comm", type=cost_value, default=0.0,
                        help="time a message takes to arrive (default 0)")
    parser.add_argument("--t-overhead", type=cost_value, default=0.0,
                        help="runtime cost added to every F, B and I: posting its messages "
                        "(default 0)")
    parser.add_argument("--format", choices=FORMATS, default="ascii")
    parser.add_argument("--out", metavar="FILE", help="write there instead of to stdout")
    parser.add_argument("--width", type=int, help="ascii: scale the grid to this many columns")
    parser.add_argument("--max-pending-backward", type=int, metavar="K",
                        help="builder option of the zero-bubble schedules")
    parser.add_argument("--channels", choices=CHANNELS, default="sender",
                        help="message matching to validate against: one in-order channel per "
                        "rank pair (default, NCCL) or per pair and kind (activations apart "
                        "from gradients)")
    parser.add_argument("--nccl-program", action="store_true",
                        help="print instead the P2P program the executor posts on NCCL (one "
                        "row per rank: actions, (ops)BATCH#k, WAIT#k), checked against "
                        "NCCL's rules")
    parser.set_defaults(func=run)


def load_schedule(path: str) -> Schedule:
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise OSError(f"cannot read schedule file {path}: {exc.strerror or exc}") from None
    if path.endswith(".json"):
        return Schedule.from_json(text)
    return Schedule.from_csv(text, name=Path(path).stem)


def make_schedule(args) -> Schedule:
    if args.csv and args.schedule:
        raise ValueError("give either --schedule NAME or --csv FILE, not both")
    if args.csv:
        return load_schedule(args.csv)
    if not args.schedule:
        raise ValueError("give --schedule NAME (one of "
                         f"{', '.join(schedule_names())}) or --csv FILE")
    if args.ranks is None or args.microbatches is None:
        raise ValueError(f"--schedule {args.schedule} needs --ranks P and --microbatches M")
    options = {}
    if args.max_pending_backward is not None:
        options["max_pending_backward"] = args.max_pending_backward
    return build_schedule(args.schedule, args.ranks, args.microbatches, args.chunks,
                          validate=False, **options)


def nccl_program_text(schedule: Schedule) -> str:
    """The lowered program the executor posts on NCCL, after checking it (raises if it could
    hang), with a first line saying which posting it uses."""
    from ..runtime.lowering import LOCKSTEP, MEGATRON, lower, nccl_posting

    posting = MEGATRON if nccl_posting(schedule) is None else LOCKSTEP
    why = ("Megatron's fused calls pass NCCL's rules" if posting == MEGATRON else
           "Megatron's fused calls could hang under NCCL's rules, so one batch per round")
    return (f"# {schedule.name}: {posting} posting ({why}); checked: no hang, every pair "
            f"matched in order\n" + lower(schedule, posting).to_csv())


def run(args) -> int:
    schedule = make_schedule(args)
    if args.nccl_program:
        from ..analysis.validate import validate_schedule

        validate_schedule(schedule)
        return _write(args, nccl_program_text(schedule).rstrip("\n"))
    costs = CostModel(t_f=args.t_f, t_i=args.t_i, t_w=args.t_w, t_b=args.t_b,
                      t_comm=args.t_comm, t_overhead=args.t_overhead)
    timeline = simulate(schedule, costs, channels=args.channels)  # validates first
    if args.format == "ascii":
        text = render_ascii(timeline, width=args.width)
    elif args.format == "json":
        text = json.dumps(summary(schedule, timeline), indent=1)
    elif args.format == "html":
        text = render_html([timeline], title=f"{schedule.name}: predicted timeline")
    else:
        text = json.dumps(render_chrome_trace(timeline))
    return _write(args, text)


def _write(args, text: str) -> int:
    if args.out:
        Path(args.out).write_text(text + "\n")
        print(f"wrote {args.out}")
    else:
        sys.stdout.write(text + "\n")
    return 0


def summary(schedule: Schedule, timeline) -> dict:
    return {
        "schedule": schedule.name,
        "ranks": schedule.num_ranks,
        "microbatches": schedule.num_microbatches,
        "chunks": schedule.chunks,
        "makespan": timeline.makespan,
        "bubble_fraction": timeline.bubble_fraction,
        "window_bubble_fraction": timeline.window_bubble_fraction,
        "peak_activations": list(timeline.peak_activations),
        "actions": schedule.text(),
        "stage_to_rank": list(schedule.stage_to_rank),
        "per_rank": timeline.per_rank_summary(),
    }
