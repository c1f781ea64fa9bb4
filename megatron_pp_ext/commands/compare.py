"""``compare``: every schedule side by side for one p, m and one set of costs.

    python -m megatron_pp_ext compare -p 4 -m 8 [--costs out/train/summary.json] [--out compare.html]

Each registered schedule that allows p and m, with its default chunks (interleaved: v=2,
or ``--chunks``), is simulated with the same costs (a rank's share of one microbatch; a
v-chunk schedule's actions cost 1/v of it): predicted step time with its unit, bubble, peak
activations per rank in v=1 units. ``--out`` writes one HTML page with every timeline.
"""

from __future__ import annotations

import json

from ..analysis.costs import ACTIVATION_UNIT, format_counts, format_time
from ..analysis.render import render_html
from ..analysis.select import MiB, format_bytes, select_schedules
from ..schedules import REGISTRY, get_spec, schedule_names
from ..units import aligned_columns
from .hints import warn_p_exceeds_m
from .common import (COSTS_HELP, add_cost_args, add_megatron_args, add_size_args, costs_from_args,
                     describe_costs, megatron_argv, select_on_model, write_out_file)

FORMATS = ("text", "json")


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "compare",
        help="every schedule side by side for one p, m and set of costs (table, HTML)",
        description="Simulate every registered schedule that allows P and M, each with its "
        "default chunks per rank, under the same costs, and show them side by side: predicted "
        "step time, bubble, peak activations per rank (in v=1 units). " + COSTS_HELP,
    )
    add_size_args(parser)
    add_cost_args(parser)
    parser.add_argument("--schedules", metavar="A,B,...",
                        help=f"which (default: all of {', '.join(schedule_names())})")
    parser.add_argument("--chunks", "-v", type=int, metavar="V",
                        help="interleaved's chunks per rank (default 2)")
    parser.add_argument("--activation-mb", type=float, metavar="X",
                        help="MiB one microbatch's activations take on one rank (v=1): adds "
                        "each schedule's peak activation memory")
    parser.add_argument("--out", metavar="FILE",
                        help="write one HTML page with every schedule's timeline there")
    parser.add_argument("--format", choices=FORMATS, default="text")
    add_megatron_args(parser, "every schedule planned on this model, layout and GPU (as plan "
                      "does) side by side, with each rank's bytes against the GPU's memory")
    parser.set_defaults(func=run)


def candidates(args) -> list[tuple[str, int]]:
    names = list(REGISTRY)
    if args.schedules:
        names = [get_spec(n.strip()).name for n in args.schedules.split(",") if n.strip()]
    out = []
    for name in names:
        spec = get_spec(name)
        v = spec.default_chunks
        if args.chunks is not None and spec.name == "interleaved":
            v = args.chunks
        out.append((spec.name, v))
    return out


def _as_built(selection, name: str, v: int | None) -> tuple[str, int | None]:
    """(name, v) as the selection built it: zb-auto's v is the layout it chose."""
    if v is not None:
        return name, v
    return next((key for key in selection.timelines if key[0] == name), (name, v))


def run(args) -> int:
    argv = megatron_argv(args)
    if argv:
        return _run_pretrain(args, argv)
    costs, unit, measured = costs_from_args(args)
    p, m = _check_sizes(args)
    activation = (args.activation_mb or 0.0) * MiB
    pairs = candidates(args)
    selection = select_schedules(p, m, costs, activation_bytes=activation,
                                 memory_budget_bytes=float("inf"), candidates=pairs)
    pairs = [_as_built(selection, name, v) for name, v in pairs]
    rows = _rows(selection, pairs, args.activation_mb is not None)
    left_out = list(selection.excluded)
    timelines = []
    for key in pairs:
        if key in selection.timelines:
            timeline = selection.timelines[key]
            timeline.unit = unit
            timelines.append(timeline)

    if args.format == "json":
        print(json.dumps({
            "ranks": p, "microbatches": m, "unit": unit,
            "costs": {k: getattr(costs, k) for k in ("t_f", "t_i", "t_w", "t_b", "t_comm",
                                                     "t_overhead")},
            "costs_file": measured.path if measured else None,
            "assume_split": args.assume_split,
            "activation_unit": ACTIVATION_UNIT,
            "schedules": rows,
            "not_compared": [e._asdict() for e in left_out],
        }, indent=1))
    else:
        print(describe_costs(costs, unit, measured, args.assume_split) + "\n")
        print(table(p, m, unit, rows, args.activation_mb is not None))
        if left_out:
            print("\nnot compared:")
            for e in left_out:
                print(f"  {e.name} (v={e.chunks}): {e.reason}")
    if args.out:
        _write_html(args, p, m, costs, unit, measured, timelines)
    return 0


def _run_pretrain(args, argv: list[str]) -> int:
    """``compare -- <pretrain_gpt.py args>``: every schedule planned on the model, the table
    ``select`` prints (those that do not fit included), ``--out``: every timeline."""
    names = [n.strip() for n in args.schedules.split(",") if n.strip()] if args.schedules \
        else None
    selection, text = select_on_model(args, argv, names)
    print(text)
    plans = selection.ranked + selection.too_big
    if args.out and plans:
        title = (f"p={plans[0].p}, m={plans[0].m}: every schedule on the model, each stage "
                 f"from its FLOPs on the {plans[0].gpu.name} (seconds)")
        write_out_file(args, render_html([plan.timeline for plan in plans], title=title))
    return 0


def _check_sizes(args) -> tuple[int, int]:
    """P and M (a --costs file may have supplied them) and a usable --activation-mb, refused
    before anything is simulated."""
    if args.ranks is None or args.microbatches is None:
        raise ValueError("compare needs --ranks P and --microbatches M (or --costs FILE, "
                         "whose run gives them)")
    p, m = args.ranks, args.microbatches
    warn_p_exceeds_m(p, m)
    if args.activation_mb is not None and args.activation_mb < 0:
        raise ValueError(f"--activation-mb {args.activation_mb:g} must be >= 0")
    return p, m


def _rows(selection, pairs: list[tuple[str, int]], with_bytes: bool) -> list[dict]:
    """One row per compared schedule, in the order asked for (those the selection left out
    have none); peak bytes only when --activation-mb gave a microbatch's size."""
    by_key = {(r.name, r.chunks): r for r in selection.ranked}
    fastest = min((r.makespan for r in selection.ranked), default=0.0)
    rows = []
    for key in pairs:
        if key not in by_key:
            continue
        r = by_key[key]
        rows.append({
            "schedule": r.name, "chunks": r.chunks, "step_time": r.makespan,
            "vs_fastest": r.makespan / fastest if fastest > 0 else None,
            "bubble": r.bubble,
            "peak_activations": selection.peak_activations_v1(*key),
            "peak_chunk_activations": selection.peak_activations[key],
            "peak_bytes": r.peak_bytes if with_bytes else None,
        })
    return rows


def _write_html(args, p: int, m: int, costs, unit: str, measured, timelines: list) -> None:
    """--out: every timeline on one page; the note that it was written goes to stderr under
    --format json, so that stdout stays one JSON document."""
    what = "measured costs" if measured else "unit costs" if _unit_costs(costs) else \
        "the given costs"
    title = (f"p={p}, m={m}: every schedule predicted with {what} "
             f"({'seconds' if unit == 's' else 'cost units t'})")
    write_out_file(args, render_html(timelines, title=title))


def _unit_costs(costs) -> bool:
    return (costs.t_f == 1.0 and costs.t_i is None and costs.t_w is None and costs.t_b is None
            and costs.t_comm == 0 and costs.t_overhead == 0)


def table(p: int, m: int, unit: str, rows: list[dict], with_bytes: bool) -> str:
    what = "ms, predicted from measured seconds" if unit == "s" else "t, the unit of the costs"
    header = ["schedule", "v", "step time", "vs fastest", "bubble",
              "peak activations per rank (v=1 units)"]
    if with_bytes:
        header.append("peak memory")
    cells = [header]
    for row in rows:
        line = [row["schedule"], str(row["chunks"]), format_time(row["step_time"], unit),
                "-" if row["vs_fastest"] is None else f"{row['vs_fastest']:.3f}",
                f"{100 * row['bubble']:.1f}%", format_counts(row["peak_activations"])]
        if with_bytes:
            line.append(format_bytes(row["peak_bytes"]))
        cells.append(line)
    lines = [f"p={p} m={m}: step time in {what}"] + aligned_columns(cells)
    lines.append(f"({ACTIVATION_UNIT})")
    return "\n".join(lines)
