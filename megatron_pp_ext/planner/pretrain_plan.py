"""A plan for a Megatron-LM command line, without a GPU: what ``pretrain_gpt.py <args>`` would
run under a schedule, checked before any job starts.

    plan = plan_pretrain(["--tensor-model-parallel-size", "2", ...], schedule="zb-v",
                         world_size=64)
    print(plan_report(plan))

The arguments are read as Megatron reads them (``pretrain_args``: its parser, the world size,
dp and m). v = ``--num-virtual-stages-per-pipeline-rank``, num_layers / pp /
``--num-layers-per-virtual-pipeline-stage``, or the stages of a layout string
(``megatron_args._model_chunks``), and the schedule is checked against it by
``megatron_args.schedule_options_from_args`` (the check ``install_from_args`` makes at run
time); the layers of every stage are Megatron's split (``stage_layers``). Per stage:
activation bytes (``activation_model``), F, I, W from FLOPs on a named GPU (``stage_flops``),
parameters (``static_memory``). Per rank: the stages' activation bytes walked through the
schedule (``runtime.memory.predicted_peak_bytes``), plus its stages' static bytes, against the
GPU's memory. The report: ``plan_report``; every schedule on one model: ``pretrain_select``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from ..analysis.simulate import CostModel, simulate
from ..ir import Schedule
from ..schedules import (DUAL_LAYOUT, REGISTRY, build_schedule, is_schedule_file,
                         load_schedule_file, schedule_layout)
from ..schedules._common import loop_placement, v_placement
from ..schedules.zb_auto import NAME as ZB_AUTO
from ..runtime.memory import predicted_peak_bytes
from ..schedules.validate import peak_activations
from ..timeline import Timeline
from .activation_model import ActivationEstimate, activation_estimate
from .gpus import DEFAULT_RESERVE_BYTES, Gpu
from .machines import machine_named
from .step_terms import StepModel, rank_terms, step_model
from ..integration.megatron_args import schedule_options_from_args
from ..integration.model_chunks import model_chunks as _model_chunks
from .model_shape import model_shape
from .plan_report import report as plan_report
from .pretrain_args import (Sizes, derive_sizes, parse_pretrain_args, required_arg,
                            split_launcher)
from .stage_flops import per_stage_seconds
from ..integration.stage_layers import StageLayers, layout_string, stage_layers, uneven_flags
from .static_memory import bytes_per_param, stage_params

#: The plugin's name for Megatron's own schedule, by chunks per rank.
MEGATRON_DEFAULT = {1: "1f1b"}  # v >= 2: "interleaved"


@dataclass
class RankMemory:
    """One rank's bytes: activations at the schedule's peak, and what it holds all step."""

    activation: int
    static: int  # weights, gradients, optimizer state
    budget: int | None = None  # the GPU's memory, when known
    reserve: int = 0  # of the budget, held back for what is not the model's (gpus.py)

    @property
    def total(self) -> int:
        """The model's bytes: activations at the peak and the static bytes."""
        return self.activation + self.static

    @property
    def headroom(self) -> int | None:
        """Bytes left (negative: over) under ``budget`` once the reserve is held back."""
        return None if self.budget is None else self.budget - self.reserve - self.total

    @property
    def fits(self) -> bool | None:
        return None if self.budget is None else self.total + self.reserve <= self.budget


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
    stages: list[StageLayers]  # per stage, model order
    activations: ActivationEstimate
    peak_in_flight: list[int]  # per rank, a count of microbatch activations of its stages
    memory: list[RankMemory]  # per rank
    timeline: Timeline
    static_rule: str = ""  # bytes per parameter, in words
    stage_costs: dict | None = None  # {"t_f": [...], "t_i": [...], "t_w": [...]} per stage, s
    gpu: Gpu | None = None
    efficiency: float | None = None
    costs_text: str = ""
    notes: list[str] = field(default_factory=list)
    #: the recompute flags ``select --search-recompute`` planned this with (None: the
    #: arguments' own)
    recompute_flags: list[str] | None = None
    #: the step priced on a machine by term (None: flat --efficiency, or no GPU)
    step_model: StepModel | None = None

    def per_step_seconds(self, rank: int) -> tuple[float, float]:
        """(exposed data-parallel, optimizer) seconds of ``rank`` once per step (0 without a
        machine's step model)."""
        if self.step_model is None:
            return 0.0, 0.0
        return self.step_model.per_step(self.schedule, rank)

    def own_costs(self) -> CostModel:
        """The plan's own per-stage costs (and pipeline message time on a machine)."""
        return _own_costs(self.stage_costs, self.step_model)

    @property
    def step_seconds(self) -> float:
        """The predicted step: the pipeline's timeline, then the slowest rank's exposed
        data-parallel messages and optimizer."""
        if self.timeline.unit != "s":
            return self.timeline.makespan
        extra = max((sum(self.per_step_seconds(r)) for r in range(self.pp)), default=0.0)
        return self.timeline.makespan + extra

    @property
    def tokens_per_s_per_gpu(self) -> float | None:
        """The step's tokens over its predicted seconds, per GPU (None without seconds)."""
        if self.timeline.unit != "s" or not self.step_seconds:
            return None
        tokens = self.global_batch * self.step_model.shape.seq if self.step_model else None
        return None if tokens is None else tokens / self.step_seconds / self.world_size

    def step_terms(self) -> dict[str, float] | None:
        """The busiest rank's step in seconds by term (None without a machine's model)."""
        if self.step_model is None:
            return None
        busy = [rank_terms(self.step_model, self.schedule, r, self.m) for r in range(self.pp)]
        rank = max(range(self.pp), key=lambda r: busy[r].total)
        terms = busy[rank].as_dict()
        terms["bubble_and_p2p"] = self.timeline.makespan - busy[rank].total
        terms["dp"], terms["optimizer"] = self.per_step_seconds(rank)
        return {"rank": rank, **terms}

    @property
    def p(self) -> int:
        return self.pp

    @property
    def m(self) -> int:
        return self.num_microbatches

    @property
    def v(self) -> int:
        return self.chunks

    @property
    def layers_per_stage(self) -> int:
        """The most decoder layers a stage holds (every stage's, on an even split)."""
        return max(stage.decoder for stage in self.stages)

    @property
    def even(self) -> bool:
        return len({stage.decoder for stage in self.stages}) == 1

    @property
    def fits(self) -> bool:
        """Every rank's bytes and reserve within its budget."""
        return all(rank.fits for rank in self.memory)

    @property
    def most_bytes(self) -> int:
        """The most loaded rank's bytes (activations at the peak and static)."""
        return max(rank.total for rank in self.memory)

    @property
    def peak_bytes(self) -> list[int]:
        """Per rank, peak activation bytes."""
        return [rank.activation for rank in self.memory]

    def to_dict(self) -> dict:
        stages_of = [list(self.schedule.stages_of(r)) for r in range(self.pp)]
        return {
            "schedule": self.name, "p": self.pp, "m": self.num_microbatches, "v": self.chunks,
            "dp": self.dp, "tp": self.tp, "cp": self.cp, "world_size": self.world_size,
            "world_size_from": self.world_from, "global_batch": self.global_batch,
            "micro_batch": self.micro_batch, "layout": self.layout,
            "num_layers": self.num_layers,
            # the stages' layers as Megatron's string (what Megatron builds with it)
            "pipeline_model_parallel_layout": layout_string(self.stages),
            # per stage: stages[s]["decoder_layers"]; this is the most of them (an uneven split)
            "largest_stage_decoder_layers": self.layers_per_stage,
            "stages": [self._stage_dict(s) for s in range(len(self.stages))],
            "stages_of_rank": stages_of,
            "activation_bytes_per_layer": self.activations.bytes_per_layer,
            "activation_bytes_per_stage": list(self.activations.stage_bytes),
            "activation_formula": self.activations.formula,
            "recompute": self.activations.recompute,
            "peak_in_flight": list(self.peak_in_flight),
            "peak_activation_bytes": self.peak_bytes,
            "static_bytes": [rank.static for rank in self.memory],
            "static_rule": self.static_rule,
            "total_bytes": [rank.total for rank in self.memory],
            "gpu": self.gpu.name if self.gpu else None,
            "gpu_memory_bytes": self.memory[0].budget if self.memory else None,
            "reserve_bytes": self.memory[0].reserve if self.memory else None,
            "fits": [rank.fits for rank in self.memory],
            "headroom_bytes": [rank.headroom for rank in self.memory],
            "predicted_step": self.step_seconds, "unit": self.timeline.unit,
            "pipeline_step": self.timeline.makespan, "step_terms_s": self.step_terms(),
            "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu,
            "machine": self.step_model.machine.name if self.step_model else None,
            "bubble_fraction": self.timeline.bubble_fraction,
        }

    def _stage_dict(self, s: int) -> dict:
        stage = self.stages[s]
        out = {"stage": s, "rank": self.schedule.stage_to_rank[s], "layers": stage.describe(),
               "decoder_layers": stage.decoder, "embedding": stage.embedding,
               "loss": stage.loss, "mtp_layers": stage.mtp,
               "activation_bytes": self.activations.stage_bytes[s]}
        if self.stage_costs:
            out.update({f"{k}_s": self.stage_costs[k][s] for k in ("t_f", "t_i", "t_w")})
        return out


def plan_pretrain(argv: Sequence[str], schedule: str | None = None,
                  world_size: int | None = None, costs: CostModel | None = None,
                  unit: str = "t", costs_text: str = "", gpu: str | None = None,
                  gpu_memory: int | None = None,
                  efficiency: float | None = None,
                  reserve: int = DEFAULT_RESERVE_BYTES,
                  machine: str | None = None) -> PretrainPlan:
    """The plan for ``argv`` (a pretrain_gpt.py argument list, optionally behind its launcher,
    see :func:`split_launcher`) under ``schedule``, a name or a schedule file (.csv, .json;
    default: the arguments' ``--pipeline-schedule``, else Megatron's own: 1f1b, or interleaved
    with v >= 2 chunks).
    ``costs``: a rank's share of one microbatch (``CostModel``), in ``unit`` ("t" or "s");
    default: with ``gpu`` (H100, H200, B200) each stage's F, I, W from its FLOPs at
    ``efficiency`` of the GPU's peak, in seconds, else unit costs. ``gpu_memory`` (bytes;
    default the GPU's) is the budget each rank's total and ``reserve`` (bytes that are not the
    model's: ``gpus.DEFAULT_RESERVE_BYTES``) are held to. Raises ValueError naming
    the values and the fix when the arguments and the schedule do not fit together."""
    pretrain_argv, launched, launched_from = split_launcher(argv)
    args = parse_pretrain_args(pretrain_argv)
    sizes = derive_sizes(args, world_size, launched, launched_from)
    notes = list(sizes.notes)
    name, how = _schedule_name(args, schedule)
    args.pipeline_schedule = name
    args.data_parallel_size = sizes.dp  # as validate_args sets it: a schedule file's m is checked
    options = schedule_options_from_args(args)  # ValueError naming the flag to add or drop
    name = options["schedule"]
    if layout_of(name) == DUAL_LAYOUT:
        notes.append("dualpipe holds every part of the model twice (rank r: part r and a copy "
                     "of part p-1-r): each rank's weights, gradients and optimizer state are "
                     "those of two 1F1B stages, counted below; the copies' gradients are summed "
                     "once per step (one exchange of the gradient buffers between ranks r and "
                     "p-1-r, not priced)")
    if getattr(args, "pp_v_split_flags", None):  # a V schedule put them in a layout string
        notes.append(f"{' '.join(args.pp_v_split_flags)}, applied to the first and the last "
                     "V stage (both on rank 0): the drop-in builds --pipeline-model-parallel-"
                     f"layout '{args.pipeline_model_parallel_layout}'")
    file_schedule, layout, v = _schedule_source(name, options, sizes)
    num_layers = required_arg(args, "num_layers", "--num-layers")
    stages = _stages(args, name, num_layers, sizes.pp, v, layout)
    # zb-auto is built for this model's costs and memory, once they are known (below)
    built = file_schedule or (None if name == ZB_AUTO else _build(name, options, sizes, v))
    if sizes.pp > sizes.num_microbatches:
        notes.append(f"p={sizes.pp} > m={sizes.num_microbatches}: most ranks idle most of the "
                     "step; raise --global-batch-size so that m >= p")
    shape = model_shape(args)
    if not shape.vocab:
        notes.append(shape.vocab_note)
    activations = activation_estimate(args, stages, shape)
    on = machine_named(machine, gpu) if (machine or gpu) else None
    device = on.gpu if on else None
    model, stage_costs = _priced(args, shape, stages, activations, sizes, on, efficiency)
    if costs is None and stage_costs is not None:
        costs, unit = _own_costs(stage_costs, model), "s"
        costs_text = costs_text or _own_costs_text(model, device, efficiency, shape.fp8)
    budget = gpu_memory if gpu_memory is not None else (device.memory_bytes if device else None)
    if built is None:
        built = _synthesize(args, shape, stages, activations, sizes, v, stage_costs, budget,
                            reserve, device)
    timeline = simulate(built, costs or CostModel(), validate=False)
    timeline.unit = unit
    memory, rule = _rank_memory(args, shape, stages, built, activations, sizes, budget,
                                reserve, device)
    return PretrainPlan(
        schedule=built, name=name, how_chosen=how, tp=sizes.tp, pp=sizes.pp, cp=sizes.cp,
        dp=sizes.dp, world_size=sizes.world_size, world_from=sizes.world_from,
        global_batch=sizes.global_batch, micro_batch=sizes.micro_batch,
        num_microbatches=sizes.num_microbatches, chunks=v, chunks_from=_chunks_from(args),
        layout=layout, num_layers=num_layers, stages=stages, activations=activations,
        peak_in_flight=list(peak_activations(built)), memory=memory, timeline=timeline,
        static_rule=rule, stage_costs=stage_costs, gpu=device,
        efficiency=efficiency if device else None, costs_text=costs_text, notes=notes,
        step_model=model)


def _priced(args, shape, stages, activations, sizes, on, efficiency):
    """(the machine's step model or None, each stage's F, I, W seconds or None): on a machine
    by named term, or with ``efficiency`` from the FLOPs alone at that share of the peak."""
    if on and efficiency is None:
        model = step_model(args, shape, stages, on, activations.recompute,
                           recomputed_layers(args), sizes.dp, sizes.world_size)
        return model, model.stage_costs()
    if on is None:
        return None, None
    return None, per_stage_seconds(shape, stages, activations.recompute, on.gpu, efficiency,
                                   recomputed_layers(args))


def _own_costs(stage_costs: dict, model: StepModel | None) -> CostModel:
    """The plan's own costs: per stage, and the pipeline's message time on a machine."""
    return CostModel.for_stages(**stage_costs,
                                t_comm=model.pipeline_message if model else 0.0)


def _own_costs_text(model: StepModel | None, device: Gpu | None, efficiency: float | None,
                    fp8: bool) -> str:
    precision = "fp8" if fp8 else "bf16"
    if model is None:
        return (f"each stage's F, I, W from its FLOPs at {efficiency:g} of the {device.name}'s "
                f"{precision} peak (assumed)")
    return (f"each stage's F, I, W from its kernels and messages on {model.machine.name}, "
            f"GEMMs at {model.gemm_share:.3g} of the {precision} peak (fitted on "
            f"{model.fitted_on})")


def layout_of(name: str) -> str | None:
    """A registered schedule's layout (None for a schedule file)."""
    spec = REGISTRY.get(name)
    return None if spec is None else spec.layout


def recomputed_layers(args) -> int | None:
    """Under ``--recompute-method block``, the decoder layers of each chunk full recompute
    runs again (``--recompute-num-layers``); None: every layer (``uniform``, the default)."""
    if getattr(args, "recompute_method", None) == "block":
        return int(getattr(args, "recompute_num_layers", None) or 1)
    return None


def _rank_memory(args, shape, stages, schedule, activations, sizes: Sizes,
                 budget: int | None, reserve: int,
                 gpu: Gpu | None) -> tuple[list[RankMemory], str]:
    """Per rank: the schedule's peak of its stages' activation bytes, and the static bytes
    of its stages (``static_memory``)."""
    per_param, rule = bytes_per_param(args, gpu)
    distributed = bool(getattr(args, "use_distributed_optimizer", False))
    dp_shards = sizes.dp * sizes.cp if distributed else 1
    expert_dp = max(1, sizes.world_size // (shape.etp * shape.ep * sizes.pp))
    if distributed:
        rule += f", the optimizer state sharded over {dp_shards} data-parallel ranks"
    peaks = predicted_peak_bytes(schedule, dict(enumerate(activations.stage_bytes)))
    single = len(stages) == 1
    memory = []
    for rank in range(schedule.num_ranks):
        static = sum(per_param.of(stage_params(shape, stages[s], shares_tied_copy=single),
                                  dp_shards, expert_dp if distributed else 1)
                     for s in schedule.stages_of(rank))
        memory.append(RankMemory(peaks[rank], static, budget, reserve))
    return memory, rule


def _schedule_source(name: str, options: dict, sizes: Sizes):
    """(the schedule file's schedule or None, its layout, its chunks per rank v)."""
    if name in REGISTRY:
        v = int(options.get("chunks") or 1)
        return None, REGISTRY[name].layout_for(v), v
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


def _stages(args: Any, name: str, num_layers: int, pp: int, v: int,
            layout: str) -> list[StageLayers]:
    """The layers of every stage, as Megatron splits them (``stage_layers``); an even split
    that does not divide gets the plan's own message with the sizes that would. dualpipe:
    1F1B's p stages, then their copies (stage p + k holds part k)."""
    if layout == DUAL_LAYOUT:
        parts = _stages(args, name, num_layers, pp, 1, "loop")
        return parts + parts
    if not uneven_flags(args) and num_layers % (pp * v):
        stages = pp * v
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
               f"(p = {', '.join(str(q) for q in sizes)})" if sizes else "")
            + (" (or give every stage its layers with --pipeline-model-parallel-layout)"
               if layout == "v" else " (or split it unevenly: --decoder-first-pipeline-num-"
               "layers / --decoder-last-pipeline-num-layers or --pipeline-model-parallel-"
               "layout)"))
    return stage_layers(args, pp, v)


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


def _synthesize(args, shape, stages, activations, sizes: Sizes, v: int,
                stage_costs: dict | None, budget: int | None, reserve: int,
                gpu: Gpu | None) -> Schedule:
    """zb-auto for this model: each rank's share of F, I, W (its stages' FLOP-priced seconds
    summed; unit costs per stage without a GPU), its stages' activation bytes, and what its
    memory leaves for activations once its static bytes are in (1F1B's peak without a
    budget)."""
    placement = loop_placement(sizes.pp, 1) if v == 1 else v_placement(sizes.pp)
    empty = Schedule(ZB_AUTO, sizes.num_microbatches, placement, [[] for _ in range(sizes.pp)])
    per_stage = stage_costs or {kind: [1.0] * len(placement) for kind in ("t_f", "t_i", "t_w")}

    def share(values) -> list[float]:
        return [sum(values[s] for s in empty.stages_of(r)) for r in range(sizes.pp)]

    options = {kind: share(per_stage[kind]) for kind in ("t_f", "t_i", "t_w")}
    options["activation"] = share(activations.stage_bytes)
    if budget is not None:
        static, _ = _rank_memory(args, shape, stages, empty, activations, sizes, budget,
                                 reserve, gpu)
        options["memory_budget"] = [max(0, rank.headroom) for rank in static]
    try:
        return build_schedule(ZB_AUTO, sizes.pp, sizes.num_microbatches, v, **options)
    except ValueError as exc:
        raise ValueError(f"{ZB_AUTO} with p={sizes.pp}, m={sizes.num_microbatches}, v={v}: "
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
