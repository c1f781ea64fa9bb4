"""``simulate``: build (or load) a schedule, validate it, predict its timeline, print it."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ..analysis.costs import ACTIVATION_UNIT, activations_in_v1_units
from ..analysis.lowering import MEGATRON, USER, nccl_choice
from ..analysis.render import render_ascii, render_chrome_trace, render_html
from ..analysis.simulate import CostModel, async_steady_state, simulate
from ..analysis.user_program import load  # compute-only, or with its own P2P batches
from ..ir import Schedule
from ..schedules import build_schedule, is_async_schedule, schedule_names
from ..schedules.validate import CHANNELS, validate_schedule
from ..integration.stage_layers import describe
from ..analysis.select import zb_auto_options
from ..schedules.zb_auto import NAME as ZB_AUTO
from .common import (COSTS_HELP, activation_of, add_cost_args, add_megatron_args, add_memory_args,
                     add_size_args, budget_of, cost_flags_given, costs_from_args, describe_costs,
                     megatron_argv, peak_line, write_out_file)
from .hints import warn_p_exceeds_m

FORMATS = ("ascii", "json", "html", "chrome")


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "simulate",
        help="predict a schedule's timeline under a cost model",
        description="Build a registered schedule (or load one from CSV / JSON), validate it, "
        "simulate it under the cost model and print the timeline. " + COSTS_HELP,
    )
    parser.add_argument("--schedule", metavar="NAME", help=f"one of {', '.join(schedule_names())}")
    add_size_args(parser)
    parser.add_argument("--chunks", "-v", type=int, metavar="V",
                        help="model chunks per rank (default: the schedule's own)")
    parser.add_argument("--csv", metavar="FILE",
                        help="load the schedule from a CSV (or .json) file instead of a builder")
    add_cost_args(parser)
    parser.add_argument("--format", choices=FORMATS, default="ascii")
    parser.add_argument("--out", metavar="FILE", help="write there instead of to stdout")
    parser.add_argument("--width", type=int, help="ascii: scale the grid to this many columns")
    parser.add_argument("--max-pending-backward", type=int, metavar="K",
                        help="builder option of the zero-bubble schedules")
    parser.add_argument("--warmup-forwards", type=int, metavar="W",
                        help="zb-v: chunk-0 forwards before the first chunk-1 input gradient, "
                        "p (default) to 2p-1")
    parser.add_argument("--channels", choices=CHANNELS, default="sender",
                        help="message matching to validate against: one in-order channel per "
                        "rank pair (default, NCCL) or per pair and kind (activations apart "
                        "from gradients)")
    parser.add_argument("--nccl-program", action="store_true",
                        help="print instead the P2P program the executor posts on NCCL (one "
                        "row per rank: actions, (ops)BATCH#k, WAIT#k), checked against "
                        "NCCL's rules")
    parser.add_argument("--vertical-sync", action="store_true",
                        help="pipedream: every stage uses the version a microbatch entered with")
    parser.add_argument("--communication", choices=("buffered", "nccl"), default="buffered",
                        help="how messages are charged: buffered (a message leaves when its "
                        "producer ends, + t_comm; default) or nccl (the program the executor "
                        "posts on NCCL, timed under NCCL's rules: rendezvous sends, one "
                        "stream of batches per rank; its batches are drawn as p2p rows)")
    add_memory_args(parser)  # zb-auto is synthesized under them
    add_megatron_args(parser, "simulate the schedule on this model: p, m, v and every stage's "
                      "layers from the arguments (as plan reads them), each stage priced from "
                      "its FLOPs with --gpu")
    parser.set_defaults(func=run)


def load_schedule(path: str) -> Schedule:
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise OSError(f"cannot read schedule file {path}: {exc.strerror or exc}") from None
    if path.endswith(".json"):
        return Schedule.from_json(text)

    return load(text, name=Path(path).stem)[0]


def make_schedule(args, costs: CostModel | None = None, measured=None) -> Schedule:
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
    if args.warmup_forwards is not None:
        options["warmup_forwards"] = args.warmup_forwards
    options.update(_synthesis_options(args, costs, measured))
    return build_schedule(args.schedule, args.ranks, args.microbatches, args.chunks,
                          validate=False, **options)


def _synthesis_options(args, costs: CostModel | None, measured) -> dict:
    """zb-auto's builder options: the costs and the per-rank budget it is synthesized for
    (default: 1F1B's peak, in counts of microbatches without --activation)."""
    budget = budget_of(args, required=False)
    given = [flag for flag in ("activation", "activation_bytes", "activation_mb")
             if getattr(args, flag) is not None]
    if str(args.schedule).strip().lower() != ZB_AUTO:
        if budget is not None or given:
            raise ValueError("--memory-budget and --activation shape zb-auto only (every other "
                             "schedule's memory is predicted without them): drop them, or "
                             "choose --schedule zb-auto")
        return {}
    activation, _ = activation_of(args, measured, required=False)
    if budget is not None and activation is None:
        raise ValueError("--memory-budget is in bytes: give one microbatch's activation bytes "
                         "too (--activation SIZE), or --costs a train summary.json that "
                         "measured them")
    return zb_auto_options(costs or CostModel(), args.ranks,
                           1.0 if activation is None else activation, budget)


def nccl_program_text(schedule: Schedule) -> str:
    """The lowered program the executor posts on NCCL, after checking it (raises if it could
    hang), with a first line saying which posting it uses."""
    choice = nccl_choice(schedule)  # one lowering and check for the line and the program
    posting = choice.posting
    why = {MEGATRON: "Megatron's fused calls pass NCCL's rules",
           USER: "the schedule file's own batches, as written"}.get(
        posting, "Megatron's fused calls could hang under NCCL's rules, so one batch per round")
    if choice.post_ahead:
        why += "; receives posted ahead of the compute, proven safe and faster"
    return (f"# {schedule.name}: {posting} posting ({why}); checked: no hang, every pair "
            f"matched in order\n" + choice.program.to_csv())


def run(args) -> int:
    argv = megatron_argv(args)
    if argv:
        return _run_planned(args, argv)
    measured = None
    if not args.nccl_program:
        costs, unit, measured = costs_from_args(args)  # fills -p / -m from --costs
    if args.schedule and is_async_schedule(args.schedule) and not args.nccl_program:
        return _run_async(args, costs, unit)
    schedule = make_schedule(args, None if args.nccl_program else costs, measured)
    warn_p_exceeds_m(schedule.num_ranks, schedule.num_microbatches)
    if args.nccl_program:
        validate_schedule(schedule)
        return _write(args, nccl_program_text(schedule).rstrip("\n"))
    if measured is not None and schedule.num_ranks != measured.num_ranks:
        raise ValueError(f"{args.costs} has costs of {measured.num_ranks} pipeline ranks; "
                         f"the schedule has {schedule.num_ranks}")
    notes = describe_costs(costs, unit, measured, args.assume_split) if measured else None
    return _show(args, schedule, costs, unit, notes)


def _run_planned(args, argv: list[str]) -> int:
    """``simulate -- ARGS``: the schedule on the model Megatron-LM's arguments describe (p, m,
    v, every stage's layers), priced per stage from its FLOPs with ``--gpu``, unless cost
    flags or ``--costs`` are given."""
    from ..planner.pretrain_plan import plan_pretrain  # Megatron-LM's parser: seconds

    if args.csv or args.ranks or args.microbatches or args.chunks or args.nccl_program:
        raise ValueError("with Megatron-LM's arguments after --, p, m and v come from them: "
                         "drop -p / -m / -v / --csv / --nccl-program (give --schedule NAME or "
                         "a schedule file)")
    plan = plan_pretrain(argv, schedule=args.schedule, world_size=args.world_size,
                         gpu=args.gpu, gpu_memory=args.gpu_memory, efficiency=args.efficiency,
                         reserve=args.reserve, machine=args.machine)
    args.ranks, args.microbatches = plan.pp, plan.m
    if args.costs or cost_flags_given(args):
        costs, unit, measured = costs_from_args(args)
        what = (describe_costs(costs, unit, measured, args.assume_split) if measured else
                "the given costs")
    elif plan.stage_costs:
        costs, unit, what = plan.own_costs(), "s", plan.costs_text
    else:
        costs, unit, what = CostModel(), "t", "unit costs (give --gpu NAME to price each stage)"
    notes = (f"{plan.name}: p={plan.pp}, m={plan.m}, v={plan.v} from Megatron-LM's arguments; "
             f"stages {describe(plan.stages)}; {what}")
    return _show(args, plan.schedule, costs, unit, notes)


def _show(args, schedule: Schedule, costs: CostModel, unit: str, notes: str | None) -> int:
    """The timeline in the chosen format (``notes``: a few lines said before it)."""
    timeline = simulate(schedule, costs, channels=args.channels,  # validates first
                        communication=args.communication)
    timeline.unit = unit
    if args.format == "ascii":
        text = render_ascii(timeline, width=args.width)
        if timeline.chunks > 1:  # the renderer's peaks count chunk-activations
            text += "\n" + peak_line(timeline)
        if notes:
            text = notes + "\n\n" + text
        notes = None
    elif args.format == "json":
        text = json.dumps(summary(schedule, timeline, costs), indent=1)
        notes = None
    elif args.format == "html":
        text = render_html([timeline], title=f"{schedule.name}: predicted timeline")
    else:
        text = json.dumps(render_chrome_trace(timeline))
    if notes:  # html / chrome: the costs on stdout beside "wrote", else on stderr
        print(notes, file=sys.stdout if args.out else sys.stderr)
    return _write(args, text)


def _run_async(args, costs, unit: str) -> int:
    """PipeDream / 2BW: no step to draw, a run of 4 optimizer batches that never flushes,
    and its steady state per microbatch against the floor and flushed 1F1B."""

    if args.ranks is None or args.microbatches is None:
        raise ValueError(f"--schedule {args.schedule} needs --ranks P and --microbatches M")
    warn_p_exceeds_m(args.ranks, args.microbatches)
    steady = async_steady_state(args.schedule.strip().lower(), args.ranks, args.microbatches,
                                costs, vertical_sync=args.vertical_sync)
    timeline = steady.timeline
    timeline.unit = unit
    line = (f"steady state: {steady.per_microbatch:g} {unit} per microbatch (floor "
            f"{steady.floor:g}, flushed 1f1b {steady.flushed_1f1b:g}); weight versions held "
            f"per rank {steady.versions_held} (count); the run: 4 batches of "
            f"m={args.microbatches}, never flushed")
    if args.format == "ascii":
        text = render_ascii(timeline, width=args.width) + "\n" + line
    elif args.format == "json":
        text = json.dumps({"schedule": steady.name, "unit": unit,
                           "per_microbatch": steady.per_microbatch, "floor": steady.floor,
                           "flushed_1f1b": steady.flushed_1f1b, "makespan": steady.makespan,
                           "versions_held": steady.versions_held}, indent=1)
    elif args.format == "html":
        text = render_html([timeline], title=f"{steady.name}: predicted run ({line})")
    else:
        text = json.dumps(render_chrome_trace(timeline))
    return _write(args, text)


def _write(args, text: str) -> int:
    if args.out:
        write_out_file(args, text)
    else:
        sys.stdout.write(text + "\n")
    return 0


def summary(schedule: Schedule, timeline, costs: CostModel | None = None) -> dict:
    data = {
        "schedule": schedule.name,
        "ranks": schedule.num_ranks,
        "microbatches": schedule.num_microbatches,
        "chunks": schedule.chunks,
        "unit": timeline.unit,
        "makespan": timeline.makespan,
        "bubble_fraction": timeline.bubble_fraction,
        "window_bubble_fraction": timeline.window_bubble_fraction,
        "peak_activations": activations_in_v1_units(timeline.peak_activations,
                                                    timeline.chunks),
        "peak_chunk_activations": list(timeline.peak_activations),
        "activation_unit": ACTIVATION_UNIT,
        "actions": schedule.text(),
        "stage_to_rank": list(schedule.stage_to_rank),
        "per_rank": timeline.per_rank_summary(),
    }
    if costs is not None:
        data["costs"] = {k: getattr(costs, k) for k in ("t_f", "t_i", "t_w", "t_b", "t_comm",
                                                         "t_overhead", "per")}
    return data
