"""What the commands share: the size and cost arguments (``-p``, ``-m``, ``-v``, ``--t-f`` ...,
``--costs FILE``), reading them into a ``CostModel``, describing them, and the peak line."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..analysis.costs import (MeasuredCosts, activations_in_v1_units, assume_split,
                              format_counts, load_costs)
from ..analysis.select import MiB, parse_size
from ..analysis.simulate import CostModel
from ..planner.gpus import DEFAULT_RESERVE_BYTES, GPUS
from ..planner.machines import PRESETS


def cost_value(text: str) -> float | list[float]:
    """``2`` -> 2.0; ``1,1,2,1`` -> one cost per stage (or per rank)."""
    try:
        values = [float(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a number or a comma-separated list of numbers"
        ) from None
    return values[0] if len(values) == 1 else values


COSTS_HELP = (
    "Costs are a rank's share of one microbatch: the time one rank spends on all of its layers "
    "(one number, or a comma list with one per rank; a list with one per stage is that "
    "stage's own time). A schedule with v chunks per rank runs actions of 1/v of it each, so "
    "the same costs compare every schedule. --costs FILE reads them as a run measured them "
    "(train's summary.json or trace.json), in seconds."
)


def add_size_args(parser, required: bool = False) -> None:
    """-p/--ranks/--pp and -m/--microbatches, the same in every command."""
    parser.add_argument("--ranks", "-p", "--pp", dest="ranks", type=int, metavar="P",
                        required=required, help="pipeline size (pipeline-parallel ranks)")
    parser.add_argument("--microbatches", "-m", type=int, metavar="M", required=required,
                        help="microbatches per step")


def add_cost_args(parser) -> None:
    """The cost options of simulate, select and compare."""
    group = parser.add_argument_group("costs", COSTS_HELP)
    group.add_argument("--costs", metavar="FILE",
                       help="measured per-rank costs: train's out/train/summary.json, a Chrome "
                       "trace of a measured step (train's trace.json) or a measured timeline's "
                       "JSON; -p and -m default to the run's")
    group.add_argument("--assume-split", type=float, metavar="X",
                       help="costs with only a whole backward B (a 1f1b, gpipe or interleaved "
                       "run): assume I = X*B and W = (1-X)*B to predict the schedules that "
                       "split it (an assumption, printed as such; without it they are refused)")
    group.add_argument("--t-f", type=cost_value, default=None, help="forward (default 1)")
    group.add_argument("--t-i", type=cost_value, default=None,
                       help="input-gradient half of the backward (default 1, or the rest of "
                       "--t-b)")
    group.add_argument("--t-w", type=cost_value, default=None,
                       help="weight-gradient half of the backward (default 1, or the rest of "
                       "--t-b)")
    group.add_argument("--t-b", type=cost_value, default=None,
                       help="whole backward (default t_i + t_w; alone, the split schedules "
                       "need --assume-split)")
    group.add_argument("--t-comm", type=cost_value, default=None,
                       help="time a message takes to arrive, any v (default 0, or as measured "
                       "with --costs)")
    group.add_argument("--t-overhead", type=cost_value, default=None,
                       help="runtime cost added to every F, B and I, any v: posting its "
                       "messages (default 0)")


def costs_from_args(args) -> tuple[CostModel, str, MeasuredCosts | None]:
    """(costs, their unit: "s" measured or "t" cost units, the measurement or None). With
    --costs, fills args.ranks / args.microbatches from the run when not given, and checks
    that -p matches the ranks the costs were measured on."""
    given = [f"--{name.replace('_', '-')}" for name in ("t_f", "t_i", "t_w", "t_b")
             if getattr(args, name) is not None]
    overhead = 0.0 if args.t_overhead is None else args.t_overhead
    if not args.costs:
        costs = CostModel(t_f=1.0 if args.t_f is None else args.t_f, t_i=args.t_i,
                          t_w=args.t_w, t_b=args.t_b,
                          t_comm=0.0 if args.t_comm is None else args.t_comm,
                          t_overhead=overhead)
        if args.assume_split is not None:
            costs = assume_split(costs, args.assume_split)
        return costs, "t", None
    if given:
        raise ValueError(f"give --costs FILE or {', '.join(given)}, not both (--t-comm and "
                         "--t-overhead may be added to --costs)")
    measured = load_costs(args.costs)
    if getattr(args, "ranks", None) is None:
        args.ranks = measured.num_ranks
    elif args.ranks != measured.num_ranks:
        raise ValueError(f"{args.costs} has costs of {measured.num_ranks} pipeline ranks, not "
                         f"-p {args.ranks}: a rank's share changes with the pipeline size "
                         "(measure at that size, or drop -p)")
    if getattr(args, "microbatches", None) is None and measured.num_microbatches:
        args.microbatches = int(measured.num_microbatches)
    costs = measured.cost_model(assume=args.assume_split, t_comm=args.t_comm,
                                t_overhead=overhead)
    return costs, "s", measured


def describe_costs(costs: CostModel, unit: str, measured: MeasuredCosts | None,
                   assume: float | None = None) -> str:
    """The costs in words, with their unit."""
    if measured is not None:
        text = measured.describe(assume)
        if costs.t_overhead:
            text += f"\n  t_overhead = {costs.t_overhead} s per F, B and I (given)"
        return text
    parts = [f"t_f={_num(costs.t_f)}"]
    if costs.t_i is not None or costs.t_b is None:
        parts.append(f"t_i={_num(1.0 if costs.t_i is None else costs.t_i)}")
    if costs.t_w is not None or costs.t_b is None:
        parts.append(f"t_w={_num(1.0 if costs.t_w is None else costs.t_w)}")
    parts.append("t_b=t_i+t_w" if costs.t_b is None else f"t_b={_num(costs.t_b)}")
    text = (f"costs in t (cost units), a rank's share of one microbatch: {' '.join(parts)}; a "
            f"v-chunk schedule's actions cost 1/v of it; t_comm={_num(costs.t_comm)} per "
            "message")
    if costs.t_overhead:
        text += f", t_overhead={_num(costs.t_overhead)} per F, B and I"
    if assume is not None:
        text += f"; I and W assumed: I = {assume:g} B, W = {1 - assume:g} B (--assume-split)"
    return text


def _num(value) -> str:
    if isinstance(value, (int, float)):
        return f"{value:g}"
    return ",".join(f"{x:g}" for x in value)


def peak_line(timeline) -> str:
    """The peak activations per rank, labelled with their unit (v=1 activations)."""
    v = timeline.chunks
    v1 = format_counts(activations_in_v1_units(timeline.peak_activations, v))
    if v == 1:
        return f"peak activations per rank (in v=1 units: one microbatch, all of a rank's " \
               f"layers): {v1}"
    return (f"peak activations per rank: {list(timeline.peak_activations)} chunk-activations "
            f"(1/{v} of a rank's layers each) = {v1} in v=1 units (one microbatch, all of a "
            "rank's layers)")


def add_memory_args(parser) -> None:
    """The per-rank memory budget and one microbatch's activation, in bytes (select takes
    them, and simulate for zb-auto, which is synthesized under them)."""
    memory = parser.add_argument_group(
        "memory (bytes; a size takes a unit: 2GiB, 512MiB, 1.5GB; a bare number is bytes)")
    budget = memory.add_mutually_exclusive_group()
    budget.add_argument("--memory-budget", type=_size_float, metavar="SIZE",
                        help="bytes per rank available for activations, e.g. 2GiB")
    budget.add_argument("--memory-budget-bytes", type=_size_float, metavar="N",
                        help="the same in bytes")
    budget.add_argument("--memory-budget-mb", type=float, metavar="Y",
                        help="the same in MiB (2^20 bytes; kept for older command lines)")
    activation = memory.add_mutually_exclusive_group()
    activation.add_argument("--activation", type=_size_float, metavar="SIZE",
                            help="bytes one microbatch's activations take on one rank (v=1), "
                            "every rank alike; default with --costs SUMMARY.json: measured per "
                            "rank (its activation_bytes_per_stage)")
    activation.add_argument("--activation-bytes", type=_size_float, metavar="N",
                            help="the same in bytes")
    activation.add_argument("--activation-mb", type=float, metavar="X",
                            help="the same in MiB (2^20 bytes; kept for older command lines)")


def _size_float(text: str) -> float:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def budget_of(args, required: bool = True) -> float | None:
    """The per-rank budget in bytes, from whichever flag was given (None: not given and not
    ``required``)."""
    if args.memory_budget is not None:
        return args.memory_budget
    if args.memory_budget_bytes is not None:
        return args.memory_budget_bytes
    if args.memory_budget_mb is not None:
        return args.memory_budget_mb * MiB
    if not required:
        return None
    raise ValueError("select needs a memory budget per rank: --memory-budget SIZE (e.g. 2GiB), "
                     "--memory-budget-bytes N or --memory-budget-mb Y")


def activation_of(args, measured, required: bool = True) -> tuple:
    """(one microbatch's activation bytes per rank, v=1: a number or a list; where from);
    (None, None) when not given, not measured and not ``required``."""
    for flag, scale in (("activation", 1), ("activation_bytes", 1), ("activation_mb", MiB)):
        value = getattr(args, flag)
        if value is not None:
            if value < 0:
                raise ValueError(f"--{flag.replace('_', '-')} {value:g} must be >= 0")
            return value * scale, "given"
    if measured is not None and measured.activation_bytes:
        return list(measured.activation_bytes), f"measured ({measured.path})"
    if not required:
        return None, None
    raise ValueError("select needs one microbatch's activation bytes per rank: --activation "
                     "SIZE (e.g. 24MiB), --activation-bytes N, --activation-mb X, or --costs "
                     "a train summary.json that measured them (activation_bytes_per_stage)")


def add_megatron_args(parser, what: str) -> None:
    """A Megatron-LM command line after ``--`` (``pretrain_gpt.py``'s arguments, optionally
    behind its launcher) and what prices and holds it: ``--gpu``, ``--gpu-memory``,
    ``--machine``, ``--efficiency``, ``--world-size``; the same in plan, select and simulate."""
    group = parser.add_argument_group("a Megatron-LM command line (after --)", what)
    group.add_argument("--gpu", metavar="NAME", type=str.upper, choices=sorted(GPUS),
                       help="price each stage's F, I, W on this GPU's DGX (" + ", ".join(GPUS)
                       + "; see --machine) and hold each rank's bytes to its memory")
    group.add_argument("--gpu-memory", type=_size, metavar="SIZE",
                       help="each rank's memory, e.g. 80GiB (default: --gpu's)")
    group.add_argument("--reserve", type=_size, default=DEFAULT_RESERVE_BYTES, metavar="SIZE",
                       help="of each rank's memory, what is held back for what is not the "
                       "model's: the CUDA context, NCCL's buffers, the allocator's "
                       f"fragmentation (default {DEFAULT_RESERVE_BYTES // 2**30} GiB, assumed; "
                       "give your site's)")
    group.add_argument("--machine", metavar="NAME",
                       help="the machine the step is priced on: " + ", ".join(PRESETS)
                       + " (default: --gpu's DGX), or GPU:GPUS_PER_NODE:NVLINK_GBPS:"
                       "NETWORK_GBPS (per GPU, one direction), e.g. H100:8:450:25")
    group.add_argument("--efficiency", type=float, default=None, metavar="E",
                       help="price each stage from its FLOPs alone at this share of the GPU's "
                       "peak (e.g. 0.5), no messages (default: the machine's model: each "
                       "kernel and message, GEMMs at the share fitted on a published run)")
    group.add_argument("--world-size", type=int, metavar="N",
                       help="GPUs in the job (default: from a torchrun / srun launcher in front "
                       "of the script, else tp x pp x cp, i.e. dp = 1)")
    parser.add_argument("megatron_args", nargs=argparse.REMAINDER, metavar="-- ARGS",
                        help="pretrain_gpt.py's arguments (optionally behind its launcher and "
                        "script: torchrun ... pretrain_gpt.py ...)")


def cost_flags_given(args) -> bool:
    """Whether a cost flag (``--t-f`` ... ``--t-overhead``) is on the command line: given
    costs take the place of a plan's costs from FLOPs (so does ``--costs FILE``)."""
    return any(getattr(args, k) is not None for k in ("t_f", "t_i", "t_w", "t_b", "t_comm",
                                                      "t_overhead"))


def select_on_model(args, argv: list[str], candidates):
    """``(selection, text)``: every candidate planned on the model of ``argv``
    (``planner.pretrain_select``), as JSON or as its table per ``--format``; what
    ``select -- ARGS`` and ``compare -- ARGS`` print."""
    import json

    from ..planner.pretrain_select import select_pretrain, selection_dict, selection_report

    selection = select_pretrain(argv, gpu=args.gpu, world_size=args.world_size,
                                gpu_memory=args.gpu_memory, efficiency=args.efficiency,
                                machine=args.machine, candidates=candidates, reserve=args.reserve,
                                search_recompute=getattr(args, "search_recompute", False),
                                scale_out=getattr(args, "scale_out", 1))
    text = (json.dumps(selection_dict(selection), indent=1) if args.format == "json" else
            selection_report(selection))
    return selection, text


def megatron_argv(args) -> list[str]:
    """The Megatron-LM arguments given after ``--`` (empty when none)."""
    argv = list(getattr(args, "megatron_args", None) or [])
    return argv[1:] if argv and argv[0] == "--" else argv


def _size(text: str) -> int:
    return int(_size_float(text))


def write_out_file(args, text: str) -> None:
    """Writes ``--out``'s file (its folders made as needed) and says so: on stdout, or on
    stderr under ``--format json`` so that stdout stays one JSON document."""
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")
    print(f"wrote {args.out}", file=sys.stderr if getattr(args, "format", "text") == "json"
          else sys.stdout)
