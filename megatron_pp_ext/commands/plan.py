"""``plan``: the plan for a Megatron-LM command line, checked without a GPU.

    python -m megatron_pp_ext plan --schedule zb-v [--world-size 64] -- <pretrain_gpt.py args>
    python -m megatron_pp_ext plan --schedule zb-v -- torchrun --nnodes 8 --nproc-per-node 8 \\
        pretrain_gpt.py <args>

The arguments after ``--`` are parsed by Megatron-LM's own parser (with the plugin's
``--pipeline-schedule`` group), as pretrain_gpt.py parses them; a launcher in front of the
script gives the world size. The plan derives p, m, v, dp and the layout, checks the schedule
against them (the error names the values and the fix), and prints the predicted step and
bubble and each rank's peak activation bytes, estimated from the model's dimensions
(Korthikanti et al. 2022: sequence, micro batch, hidden size, heads, layers per stage, tensor
and sequence parallelism, recompute). ``--out FILE`` writes the predicted timeline as HTML.
"""

from __future__ import annotations

import argparse
import json

from ..analysis.render import render_html
from ..analysis.simulate import CostModel, simulate
from .common import (add_cost_args, add_megatron_args, cost_flags_given, costs_from_args,
                     megatron_argv, write_out_file)

UNITS = ("s", "t")


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "plan",
        help="the plan for a Megatron-LM pretrain_gpt.py command line: p, m, v, dp, layout, "
        "predicted step, bubble, activation bytes per rank (no GPU)",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--schedule", metavar="NAME",
                        help="the schedule to plan: a name, or a schedule file (.csv, .json) "
                        "(default: the arguments' --pipeline-schedule, else Megatron's own: "
                        "1f1b, or interleaved with virtual stages)")
    add_cost_args(parser)
    parser.add_argument("--unit", choices=UNITS, default=None,
                        help="what --t-f, --t-i, --t-w, --t-b, --t-comm are in: s (seconds, the "
                        "default when any is given: the step is printed in ms) or t (cost "
                        "units); unit costs (none given) are t, --costs seconds")
    parser.add_argument("--out", metavar="FILE", help="write the predicted timeline (HTML) there")
    parser.add_argument("--format", choices=("text", "json"), default="text")
    add_megatron_args(parser, "the command line to plan; --gpu prices its stages and holds "
                      "its ranks to the GPU's memory")
    parser.set_defaults(func=run)


def run(args) -> int:
    from ..planner.pretrain_plan import plan_pretrain, plan_report

    argv = megatron_argv(args)
    if not argv:
        raise ValueError("give pretrain_gpt.py's arguments after '--', e.g. plan --schedule "
                         "zb-v -- --pipeline-model-parallel-size 4 --num-layers 32 ...")
    if args.world_size is not None and args.world_size < 1:
        raise ValueError(f"--world-size {args.world_size} must be >= 1")
    plan = plan_pretrain(argv, schedule=args.schedule, world_size=args.world_size,
                         gpu=args.gpu, gpu_memory=args.gpu_memory, efficiency=args.efficiency,
                         reserve=args.reserve, machine=args.machine)

    # the costs, checked against the plan's p (a measured rank's share holds for that p only)
    given = cost_flags_given(args)
    args.ranks, args.microbatches = plan.pp, plan.m
    costs, unit, measured = costs_from_args(args)
    if measured is None and not given and args.assume_split is None and plan.stage_costs:
        costs = None  # the plan's own: each stage from its FLOPs on --gpu
    elif measured is None:
        if given:
            unit = args.unit or "s"
        elif args.assume_split is None:
            costs = CostModel()
    elif args.unit == "t":
        raise ValueError("--costs are measured seconds: drop --unit t")
    if costs is not None:
        plan.timeline = simulate(plan.schedule, costs, validate=False)
        plan.timeline.unit = unit
        plan.costs_text = costs_text(costs, unit, measured, given)

    if args.format == "json":
        data = plan.to_dict()
        data["costs"] = (plan.stage_costs if costs is None else
                         {k: getattr(costs, k) for k in ("t_f", "t_i", "t_w", "t_b", "t_comm",
                                                         "t_overhead")})
        data["costs_text"] = plan.costs_text
        data["costs_file"] = measured.path if measured else None
        print(json.dumps(data, indent=1))
    else:
        if measured is not None:
            print(measured.describe(args.assume_split))
        print(plan_report(plan))
    if args.out:
        title = (f"{plan.name}: p={plan.pp}, m={plan.m}, v={plan.v} (tp {plan.tp}, dp "
                 f"{plan.dp}): predicted timeline of the plan ({plan.costs_text})")
        write_out_file(args, render_html([plan.timeline], title=title))
    return 0


def costs_text(costs: CostModel, unit: str, measured, given: bool) -> str:
    """The costs the step was predicted with, in a few words."""
    if measured is not None:
        return f"costs measured in {measured.path}, seconds"
    if not given:
        return ("unit costs: a rank's share of one microbatch t_F = t_I = t_W = 1 t, t_B = 2 t, "
                "no message time")
    parts = []
    for name in ("t_f", "t_i", "t_w", "t_b", "t_comm", "t_overhead"):
        value = getattr(costs, name)
        if value is None or (name in ("t_comm", "t_overhead") and not value):
            continue
        shown = (f"{value:g}" if isinstance(value, (int, float))
                 else ",".join(f"{x:g}" for x in value))
        parts.append(f"{name}={shown}")
    return (f"given costs in {'seconds' if unit == 's' else 'cost units t'}, a rank's share of "
            f"one microbatch: {' '.join(parts)}")
