"""``select``: rank the schedules by predicted step time under a per-rank memory budget."""

from __future__ import annotations

import argparse
import json
import sys

from ..analysis.select import MiB, Selection, format_bytes, select_schedules
from ..analysis.simulate import CostModel
from ..schedules import schedule_names
from .simulate import cost_value

FORMATS = ("text", "json")


def int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") \
            from None


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "select",
        help="rank the schedules by predicted step time under a memory budget",
        description="Simulate every schedule (interleaved at each --chunks-options) with the "
        "given costs, drop those whose peak activation memory on some rank exceeds the budget, "
        "and rank the rest by predicted step time (the single-step makespan: Megatron's "
        "optimizer step synchronizes the ranks between steps). Costs are those of one "
        "microbatch on one rank's whole part of the model (one number, or a comma list with "
        "one per rank); a schedule with v chunks per rank runs chunks costing 1/v of that and "
        "holding 1/v of the activation.",
    )
    parser.add_argument("--ranks", "-p", type=int, required=True, metavar="P",
                        help="pipeline size")
    parser.add_argument("--microbatches", "-m", type=int, required=True, metavar="M")
    parser.add_argument("--t-f", type=cost_value, default=1.0, help="forward (default 1)")
    parser.add_argument("--t-i", type=cost_value, default=1.0,
                        help="input-gradient half of the backward (default 1)")
    parser.add_argument("--t-w", type=cost_value, default=1.0,
                        help="weight-gradient half of the backward (default 1)")
    parser.add_argument("--t-b", type=cost_value, default=None,
                        help="full backward (default t_i + t_w)")
    parser.add_argument("--t-comm", type=cost_value, default=0.0,
                        help="time a message takes to arrive (default 0)")
    parser.add_argument("--t-overhead", type=cost_value, default=0.0,
                        help="runtime cost added to every F, B and I: posting its messages "
                        "(default 0)")
    parser.add_argument("--activation-mb", type=float, required=True, metavar="X",
                        help="MiB one microbatch's activations take on one rank (v=1)")
    parser.add_argument("--memory-budget-mb", type=float, required=True, metavar="Y",
                        help="MiB per rank available for activations")
    parser.add_argument("--schedules", metavar="A,B,...",
                        help=f"candidates (default: all of {', '.join(schedule_names())})")
    parser.add_argument("--chunks-options", type=int_list, default=(2, 3, 4), metavar="V,...",
                        help="interleaved chunk counts to try (default 2,3,4)")
    parser.add_argument("--format", choices=FORMATS, default="text")
    parser.set_defaults(func=run)


def run(args) -> int:
    candidates = None
    if args.schedules:
        candidates = [name.strip() for name in args.schedules.split(",") if name.strip()]
    costs = CostModel(t_f=args.t_f, t_i=args.t_i, t_w=args.t_w, t_b=args.t_b,
                      t_comm=args.t_comm, t_overhead=args.t_overhead)
    selection = select_schedules(
        args.ranks, args.microbatches, costs,
        activation_bytes=args.activation_mb * MiB,
        memory_budget_bytes=args.memory_budget_mb * MiB,
        candidates=candidates, chunks_options=args.chunks_options,
    )
    if args.format == "json":
        text = json.dumps(selection.to_dict(), indent=1)
    else:
        text = render_text(selection)
    sys.stdout.write(text + "\n")
    return 0


def render_text(selection: Selection) -> str:
    p, m = selection.num_ranks, selection.num_microbatches
    lines = [f"p={p} m={m}; activation {format_bytes(selection.activation_bytes)} per "
             f"microbatch per rank; budget {format_bytes(selection.memory_budget_bytes)} per "
             "rank; step time in the unit of the costs", ""]
    if selection.ranked:
        best = selection.ranked[0].makespan
        header = ("#", "schedule", "v", "step time", "vs best", "bubble", "peak memory")
        rows = [
            (str(i + 1), r.name, str(r.chunks), f"{r.makespan:.4g}",
             f"{r.makespan / best:.3f}" if best > 0 else "-", f"{100 * r.bubble:.1f}%",
             format_bytes(r.peak_bytes))
            for i, r in enumerate(selection.ranked)
        ]
        widths = [max(len(h), *(len(row[c]) for row in rows)) for c, h in enumerate(header)]
        lines.append("  ".join(h.ljust(w) for h, w in zip(header, widths)).rstrip())
        lines += ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip()
                  for row in rows]
    else:
        lines.append("no schedule fits the budget")
    if selection.excluded:
        lines += ["", "excluded:"]
        lines += [f"  {e.name} (v={e.chunks}): {e.reason}" for e in selection.excluded]
    return "\n".join(lines)
