"""A plan for a Megatron-LM command line, without a GPU: what ``pretrain_gpt.py <args>`` would
run under a schedule, checked before any job starts.

    plan = plan_pretrain(["--tensor-model-parallel-size", "2", ...], schedule="zb-v",
                         world_size=64)
    print(plan_report(plan))

The arguments are read as Megatron reads them (``pretrain_args``: its parser, the world size,
dp and m). v = ``--num-virtual-stages-per-pipeline-rank``, or num_layers / pp /
``--num-layers-per-virtual-pipeline-stage`` (``megatron_args._model_chunks``), and the schedule
is checked against it by ``megatron_args.schedule_options_from_args`` (the check
``install_from_args`` makes at run time), then the layers against the stages (an even split).
Activation bytes per rank: ``activation_model`` (per layer and stage) x the simulator's peak
count of microbatch activations alive at once on the rank (``validate.activation_trace``: F
to B, or to W under a split backward). The report: ``plan_report``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from ..analysis.simulate import CostModel, simulate
from ..ir import Schedule
from ..schedules import REGISTRY, build_schedule, is_schedule_file, load_schedule_file
from ..schedules import schedule_layout
from ..schedules.validate import peak_activations
from ..timeline import Timeline
from .activation_model import ActivationEstimate, activation_estimate
from .megatron_args import _model_chunks, schedule_options_from_args
from .plan_report import report as plan_report
from .pretrain_args import (Sizes, derive_sizes, parse_pretrain_args, required_arg,
                            split_launcher)

#: The plugin's name for Megatron's own schedule, by chunks per rank.
MEGATRON_DEFAULT = {1: "1f1b"}  # v >= 2: "interleaved"

_UNEVEN_FLAGS = (
    ("decoder_first_pipeline_num_layers", "--decoder-first-pipeline-num-layers"),
    ("decoder_last_pipeline_num_layers", "--decoder-last-pipeline-num-layers"),
    ("pipeline_model_parallel_layout", "--pipeline-model-parallel-layout"),
    ("account_for_embedding_in_pipeline_split", "--account-for-embedding-in-pipeline-split"),
    ("account_for_loss_in_pipeline_split", "--account-for-loss-in-pipeline-split"),
)


@dataclass
class PretrainPlan:
    schedule: Schedule
    name: str  # the schedule's registry name
    how_chosen: str  # where the schedule came from
    tp: int
    pp: int
    cp: int
    dp: int
    world_size: int
    world_from: str
    global_batch: int
    micro_batch: int
    num_microbatches: int
    chunks: int
    chunks_from: str
    layout: str  # "loop", "v", or "other" (a schedule file's own placement)
    num_layers: int
    layers_per_stage: int
    activations: ActivationEstimate
    peak_in_flight: list[int]  # per rank, microbatch activations of one stage (chunk)
    peak_bytes: list[int]  # per rank
    timeline: Timeline
    costs_text: str = ""
    notes: list[str] = field(default_factory=list)

    @property
    def p(self) -> int:
        return self.pp

    @property
    def m(self) -> int:
        return self.num_microbatches

    @property
    def v(self) -> int:
        return self.chunks

    def to_dict(self) -> dict:
        return {
            "schedule": self.name, "p": self.pp, "m": self.num_microbatches, "v": self.chunks,
            "dp": self.dp, "tp": self.tp, "cp": self.cp, "world_size": self.world_size,
            "world_size_from": self.world_from, "global_batch": self.global_batch,
            "micro_batch": self.micro_batch, "layout": self.layout,
            "num_layers": self.num_layers, "layers_per_stage": self.layers_per_stage,
            "stages_of_rank": [list(self.schedule.stages_of(r)) for r in range(self.pp)],
            "activation_bytes_per_layer": self.activations.bytes_per_layer,
            "activation_bytes_per_stage": self.activations.bytes_per_stage,
            "activation_formula": self.activations.formula,
            "recompute": self.activations.recompute,
            "peak_in_flight": list(self.peak_in_flight),
            "peak_activation_bytes": list(self.peak_bytes),
            "predicted_step": self.timeline.makespan, "unit": self.timeline.unit,
            "bubble_fraction": self.timeline.bubble_fraction,
        }


def plan_pretrain(argv: Sequence[str], schedule: str | None = None,
                  world_size: int | None = None, costs: CostModel | None = None,
                  unit: str = "t", costs_text: str = "") -> PretrainPlan:
    """The plan for ``argv`` (a pretrain_gpt.py argument list, optionally behind its launcher,
    see :func:`split_launcher`) under ``schedule``, a name or a schedule file (.csv, .json;
    default: the arguments' ``--pipeline-schedule``, else Megatron's own: 1f1b, or interleaved
    with v >= 2 chunks).
    ``costs``: a rank's share of one microbatch (``CostModel``; default unit costs), in
    ``unit`` ("t" or "s"). Raises ValueError naming the values and the fix when the arguments
    and the schedule do not fit together."""
    pretrain_argv, launched, launched_from = split_launcher(argv)
    args = parse_pretrain_args(pretrain_argv)
    sizes = derive_sizes(args, world_size, launched, launched_from)
    notes = list(sizes.notes)
    name, how = _schedule_name(args, schedule)
    args.pipeline_schedule = name
    args.data_parallel_size = sizes.dp  # as validate_args sets it: a schedule file's m is checked
    options = schedule_options_from_args(args)  # ValueError naming the flag to add or drop
    name = options["schedule"]
    file_schedule, layout, v = _schedule_source(name, options, sizes)
    num_layers = required_arg(args, "num_layers", "--num-layers")
    layers_per_stage = _layers_per_stage(args, name, num_layers, sizes.pp, v, layout)
    built = file_schedule or _build(name, options, sizes, v)
    if sizes.pp > sizes.num_microbatches:
        notes.append(f"p={sizes.pp} > m={sizes.num_microbatches}: most ranks idle most of the "
                     "step; raise --global-batch-size so that m >= p")
    activations = activation_estimate(args, layers_per_stage)
    peaks = peak_activations(built)
    timeline = simulate(built, costs or CostModel(), validate=False)
    timeline.unit = unit
    return PretrainPlan(
        schedule=built, name=name, how_chosen=how, tp=sizes.tp, pp=sizes.pp, cp=sizes.cp,
        dp=sizes.dp, world_size=sizes.world_size, world_from=sizes.world_from,
        global_batch=sizes.global_batch, micro_batch=sizes.micro_batch,
        num_microbatches=sizes.num_microbatches, chunks=v, chunks_from=_chunks_from(args),
        layout=layout, num_layers=num_layers, layers_per_stage=layers_per_stage,
        activations=activations, peak_in_flight=list(peaks),
        peak_bytes=[count * activations.bytes_per_stage for count in peaks],
        timeline=timeline, costs_text=costs_text, notes=notes)


def _schedule_source(name: str, options: dict, sizes: Sizes):
    """(the schedule file's schedule or None, its layout, its chunks per rank v)."""
    if name in REGISTRY:
        return None, REGISTRY[name].layout, int(options.get("chunks") or 1)
    if not is_schedule_file(name):
        raise ValueError(f"plan takes a schedule name ({', '.join(REGISTRY)}) or a schedule "
                         f"file (.csv, .json), not {name!r}")
    schedule, m = load_schedule_file(name), sizes.num_microbatches
    if schedule.num_microbatches != m:
        raise ValueError(
            f"--pipeline-schedule {name} runs m={schedule.num_microbatches} microbatches per "
            f"step, but the arguments give m = global batch {sizes.global_batch} / (micro "
            f"batch {sizes.micro_batch} x dp {sizes.dp}) = {m}: set --global-batch-size "
            f"{schedule.num_microbatches * sizes.micro_batch * sizes.dp}, or write the schedule "
            f"for m={m}")
    return schedule, schedule_layout(schedule) or "other", schedule.chunks


def _chunks_from(args: Any) -> str:
    if getattr(args, "num_virtual_stages_per_pipeline_rank", None):
        return f"--num-virtual-stages-per-pipeline-rank {_model_chunks(args)}"
    if getattr(args, "num_layers_per_virtual_pipeline_stage", None):
        return (f"--num-layers-per-virtual-pipeline-stage "
                f"{args.num_layers_per_virtual_pipeline_stage}")
    return "no virtual-pipeline arguments"


def _layers_per_stage(args: Any, name: str, num_layers: int, pp: int, v: int,
                      layout: str) -> int:
    uneven = [flag for attr, flag in _UNEVEN_FLAGS if getattr(args, attr, None)]
    if uneven:
        raise ValueError(f"plan assumes --num-layers split evenly over the stages; "
                         f"{', '.join(uneven)} split them unevenly: drop it to plan the even "
                         "split")
    stages = pp * v
    if num_layers % stages:
        lower, upper = (num_layers // stages) * stages, (num_layers // stages + 1) * stages
        sizes = [q for q in range(2, num_layers + 1) if num_layers % (q * v) == 0][:6]
        what = (f"2p = {stages} stages (V layout: rank r holds stages r and 2p-1-r)"
                if layout == "v" else f"p x v = {pp} x {v} = {stages} stages")
        raise ValueError(
            f"--pipeline-schedule {name} with p={pp} (--pipeline-model-parallel-size) and v={v} "
            f"chunks per rank splits the model into {what}, but --num-layers {num_layers} is "
            f"not a multiple of {stages}: use --num-layers {upper}"
            f"{f' or {lower}' if lower else ''}"
            + (f", or a --pipeline-model-parallel-size p with {v}p dividing {num_layers} "
               f"(p = {', '.join(str(q) for q in sizes)})" if sizes else ""))
    return num_layers // stages


def _build(name: str, options: dict, sizes: Sizes, v: int) -> Schedule:
    build_options = {}
    if options.get("max_pending_backward") is not None:
        build_options["max_pending_backward"] = options["max_pending_backward"]
    if name == "interleaved" and options.get("microbatch_group_size_per_vp_stage"):
        build_options["microbatch_group_size_per_vp_stage"] = (
            options["microbatch_group_size_per_vp_stage"])
    pp, m = sizes.pp, sizes.num_microbatches
    try:
        return build_schedule(name, pp, m, v, **build_options)
    except ValueError as exc:
        raise ValueError(f"{name} with p={pp}, m={m} (global batch {sizes.global_batch} / "
                         f"(micro batch {sizes.micro_batch} x dp {sizes.dp})), v={v}: "
                         f"{exc}") from None


def _schedule_name(args: Any, schedule: str | None) -> tuple[str, str]:
    if schedule:
        given = getattr(args, "pipeline_schedule", None)
        if given and str(given).lower() != str(schedule).lower():
            return schedule, f"--schedule, in place of the arguments' --pipeline-schedule {given}"
        return schedule, "--schedule"
    given = getattr(args, "pipeline_schedule", None)
    if given:
        return given, "the arguments' --pipeline-schedule"
    v = _model_chunks(args)
    if v >= 2:
        return "interleaved", ("Megatron's own schedule (no --pipeline-schedule): interleaved "
                               f"1F1B with {v} chunks, as the plugin's interleaved runs it")
    return "1f1b", "Megatron's own schedule (no --pipeline-schedule): 1F1B"


__all__ = ["PretrainPlan", "ActivationEstimate", "plan_pretrain", "plan_report",
           "parse_pretrain_args", "split_launcher", "activation_estimate"]
