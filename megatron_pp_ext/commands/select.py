"""``select``: rank the schedules by predicted step time under a per-rank memory budget."""

from __future__ import annotations

import argparse
import json
import sys

from ..analysis.costs import ACTIVATION_UNIT, format_counts, format_time
from ..analysis.select import MiB, Selection, format_bytes, parse_size, select_schedules
from ..schedules import schedule_names
from .hints import warn_p_exceeds_m
from .common import (COSTS_HELP, add_cost_args, add_megatron_args, add_size_args,
                     costs_from_args, describe_costs, megatron_argv, select_on_model)

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
        "optimizer step synchronizes the ranks between steps). " + COSTS_HELP + " A v-chunk "
        "schedule's chunk holds 1/v of the activation.",
    )
    add_size_args(parser)
    add_cost_args(parser)
    memory = parser.add_argument_group(
        "memory (bytes; a size takes a unit: 2GiB, 512MiB, 1.5GB; a bare number is bytes)")
    budget = memory.add_mutually_exclusive_group()
    budget.add_argument("--memory-budget", type=_size, metavar="SIZE",
                        help="bytes per rank available for activations, e.g. 2GiB")
    budget.add_argument("--memory-budget-bytes", type=_size, metavar="N",
                        help="the same in bytes")
    budget.add_argument("--memory-budget-mb", type=float, metavar="Y",
                        help="the same in MiB (2^20 bytes; kept for older command lines)")
    activation = memory.add_mutually_exclusive_group()
    activation.add_argument("--activation", type=_size, metavar="SIZE",
                            help="bytes one microbatch's activations take on one rank (v=1), "
                            "every rank alike; default with --costs SUMMARY.json: measured per "
                            "rank (its activation_bytes_per_stage)")
    activation.add_argument("--activation-bytes", type=_size, metavar="N",
                            help="the same in bytes")
    activation.add_argument("--activation-mb", type=float, metavar="X",
                            help="the same in MiB (2^20 bytes; kept for older command lines)")
    parser.add_argument("--schedules", metavar="A,B,...",
                        help=f"candidates (default: all of {', '.join(schedule_names())})")
    parser.add_argument("--chunks-options", type=int_list, default=(2, 3, 4), metavar="V,...",
                        help="interleaved chunk counts to try (default 2,3,4)")
    parser.add_argument("--format", choices=FORMATS, default="text")
    add_megatron_args(parser, "each candidate planned on its model, layout and GPU (as plan "
                      "does), ranked among those whose every rank fits in memory")
    parser.set_defaults(func=run)


def run(args) -> int:
    candidates = None
    if args.schedules:
        candidates = [name.strip() for name in args.schedules.split(",") if name.strip()]
    argv = megatron_argv(args)
    if argv:
        return run_pretrain(args, argv, candidates)
    costs, unit, measured = costs_from_args(args)
    if args.ranks is None or args.microbatches is None:
        raise ValueError("select needs --ranks P and --microbatches M (or --costs FILE, "
                         "whose run gives them)")
    warn_p_exceeds_m(args.ranks, args.microbatches)
    activation, activation_from = activation_of(args, measured)
    selection = select_schedules(
        args.ranks, args.microbatches, costs,
        activation_bytes=activation,
        memory_budget_bytes=budget_of(args),
        candidates=candidates, chunks_options=args.chunks_options,
    )
    if args.format == "json":
        data = selection.to_dict()
        data["unit"] = unit
        data["activation_bytes_from"] = activation_from
        if measured is not None:
            data["costs_file"] = measured.path
            data["assume_split"] = args.assume_split
        text = json.dumps(data, indent=1)
    else:
        text = render_text(selection, unit, activation_from)
        if measured is not None or args.assume_split is not None:
            text = describe_costs(costs, unit, measured, args.assume_split) + "\n\n" + text
    sys.stdout.write(text + "\n")
    return 0


def _size(text: str) -> float:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def budget_of(args) -> float:
    """The per-rank budget in bytes, from whichever flag was given."""
    if args.memory_budget is not None:
        return args.memory_budget
    if args.memory_budget_bytes is not None:
        return args.memory_budget_bytes
    if args.memory_budget_mb is not None:
        return args.memory_budget_mb * MiB
    raise ValueError("select needs a memory budget per rank: --memory-budget SIZE (e.g. 2GiB), "
                     "--memory-budget-bytes N or --memory-budget-mb Y")


def activation_of(args, measured) -> tuple:
    """(one microbatch's activation bytes per rank, v=1: a number or a list; where from)."""
    for flag, scale in (("activation", 1), ("activation_bytes", 1), ("activation_mb", MiB)):
        value = getattr(args, flag)
        if value is not None:
            if value < 0:
                raise ValueError(f"--{flag.replace('_', '-')} {value:g} must be >= 0")
            return value * scale, "given"
    if measured is not None and measured.activation_bytes:
        return list(measured.activation_bytes), f"measured ({measured.path})"
    raise ValueError("select needs one microbatch's activation bytes per rank: --activation "
                     "SIZE (e.g. 24MiB), --activation-bytes N, --activation-mb X, or --costs "
                     "a train summary.json that measured them (activation_bytes_per_stage)")


def render_text(selection: Selection, unit: str = "t", activation_from: str = "given") -> str:
    p, m = selection.num_ranks, selection.num_microbatches
    what = "ms (from measured seconds)" if unit == "s" else "t (the unit of the costs)"
    act = selection.activation_bytes
    act_text = (format_bytes(act) if isinstance(act, (int, float)) else
                "[" + ", ".join(format_bytes(b) for b in act) + "] (per rank)")
    lines = [f"p={p} m={m}; activation {act_text} per microbatch per rank"
             + ("" if activation_from == "given" else f", {activation_from}")
             + f"; budget {format_bytes(selection.memory_budget_bytes)} per "
             f"rank; step time in {what}", ""]
    if selection.ranked:
        best = selection.ranked[0].makespan
        header = ("#", "schedule", "v", "step time", "vs best", "bubble", "peak memory",
                  "peak activations per rank (v=1 units)")
        rows = [
            (str(i + 1), r.name, str(r.chunks), format_time(r.makespan, unit),
             f"{r.makespan / best:.3f}" if best > 0 else "-", f"{100 * r.bubble:.1f}%",
             format_bytes(r.peak_bytes),
             format_counts(selection.peak_activations_v1(r.name, r.chunks)))
            for i, r in enumerate(selection.ranked)
        ]
        widths = [max(len(h), *(len(row[c]) for row in rows)) for c, h in enumerate(header)]
        lines.append("  ".join(h.ljust(w) for h, w in zip(header, widths)).rstrip())
        lines += ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip()
                  for row in rows]
        lines.append(f"({ACTIVATION_UNIT})")
    else:
        lines.append("no schedule fits the budget")
    if selection.excluded:
        lines += ["", "excluded:"]
        lines += [f"  {e.name} (v={e.chunks}): {e.reason}" for e in selection.excluded]
    return "\n".join(lines)


def run_pretrain(args, argv: list[str], candidates) -> int:
    """``select -- <pretrain_gpt.py args>``: every candidate planned on the model."""
    sys.stdout.write(select_on_model(args, argv, candidates)[1] + "\n")
    return 0
