"""``select``: rank the schedules by predicted step time under a per-rank memory budget."""

from __future__ import annotations

import argparse
import json
import sys

from ..analysis.costs import ACTIVATION_UNIT, format_counts, format_time
from ..analysis.select import Selection, format_bytes, select_schedules
from ..schedules import schedule_names
from ..units import aligned_columns
from .hints import warn_p_exceeds_m
from .common import (COSTS_HELP, activation_of, add_cost_args, add_megatron_args,
                     add_memory_args, add_size_args, budget_of, costs_from_args, describe_costs,
                     megatron_argv, select_on_model)

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
    add_memory_args(parser)
    parser.add_argument("--schedules", metavar="A,B,...",
                        help=f"candidates (default: all of {', '.join(schedule_names())})")
    parser.add_argument("--chunks-options", type=int_list, default=(2, 3, 4), metavar="V,...",
                        help="interleaved chunk counts to try (default 2,3,4)")
    parser.add_argument("--format", choices=FORMATS, default="text")
    add_megatron_args(parser, "each candidate planned on its model, layout and GPU (as plan "
                      "does), ranked among those whose every rank fits in memory")
    parser.add_argument("--search-recompute", action="store_true",
                        help="with -- ARGS: plan each candidate at the cheapest activation "
                        "recompute that fits (none, selective, full of the first n layers of "
                        "each chunk, of every layer), priced from the recomputed FLOPs")
    parser.add_argument("--search-parallelism", action="store_true",
                        help="with -- ARGS, --world-size N and --gpu (or --machine): search tp, "
                        "pp, cp, ep and the micro batch too (every split of N GPUs Megatron "
                        "accepts), then every schedule and recompute on the fastest; prints "
                        "the best configurations and the flags to set and drop")
    parser.add_argument("--scale-out", type=int, default=1, metavar="N",
                        help="with -- ARGS: the same model at N times the data-parallel size "
                        "(the global batch fixed: N times fewer microbatches per pipeline)")
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
        lines += aligned_columns([header, *rows])
        lines.append(f"({ACTIVATION_UNIT})")
    else:
        lines.append("no schedule fits the budget")
    if selection.excluded:
        lines += ["", "excluded:"]
        lines += [f"  {e.name} (v={e.chunks}): {e.reason}" for e in selection.excluded]
    return "\n".join(lines)


def run_pretrain(args, argv: list[str], candidates) -> int:
    """``select -- <pretrain_gpt.py args>``: every candidate planned on the model."""
    if args.search_parallelism:
        return run_parallel_search(args, argv, candidates)
    sys.stdout.write(select_on_model(args, argv, candidates)[1] + "\n")
    return 0


def run_parallel_search(args, argv: list[str], candidates) -> int:
    """``select --search-parallelism -- ARGS``: tp / pp / cp / ep / micro batch too."""
    from ..planner.parallel_search import search_parallelism
    from ..planner.parallel_search_report import search_dict, search_report

    if args.scale_out != 1 or args.search_recompute:
        raise ValueError("--search-parallelism searches the recompute itself and plans the "
                         "world size given: drop --scale-out / --search-recompute")
    search = search_parallelism(argv, gpu=args.gpu, world_size=args.world_size,
                                machine=args.machine, gpu_memory=args.gpu_memory,
                                reserve=args.reserve, candidates=candidates,
                                progress=_progress_line(sys.stderr))
    if sys.stderr.isatty():
        sys.stderr.write("\r" + " " * 100 + "\r")
    text = (json.dumps(search_dict(search, argv), indent=1) if args.format == "json" else
            search_report(search, argv))
    sys.stdout.write(text + "\n")
    return 0


def _progress_line(stream):
    """One line rewritten in place on a terminal; elsewhere a line per pass."""
    def show(text: str) -> None:
        if stream.isatty():
            stream.write("\r" + text[:100].ljust(100))
        elif not text.startswith("screening") or text.startswith("screening 1/"):
            stream.write(text + "\n")
        stream.flush()
    return show
