"""A plan for a Megatron-LM command line, without a GPU: what ``pretrain_gpt.py <args>`` would
run under a schedule, checked before any job starts.

    plan = plan_pretrain(["--tensor-model-parallel-size", "2", ...], schedule="zb-v",
                         world_size=64)
    print(plan_report(plan))

The arguments are parsed by Megatron-LM's own parser (``megatron.training.arguments.parse_args``
with the plugin's group, as ``scripts/pretrain_gpt_pp.py`` parses them), so a flag Megatron
does not know is refused as it would be. Megatron's ``validate_args`` is not run (it asks the
GPU for its architecture and the job's environment); the values the plan needs are derived
the way it derives them:

* p = ``--pipeline-model-parallel-size``; dp = world size / (tp x pp x cp), the world size from
  ``--world-size``, else from a launcher in front of the script (``torchrun --nnodes N
  --nproc-per-node G ... pretrain_gpt.py``: N x G; ``srun --ntasks N`` or ``--nodes N
  --ntasks-per-node G``), else dp = 1 (said so);
* m = global batch / (micro batch x dp) (global batch default: micro batch x dp, m = 1);
* v = ``--num-virtual-stages-per-pipeline-rank``, or num_layers / pp /
  ``--num-layers-per-virtual-pipeline-stage`` (``megatron_args._model_chunks``), and the
  schedule is checked against it by ``megatron_args.schedule_options_from_args`` (the check
  ``install_from_args`` makes at run time), then the layers against the stages (an even split).

Activation memory, per rank, is estimated from the model's dimensions with the per-layer
formula of Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models" (Table 2; 16-bit activations, 1-byte dropout masks): for one microbatch of b sequences
of s tokens through one transformer layer of hidden size h with a attention heads,

=================================  ===========================  ============================
                                   tensor parallel t,           tensor parallel t,
                                   sequence parallel            no sequence parallel
=================================  ===========================  ============================
no recompute                       s b h (34 + 5 a s / h) / t   s b h (10 + 24/t + 5 a s/(h t))
selective recompute                s b h 34 / t                 s b h (10 + 24/t)
full recompute (a layer's input)   2 s b h / t                  2 s b h
=================================  ===========================  ============================

(t = 1: s b h (34 + 5 a s / h), s b h 34, 2 s b h.) ``--attention-backend flash`` or ``fused``
keep no attention scores, so the 5 a s / h term is dropped; ``--context-parallel-size c`` gives
each rank s / c of the tokens; without ``--bf16`` / ``--fp16`` (fp32 activations) the figure is
doubled. Full recompute with ``--recompute-method uniform`` and ``--recompute-num-layers n``
keeps one input per group of n layers; ``block`` recomputes the first n layers of each chunk
and keeps the others whole. A rank's peak is that per-layer figure x the layers per stage
(chunk) x the simulator's peak count of microbatch activations alive at once on the rank
(``validate.activation_trace``: F to B, or to W under a split backward). Transformer layers
only: embedding, output layer and loss, weights, gradients and optimizer state are not in it.
"""

from __future__ import annotations

import contextlib
import io
import logging
import math
import sys
import warnings
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, Sequence

from ..analysis.simulate import CostModel, simulate
from ..schedules.validate import peak_activations
from ..ir import Schedule
from ..timeline import Timeline

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
class ActivationEstimate:
    """Activation bytes one microbatch leaves on one rank, per transformer layer."""

    bytes_per_layer: int
    formula: str  # the formula with the values put in
    recompute: str  # "none", "selective" or "full"
    notes: list[str] = field(default_factory=list)
    bytes_per_stage: int = 0  # one stage (chunk) of layers_per_stage layers


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


# ---------------------------------------------------------------- the command line
def split_launcher(argv: Sequence[str]) -> tuple[list[str], int | None, str | None]:
    """``(pretrain arguments, world size, where it came from)`` from a command line that may
    start with a launcher and a script (``torchrun --nnodes 8 --nproc-per-node 8
    pretrain_gpt.py --num-layers ...``): what follows the first ``*.py`` is the script's; the
    world size is the launcher's nodes x processes per node (torchrun, srun), or None."""
    argv = [str(a) for a in argv]
    if argv and argv[0] == "--":
        argv = argv[1:]
    script = next((i for i, a in enumerate(argv) if a.endswith(".py") and not a.startswith("-")),
                  None)
    if script is None:
        return argv, None, None
    before, after = argv[:script], argv[script + 1:]
    if not before:
        return after, None, None
    nnodes = _flag(before, "--nnodes", "--nodes", "-N")
    per_node = _flag(before, "--nproc-per-node", "--nproc_per_node", "--ntasks-per-node")
    tasks = _flag(before, "--ntasks", "-n")
    launcher = " ".join(before)
    if tasks is not None:
        return after, _count(tasks, "--ntasks", launcher), f"the launcher's --ntasks {tasks}"
    if per_node is None:
        return after, None, None
    nodes = _count(nnodes or "1", "--nnodes", launcher)
    gpus = _count(per_node, "--nproc-per-node", launcher)
    return after, nodes * gpus, (f"the launcher: {nodes} node(s) x {gpus} process(es) per "
                                 "node")


def _flag(tokens: list[str], *names: str) -> str | None:
    for i, token in enumerate(tokens):
        for name in names:
            if token == name and i + 1 < len(tokens):
                return tokens[i + 1]
            if token.startswith(name + "="):
                return token.split("=", 1)[1]
    return None


def _count(text: str, flag: str, launcher: str) -> int:
    low, _, high = text.partition(":")
    if (high and high != low) or not low.isdigit():
        raise ValueError(f"cannot tell the world size from {flag} {text} in '{launcher}': "
                         "give plan --world-size N")
    return int(low)


def parse_pretrain_args(argv: Sequence[str]):
    """Megatron-LM's own parser (``megatron.training.arguments.parse_args``, with the plugin's
    argument group) over ``argv``, as ``pretrain_gpt.py`` would parse it. Nothing is validated
    or initialized; Megatron's import warnings are kept quiet. ValueError when Megatron's
    parser refuses the arguments (its message)."""
    from .megatron_args import add_pipeline_schedule_args

    saved, errors = sys.argv, io.StringIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # importing Megatron (and torch) on a machine without CUDA logs about it: not ours to say
        logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
        with contextlib.redirect_stderr(io.StringIO()):
            from megatron.training.arguments import parse_args

        sys.argv = ["pretrain_gpt.py", *argv]
        try:
            with contextlib.redirect_stderr(errors):
                return parse_args(extra_args_provider=add_pipeline_schedule_args)
        except SystemExit:
            lines = [line for line in errors.getvalue().splitlines() if line.strip()]
            said = lines[-1] if lines else "it exited"
            raise ValueError(f"Megatron-LM's parser refuses the arguments: {said}") from None
        finally:
            sys.argv = saved


# ---------------------------------------------------------------- activations
def activation_estimate(args: Any, layers_per_stage: int) -> ActivationEstimate:
    """Activation bytes of one microbatch through one transformer layer, and through one stage
    of ``layers_per_stage`` layers (see the module docstring), from Megatron's arguments."""
    s, b = _required(args, "seq_length", "--seq-length"), int(args.micro_batch_size)
    h = _required(args, "hidden_size", "--hidden-size")
    a = _required(args, "num_attention_heads", "--num-attention-heads")
    t = int(args.tensor_model_parallel_size or 1)
    cp = int(getattr(args, "context_parallel_size", 1) or 1)
    sp = bool(getattr(args, "sequence_parallel", False)) and t > 1
    notes = []
    if cp > 1:
        if s % cp:
            raise ValueError(f"--seq-length {s} is not a multiple of --context-parallel-size "
                             f"{cp}")
        s //= cp
        notes.append(f"context parallel {cp}: s = {s} tokens per rank")
    granularity = getattr(args, "recompute_granularity", None)
    if getattr(args, "recompute_activations", False):
        granularity = "selective"
    backend = getattr(args, "attention_backend", None)
    backend = getattr(backend, "name", backend)
    scores = str(backend) not in ("flash", "fused")
    if not scores:
        notes.append(f"--attention-backend {backend}: no attention scores kept (no 5as/h term)")
    div = f"/{t}" if t > 1 else ""
    whole = _layer_bytes(s, b, h, a, t, sp, scores)
    if granularity == "full":
        sharded = sp or bool(getattr(args, "distribute_saved_activations", False))
        per_layer = Fraction(2 * s * b * h, t if sharded else 1)
        formula = (f"2*s*b*h{div} = 2*{s}*{b}*{h}{div}" if sharded else
                   f"2*s*b*h = 2*{s}*{b}*{h}")
        method = getattr(args, "recompute_method", None) or "uniform"
        n = int(getattr(args, "recompute_num_layers", None) or 1)
        if method == "block":
            kept = min(n, layers_per_stage)
            per_stage = per_layer * kept + whole * (layers_per_stage - kept)
            if kept < layers_per_stage:
                notes.append(f"full recompute, block: {kept} of {layers_per_stage} layers per "
                             f"chunk recomputed, {layers_per_stage - kept} kept whole "
                             f"({_whole(whole)} bytes each)")
        else:
            groups = math.ceil(layers_per_stage / n)
            per_stage = per_layer * groups
            if n > 1:
                notes.append(f"full recompute, uniform: one input kept per {n} layers "
                             f"({groups} per chunk)")
        recompute = "full"
    elif granularity == "selective":
        if sp or t == 1:
            per_layer = Fraction(34 * s * b * h, t)
            formula = f"s*b*h*34{div} = {s}*{b}*{h}*34{div}"
        else:
            per_layer = Fraction(s * b * h) * (10 + Fraction(24, t))
            formula = f"s*b*h*(10 + 24/t) = {s}*{b}*{h}*(10 + 24/{t})"
        per_stage = per_layer * layers_per_stage
        recompute = "selective"
    else:
        per_layer = whole
        if sp or t == 1:
            attn, attn_v = (" + 5*a*s/h", f" + 5*{a}*{s}/{h}") if scores else ("", "")
            formula = f"s*b*h*(34{attn}){div} = {s}*{b}*{h}*(34{attn_v}){div}"
        else:
            attn, attn_v = ((" + 5*a*s/(h*t)", f" + 5*{a}*{s}/({h}*{t})") if scores
                            else ("", ""))
            formula = f"s*b*h*(10 + 24/t{attn}) = {s}*{b}*{h}*(10 + 24/{t}{attn_v})"
        per_stage = per_layer * layers_per_stage
        recompute = "none"
    if not (getattr(args, "bf16", False) or getattr(args, "fp16", False)):
        per_layer, per_stage = 2 * per_layer, 2 * per_stage
        formula = f"2 x ({formula}) (fp32 activations)"
        notes.append("no --bf16 / --fp16: fp32 activations, the 16-bit formula x 2")
    if t > 1:
        notes.append(f"tensor parallel {t}, "
                     + ("sequence parallel" if sp else "no sequence parallel"))
    return ActivationEstimate(_whole(per_layer), formula, recompute, notes,
                              bytes_per_stage=_whole(per_stage))


def _whole(value: Fraction) -> int:
    return int(value) if value.denominator == 1 else int(round(value))


def _layer_bytes(s, b, h, a, t, sp, scores) -> Fraction:
    """A layer without recompute: s b h (34 + 5 a s/h) / t with sequence parallel (or t = 1),
    s b h (10 + 24/t + 5 a s/(h t)) without; the 5 a s / h term only when scores are kept."""
    attention = Fraction(5 * a * s, h) if scores else Fraction(0)
    sbh = Fraction(s * b * h)
    if sp or t == 1:
        return sbh * (34 + attention) / t
    return sbh * (10 + Fraction(24, t) + attention / t)


def _required(args: Any, name: str, flag: str) -> int:
    value = getattr(args, name, None)
    if name == "seq_length" and value is None:
        value = getattr(args, "encoder_seq_length", None)
    if value is None:
        raise ValueError(f"the arguments have no {flag}: the plan needs it for the activation "
                         "estimate")
    return int(value)


# ---------------------------------------------------------------- the plan
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
    notes: list[str] = []

    tp = int(args.tensor_model_parallel_size or 1)
    pp = int(args.pipeline_model_parallel_size or 1)
    cp = int(getattr(args, "context_parallel_size", 1) or 1)
    model_parallel = tp * pp * cp
    if world_size is not None:
        world, world_from = int(world_size), "--world-size"
        if launched is not None and launched != world:
            raise ValueError(f"--world-size {world} disagrees with {launched_from} "
                             f"(= {launched}): drop one")
    elif launched is not None:
        world, world_from = launched, launched_from
    else:
        world, world_from = model_parallel, "assumed: no --world-size and no launcher, so dp = 1"
    if world < 1 or world % model_parallel:
        raise ValueError(
            f"world size {world} ({world_from}) is not a multiple of tp x pp x cp = {tp} x {pp} "
            f"x {cp} = {model_parallel}: give a world size that is (e.g. "
            f"--world-size {model_parallel * max(1, world // model_parallel)}), or change "
            "--tensor-model-parallel-size / --pipeline-model-parallel-size / "
            "--context-parallel-size")
    dp = world // model_parallel

    micro = getattr(args, "micro_batch_size", None)
    if micro is None:
        raise ValueError("the arguments have no --micro-batch-size: Megatron needs it (and the "
                         "plan, for m and the activation estimate)")
    micro = int(micro)
    global_batch = args.global_batch_size
    if global_batch is None:
        global_batch = micro * dp
        notes.append(f"no --global-batch-size: Megatron uses micro batch x dp = {global_batch}")
    global_batch = int(global_batch)
    if global_batch % (micro * dp):
        step = micro * dp
        lower, upper = (global_batch // step) * step, (global_batch // step + 1) * step
        raise ValueError(
            f"--global-batch-size {global_batch} is not a multiple of --micro-batch-size "
            f"{micro} x dp {dp} = {step} (dp = world {world} / (tp {tp} x pp {pp} x cp {cp})): "
            f"use --global-batch-size {upper}{f' or {lower}' if lower else ''}, or change "
            "--micro-batch-size or the world size")
    m = global_batch // (micro * dp)

    name, how = _schedule_name(args, schedule)
    from ..schedules import REGISTRY, build_schedule
    from .megatron_args import _model_chunks, schedule_options_from_args

    args.pipeline_schedule = name
    args.data_parallel_size = dp  # as validate_args sets it: a schedule file's m is checked
    options = schedule_options_from_args(args)  # ValueError naming the flag to add or drop
    name = options["schedule"]
    file_schedule = None
    if name not in REGISTRY:
        from ..schedules import is_schedule_file, load_schedule_file, schedule_layout

        if not is_schedule_file(name):
            raise ValueError(f"plan takes a schedule name ({', '.join(REGISTRY)}) or a schedule "
                             f"file (.csv, .json), not {name!r}")
        file_schedule = load_schedule_file(name)
        if file_schedule.num_microbatches != m:
            raise ValueError(
                f"--pipeline-schedule {name} runs m={file_schedule.num_microbatches} "
                f"microbatches per step, but the arguments give m = global batch {global_batch} "
                f"/ (micro batch {micro} x dp {dp}) = {m}: set --global-batch-size "
                f"{file_schedule.num_microbatches * micro * dp}, or write the schedule for m={m}")
        layout, v = schedule_layout(file_schedule) or "other", file_schedule.chunks
    else:
        layout, v = REGISTRY[name].layout, int(options.get("chunks") or 1)
    built = _model_chunks(args)
    if getattr(args, "num_virtual_stages_per_pipeline_rank", None):
        chunks_from = f"--num-virtual-stages-per-pipeline-rank {built}"
    elif getattr(args, "num_layers_per_virtual_pipeline_stage", None):
        chunks_from = (f"--num-layers-per-virtual-pipeline-stage "
                       f"{args.num_layers_per_virtual_pipeline_stage}")
    else:
        chunks_from = "no virtual-pipeline arguments"

    num_layers = _required(args, "num_layers", "--num-layers")
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
    layers_per_stage = num_layers // stages

    if file_schedule is not None:
        built_schedule = file_schedule
    else:
        build_options = {}
        if options.get("max_pending_backward") is not None:
            build_options["max_pending_backward"] = options["max_pending_backward"]
        if name == "interleaved" and options.get("microbatch_group_size_per_vp_stage"):
            build_options["microbatch_group_size_per_vp_stage"] = (
                options["microbatch_group_size_per_vp_stage"])
        try:
            built_schedule = build_schedule(name, pp, m, v, **build_options)
        except ValueError as exc:
            raise ValueError(f"{name} with p={pp}, m={m} (global batch {global_batch} / (micro "
                             f"batch {micro} x dp {dp})), v={v}: {exc}") from None
    if pp > m:
        notes.append(f"p={pp} > m={m}: most ranks idle most of the step; raise "
                     "--global-batch-size so that m >= p")

    activations = activation_estimate(args, layers_per_stage)
    peaks = peak_activations(built_schedule)
    peak_bytes = [count * activations.bytes_per_stage for count in peaks]
    timeline = simulate(built_schedule, costs or CostModel(), validate=False)
    timeline.unit = unit
    return PretrainPlan(
        schedule=built_schedule, name=name, how_chosen=how, tp=tp, pp=pp, cp=cp, dp=dp,
        world_size=world, world_from=world_from, global_batch=global_batch, micro_batch=micro,
        num_microbatches=m, chunks=v, chunks_from=chunks_from, layout=layout,
        num_layers=num_layers, layers_per_stage=layers_per_stage, activations=activations,
        peak_in_flight=list(peaks), peak_bytes=peak_bytes, timeline=timeline,
        costs_text=costs_text, notes=notes)


def _schedule_name(args: Any, schedule: str | None) -> tuple[str, str]:
    if schedule:
        given = getattr(args, "pipeline_schedule", None)
        if given and str(given).lower() != str(schedule).lower():
            return schedule, f"--schedule, in place of the arguments' --pipeline-schedule {given}"
        return schedule, "--schedule"
    given = getattr(args, "pipeline_schedule", None)
    if given:
        return given, "the arguments' --pipeline-schedule"
    from .megatron_args import _model_chunks

    v = _model_chunks(args)
    if v >= 2:
        return "interleaved", ("Megatron's own schedule (no --pipeline-schedule): interleaved "
                               f"1F1B with {v} chunks, as the plugin's interleaved runs it")
    return "1f1b", "Megatron's own schedule (no --pipeline-schedule): 1F1B"


# ---------------------------------------------------------------- printing
def human_bytes(num: float) -> str:
    value = float(num)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    return f"{num} B"


def plan_report(plan: PretrainPlan) -> str:
    """The plan in a few lines: parallelism, batch, pipeline, per-rank stages and peak
    activation bytes (exact and in GiB), predicted step and bubble, notes."""
    from .plan import warmup_counts

    p, m, v = plan.pp, plan.num_microbatches, plan.chunks
    layout = ("V layout: rank r holds stages r and 2p-1-r" if plan.layout == "v" else
              "the stages placed as the schedule file places them" if plan.layout == "other"
              else "loop layout: rank r holds stages r, r+p, ..." if v > 1 else
              "rank r holds stage r")
    act = plan.activations
    lines = [
        f"plan: {plan.name} ({plan.how_chosen}), from Megatron-LM's arguments as its own parser "
        "reads them (no GPU)",
        f"parallelism: world {plan.world_size} = tp {plan.tp} x pp {p} x cp {plan.cp} x dp "
        f"{plan.dp} (world size: {plan.world_from})",
        f"batch: global {plan.global_batch} = micro batch {plan.micro_batch} x dp {plan.dp} x "
        f"m {m} microbatches per step",
        f"pipeline: p={p}, m={m}, v={v} chunk(s) per rank ({plan.chunks_from}); {layout}; "
        f"{p * v} stages of {plan.layers_per_stage} layers ({plan.num_layers} layers)",
        f"activations per layer per microbatch "
        f"({'no' if act.recompute == 'none' else act.recompute} recompute): {act.formula} = "
        f"{act.bytes_per_layer:,} bytes ({human_bytes(act.bytes_per_layer)})"
        + (f"; {'; '.join(act.notes)}" if act.notes else ""),
    ]
    warmups = warmup_counts(plan.schedule)
    rows = [("rank", "stages", "warmup F", "peak in flight", "peak activation bytes", "")]
    for r in range(p):
        stages = ",".join(str(s) for s in plan.schedule.stages_of(r))
        rows.append((str(r), stages, "-" if warmups[r] is None else str(warmups[r]),
                     f"{plan.peak_in_flight[r]} x {plan.layers_per_stage} layers",
                     f"{plan.peak_bytes[r]:,}", human_bytes(plan.peak_bytes[r])))
    widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
    for i, row in enumerate(rows):
        cells = [row[0].rjust(widths[0]), row[1].ljust(widths[1]), row[2].rjust(widths[2]),
                 row[3].rjust(widths[3]), row[4].rjust(widths[4]),
                 f"({row[5]})" if i else ""]
        lines.append("  ".join(cells).rstrip())
    lines.append("  peak in flight: microbatch activations of one stage alive at once on the "
                 "rank (transformer layers only)")
    t = plan.timeline
    if t.unit == "s":
        step = f"{t.makespan * 1e3:.4g} ms"
    else:
        step = f"{t.makespan:.6g} t"
    lines.append(f"predicted step: {step}, bubble {100 * t.bubble_fraction:.2f}%"
                 + (f" ({plan.costs_text})" if plan.costs_text else ""))
    lines += [f"note: {note}" for note in plan.notes]
    return "\n".join(lines)


__all__ = ["PretrainPlan", "ActivationEstimate", "plan_pretrain", "plan_report",
           "parse_pretrain_args", "split_launcher", "activation_estimate", "human_bytes"]
