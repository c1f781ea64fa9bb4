"""Megatron-LM command-line arguments for the plugin.

Two functions connect a Megatron-LM training script to the plugin:

- ``add_pipeline_schedule_args(parser)`` is an ``extra_args_provider``: it adds the argument group
  "pipeline schedule (megatron-pp-ext)" and returns the parser.
- ``install_from_args(args)`` takes the *validated* Megatron arguments (after
  ``parse_and_validate_args``, which works out ``virtual_pipeline_model_parallel_size``), checks
  that the schedule fits the model chunks Megatron will build, and calls
  ``megatron_pp_ext.install(...)``. It returns whether it installed anything.

Without ``--pipeline-schedule`` (and without ``$MEGATRON_PP_SCHEDULE``) nothing changes: Megatron
keeps its own schedule.

How the schedule maps onto Megatron's model chunks (Megatron builds
``virtual_pipeline_model_parallel_size`` chunks per rank, or one chunk when it is unset):

=================================  ======================================================
gpipe, 1f1b, zb-h1, zb-h2          one chunk per rank: no virtual-pipeline arguments
interleaved                        v >= 2 chunks: ``--num-virtual-stages-per-pipeline-rank V``
                                   or ``--num-layers-per-virtual-pipeline-stage N``
zb-v, dualpipev                    exactly 2 chunks (V layout):
                                   ``--num-virtual-stages-per-pipeline-rank 2``
auto                               any of the above: measures the first step, then picks the
                                   fastest schedule that fits how Megatron chunked the model
a schedule file (.csv / .json)     what its stage-to-rank mapping says: v stages per rank
                                   in the loop layout (v = 1: no virtual-pipeline arguments;
                                   v >= 2: ``--num-virtual-stages-per-pipeline-rank v``), or
                                   the V layout (as zb-v); its p and m must be the run's
=================================  ======================================================

Names are case-insensitive, and PyTorch's names for the same schedules work too
(``Interleaved1F1B``, ``ZBVZeroBubble``, ``DualPipeV``, ...: ``schedules.ALIASES``).

For zb-v / dualpipev: Megatron-LM builds chunk c of rank r as stage c*p + r, with the embedding
on (rank 0, chunk 0) and the loss on (rank p-1, chunk 1). The V layout wants stage 2p-1-r in
chunk 1 of rank r (loss on rank 0), so the model chunks must be built for it:
``v_layout_models`` does (layout strings, tied embeddings, 1F1B's starting weights); this module
checks that there are two chunks and refuses the per-rank loop splits that cannot apply.
Every named schedule is built once here for the run's pipeline size and microbatch count, so
one that cannot run them (interleaved with m < p) stops before any communication.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from ..analysis.select import parse_size
from ..ir import ScheduleError
from ..schedules import (AUTO, AUTO_LAYOUT, DUAL_LAYOUT, REGISTRY, SHAPING_OPTIONS, ScheduleSpec,
                         build_schedule,
                         is_schedule_file, load_schedule_file, resolve_schedule,
                         schedule_layout, schedule_names, takes_option)
from .dual_layout_models import check_dual_args
from .microbatch_counts import step_counts
from .model_chunks import model_chunks as _model_chunks
from .options import ENV_SCHEDULE, PipelineOptions
from .stage_layers import STAGE_SPLIT_FLAGS, stage_layers, stage_split_flags, v_split_layout

GROUP_TITLE = "pipeline schedule (megatron-pp-ext)"

_VP_FLAGS = "--num-virtual-stages-per-pipeline-rank / --num-layers-per-virtual-pipeline-stage"


def schedule_choices() -> list[str]:
    """The values ``--pipeline-schedule`` accepts: every registered schedule, then ``auto``."""

    names = schedule_names()
    return names if AUTO in names else [*names, AUTO]


def _schedule_value(text: str) -> str:
    """``--pipeline-schedule``'s type: a schedule's name (returned as the registry's name), auto,
    or a schedule file (read and validated here; returned as given)."""
    try:
        return resolve_schedule_value(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(" ".join(str(exc).split())) from None


_schedule_value.__name__ = "schedule"


def resolve_schedule_value(value: str) -> str:
    """The registry's name for ``value`` (any case, or PyTorch's name), ``auto``, or, for a
    schedule file (.csv, .json), its path once it reads and validates. ValueError otherwise."""

    if is_schedule_file(value):
        load_schedule_file(value)  # unreadable or invalid: ScheduleError, naming the file
    return resolve_schedule(value)


def _size(text: str) -> float:
    """Bytes from ``20GiB``, ``512MiB``, ``3000000`` (``analysis.select.parse_size``)."""
    try:
        value = parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _positive(kind):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a {kind.__name__}") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its errors
    return parse


def add_pipeline_schedule_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron-LM ``extra_args_provider``: add the plugin's arguments and return the parser.

    Help texts avoid '%': Megatron's parser formats them with argparse's %-substitution.
    """
    group = parser.add_argument_group(title=GROUP_TITLE)
    group.add_argument(
        "--pipeline-schedule", type=_schedule_value, default=os.environ.get(ENV_SCHEDULE),
        metavar="NAME_OR_FILE",
        help="Replace Megatron's forward_backward_func with this megatron-pp-ext schedule: "
        f"one of {', '.join(schedule_choices())} (any case, or PyTorch's name for it), or a "
        "schedule file (.csv in PyTorch's compute-only format, or .json) written for this "
        "pipeline size and microbatch count. "
        f"Default: ${ENV_SCHEDULE} if set, else none (Megatron's own schedule, untouched).",
    )
    group.add_argument(
        "--pp-schedule-chunks", type=_positive(int), default=None,
        help="Model chunks per rank the schedule runs. Default: Megatron's "
        "virtual-pipeline size (interleaved), 2 (zb-v, dualpipev) or 1; if given it must agree.",
    )
    group.add_argument(
        "--pp-max-pending-backward", type=_positive(int), default=None,
        help="Schedules that split the backward (zb-*, dualpipev): at most N input-gradient "
        "backwards per rank whose weight gradient has not run yet; smaller holds less memory. "
        "Default: the schedule's own bound (zb-h1: p, zb-h2: 2p-1).",
    )
    group.add_argument(
        "--pp-warmup-forwards", type=_positive(int), default=None,
        help="zb-v: chunk-0 forwards each rank runs before its first chunk-1 input gradient, "
        "p (default: 1F1B's activation memory) to 2p-1 (ZB-H2's memory: rank 0 never waits "
        "in the warm-up, so with --pp-run-ahead consecutive steps overlap).",
    )
    group.add_argument(
        "--pp-memory-budget", type=_size, default=None, metavar="SIZE",
        help="auto: bytes per rank its choice may spend on activations (e.g. 20GiB; default on "
        "GPUs: the device memory free after the measuring step). The schedules that fit are "
        "ranked, zb-auto synthesized under it from the measured costs and activation bytes.",
    )
    group.add_argument(
        "--pp-p2p-timeout-s", type=_positive(float), default=None,
        help="Seconds a pipeline send/recv may wait before it fails naming rank, peer and action.",
    )
    group.add_argument(
        "--pp-post-validate", action="store_true",
        help="Post-validated optimizer step (Zero Bubble, section 4): each rank steps its "
        "optimizer before the global grad norm and found-inf reductions complete and rolls "
        "the step back exactly (and redoes it clipped, or skips it) when they say otherwise. "
        "Bit-identical to Megatron's step; costs a copy of the main parameters, the optimizer "
        "state and the model parameters per rank. Needs --pipeline-schedule.",
    )
    group.add_argument(
        "--pp-run-ahead", action="store_true",
        help="With --pp-post-validate: Megatron-LM's train_step starts each step before the "
        "previous one is validated, so no pipeline rank waits for the others between steps "
        "(a step whose predecessor is rolled back runs again). Still bit-identical; the log "
        "shows each step's loss and grad norm one iteration late. Refuses flags that read the "
        "weights right after a step (--log-params-norm, --overlap-param-gather, ...).",
    )
    group.add_argument(
        "--pp-trace", action="store_true",
        help="Record the measured timeline of every step (start/end of each action per rank).",
    )
    group.add_argument(
        "--pp-trace-dir", metavar="DIR", default=None,
        help="Write the last step's measured timeline as a Chrome trace to DIR/pp_trace.json "
        "(pipeline rank 0; implies --pp-trace); `python -m megatron_pp_ext select --costs "
        "DIR/pp_trace.json` reads it.",
    )
    return parser


def _virtual_stage_source(args: Any) -> str:
    """The flag that made Megatron build several chunks per rank, as the user passed it."""
    layout = getattr(args, "pipeline_model_parallel_layout", None)
    if layout:
        return f"--pipeline-model-parallel-layout {str(layout)!r}"
    for flag in ("num_virtual_stages_per_pipeline_rank", "num_layers_per_virtual_pipeline_stage"):
        value = getattr(args, flag, None)
        if value is not None:
            return f"--{flag.replace('_', '-')} {value}"
    return _VP_FLAGS


def _one_chunk_fix(args: Any) -> str:
    """How to get one model chunk per rank back, in terms of the flag the user passed."""
    source = _virtual_stage_source(args)
    if getattr(args, "pipeline_model_parallel_layout", None):
        pp = getattr(args, "pipeline_model_parallel_size", 1) or 1
        return (f"{source} gives each pipeline rank several stages: write it with {pp} "
                f"stage(s), one per pipeline rank (or use --pipeline-schedule interleaved)")
    return f"remove {source} (or use --pipeline-schedule interleaved)"


def _place_splits_on_v_stages(name: str, args: Any, pp: int) -> None:
    """Megatron's first/last-stage split flags under a V schedule: Megatron would apply them
    to its loop positions (the first and the last pipeline *rank*), the V layout's first and
    last stage are both on rank 0. Their intent carries over to V stages 0 and 2p-1
    (``stage_layers.v_split_layout``): the arguments get the equivalent layout string in
    their place, which every later reader (the model's ``TransformerConfig``, ``plan``) builds
    from. ValueError naming the numbers when the layers do not divide."""
    try:
        layout = v_split_layout(args, pp)
    except ValueError as exc:
        raise ValueError(f"--pipeline-schedule {name} (V layout: rank r holds stages r and "
                         f"2p-1-r): {exc}") from None
    if layout is None:
        return
    args.pp_v_split_flags = stage_split_flags(args)  # what the string replaced, for plan
    for attr, _ in STAGE_SPLIT_FLAGS:
        setattr(args, attr, False if attr.startswith("account_for") else None)
    args.pipeline_model_parallel_layout = layout


def _refuse_mtp_off_the_last_stage(name: str, args: Any, pp: int) -> None:
    """The MTP stage keeps a copy of the word embedding, summed with the first stage's: the V
    layout has no embedding group and sums them on rank 0, which holds stages 0 and 2p-1
    only. (Megatron itself refuses decoder layers after MTP layers.)"""
    if not getattr(args, "mtp_num_layers", None) or not getattr(
            args, "pipeline_model_parallel_layout", None):
        return  # without a string Megatron puts the MTP layers on the last stage
    stages = stage_layers(args, pp, 2)
    elsewhere = [s for s, stage in enumerate(stages[:-1]) if stage.mtp]
    if elsewhere:
        raise ValueError(
            f"--pipeline-schedule {name} (V layout) keeps the word embedding's two copies on "
            f"pipeline rank 0, which holds stages 0 and {2 * pp - 1}, but "
            f"--pipeline-model-parallel-layout {args.pipeline_model_parallel_layout!r} puts "
            f"the MTP layers on stage {elsewhere[0]}: move 'm' to the last stage, just "
            "before 'L', or use a loop schedule")


def _refuse_unfit_microbatches(name: str, args: Any, chunks: int, options: dict) -> None:
    """Build the schedule for the run's pipeline size and every microbatch count its steps
    will run (a batch-size schedule's each, an evaluation's: ``microbatch_counts``) now, as
    Megatron checks its own schedule's rules at argument time, so a schedule that cannot run
    stops here and not at the first step."""
    pp = getattr(args, "pipeline_model_parallel_size", 1) or 1
    for count in step_counts(args) or ():
        m = count.num_microbatches
        try:
            build_schedule(name, pp, m, chunks=chunks, validate=False,
                           forward_only=count.forward_only, **options)
        except ScheduleError as exc:
            step = "evaluation step" if count.forward_only else "step"
            raise ValueError(
                f"--pipeline-schedule {name} cannot run {m} microbatches per {step} at "
                f"--pipeline-model-parallel-size {pp} ({count.source}): {exc}") from None


def _refuse_plugin_flags_without_schedule(args: Any) -> None:
    """The plugin's own flags do nothing without --pipeline-schedule: say so rather than
    ignore them."""
    for flag in ("pp_post_validate", "pp_run_ahead", "pp_memory_budget"):
        if getattr(args, flag, None):
            dashed = "--" + flag.replace("_", "-")
            raise ValueError(
                f"{dashed} is a megatron-pp-ext option: add --pipeline-schedule NAME "
                f"(1f1b runs Megatron's 1F1B order bit for bit) or drop {dashed}")


def _chunks_needed(name: str, spec: ScheduleSpec, args: Any, pp: int,
                   built: int) -> tuple[int, str]:
    """(model chunks per rank the schedule runs here, how to make Megatron build that many),
    the second for the errors that follow; refuses what the schedule's layout cannot run."""
    if spec.layout == AUTO_LAYOUT and built not in (1, 2):
        raise ValueError(
            f"--pipeline-schedule {name} builds for one model chunk per rank (the loop layout) "
            f"or two (the V layout), but Megatron builds {built} ({_virtual_stage_source(args)}): "
            "drop the virtual-pipeline flags, or give --num-virtual-stages-per-pipeline-rank 2")
    if spec.layout == DUAL_LAYOUT:
        check_dual_args(args)  # an even pp, 2 chunks per rank, no layout string
        return 2, ("add --num-virtual-stages-per-pipeline-rank 2: dualpipe holds part r and "
                   "a copy of part p-1-r on rank r, two chunks per rank")
    if spec.layout_for(built) == "v":
        need = 2
        if getattr(args, "pipeline_model_parallel_layout", None):
            how = (f"{_virtual_stage_source(args)} must hold 2p = {2 * pp} stages, two per "
                   "rank: the V layout puts stages r and 2p-1-r on rank r")
        else:
            how = ("add --num-virtual-stages-per-pipeline-rank 2: the V layout puts stages r "
                   "and 2p-1-r on rank r, two chunks per rank")
        _place_splits_on_v_stages(name, args, pp)
        _refuse_mtp_off_the_last_stage(name, args, pp)
    elif spec.allowed_chunks(1):
        need, how = 1, _one_chunk_fix(args)
    else:  # several chunks per rank in the loop layout (interleaved)
        if not spec.allowed_chunks(built):
            raise ValueError(
                f"--pipeline-schedule {name} needs v >= 2 model chunks per rank, but Megatron "
                f"builds {built}: add --num-virtual-stages-per-pipeline-rank V (V >= 2) or "
                f"--num-layers-per-virtual-pipeline-stage N (num_layers / pp / N >= 2)"
            )
        need, how = built, f"set {_VP_FLAGS} so Megatron builds that many chunks"
    return need, how


def _refuse_chunk_mismatch(name: str, args: Any, pp: int, asked: int | None, need: int,
                           built: int, how: str) -> None:
    """--pp-schedule-chunks, when given, and the chunks Megatron builds must both be the
    ``need`` chunks per rank the schedule runs."""
    if asked is not None and asked != need:
        raise ValueError(
            f"--pp-schedule-chunks {asked} does not fit --pipeline-schedule {name}, "
            f"which runs {need} chunk(s) per rank here: drop --pp-schedule-chunks or {how}"
        )
    if built != need:
        raise ValueError(
            f"--pipeline-schedule {name} runs {need} model chunk(s) per rank but Megatron builds "
            f"{built} (pipeline-model-parallel size {pp}, virtual-pipeline size "
            f"{getattr(args, 'virtual_pipeline_model_parallel_size', None)}): {how}"
        )


def _named_schedule_options(name: str, args: Any, need: int, asked: int | None,
                            pending: int | None, warmup: int | None) -> dict:
    """``install()``'s keyword arguments for a registered schedule whose chunks fit, once it
    builds for the run's pipeline size and microbatch count."""
    shaping = dict(
        max_pending_backward=pending,
        warmup_forwards=warmup,
        # Megatron's own flag, which Megatron applies to its interleaved schedule only
        microbatch_group_size_per_vp_stage=(getattr(args, "microbatch_group_size_per_vp_stage",
                                                    None) if name == "interleaved" else None),
    )
    _refuse_unfit_microbatches(name, args, need,
                               {k: v for k, v in shaping.items() if v is not None})
    return _with_post_validation(dict(
        schedule=name,
        chunks=need if need > 1 else asked,
        **shaping,
        p2p_timeout_s=getattr(args, "pp_p2p_timeout_s", None),
        trace=bool(getattr(args, "pp_trace", False)),
    ), args)


def schedule_options_from_args(args: Any) -> dict | None:
    """Check the plugin's arguments against Megatron's and return ``install()``'s keyword
    arguments, or None when no schedule is asked for. Raises ValueError naming the fix."""
    name = getattr(args, "pipeline_schedule", None)
    if not name:
        _refuse_plugin_flags_without_schedule(args)
        return None
    try:  # e.g. a typo in $MEGATRON_PP_SCHEDULE set after the arguments were parsed
        name = resolve_schedule_value(name)
    except ValueError as exc:
        raise ValueError(f"--pipeline-schedule / ${ENV_SCHEDULE}={name!r}: {exc}") from None

    if is_schedule_file(name):
        return _file_options_from_args(name, args)

    if name == AUTO:  # the candidates follow from how Megatron chunks the model
        return _with_post_validation(
            dict(schedule=AUTO, p2p_timeout_s=getattr(args, "pp_p2p_timeout_s", None),
                 trace=bool(getattr(args, "pp_trace", False)),
                 auto_memory_budget_bytes=getattr(args, "pp_memory_budget", None)), args)
    if getattr(args, "pp_memory_budget", None):
        raise ValueError(
            f"--pp-memory-budget is auto's budget: it measures the activation bytes the budget "
            f"is held to; --pipeline-schedule {name} takes none (use --pipeline-schedule auto, "
            "which ranks zb-auto synthesized under it among the schedules that fit)")
    spec = REGISTRY[name]
    pp = getattr(args, "pipeline_model_parallel_size", 1) or 1
    built = _model_chunks(args)
    asked = getattr(args, "pp_schedule_chunks", None)
    need, how = _chunks_needed(name, spec, args, pp, built)

    pending = getattr(args, "pp_max_pending_backward", None)
    warmup = getattr(args, "pp_warmup_forwards", None)
    for flag, option, value in (("--pp-max-pending-backward", "max_pending_backward", pending),
                                ("--pp-warmup-forwards", "warmup_forwards", warmup)):
        if value is not None and not takes_option(name, option):
            takers = SHAPING_OPTIONS[option]
            raise ValueError(f"{flag} {value} shapes {' and '.join(takers)} only, and {name} "
                             f"would ignore it: drop it or use --pipeline-schedule "
                             f"{' or '.join(takers)}")
    _refuse_chunk_mismatch(name, args, pp, asked, need, built, how)
    return _named_schedule_options(name, args, need, asked, pending, warmup)


def _with_post_validation(options: dict, args: Any) -> dict:
    """``options`` plus ``post_validate=True`` when --pp-post-validate is given, and the
    trace file's folder with --pp-trace-dir (which turns tracing on)."""
    if getattr(args, "pp_post_validate", False):
        options["post_validate"] = True
    if getattr(args, "pp_run_ahead", False):
        if not getattr(args, "pp_post_validate", False):
            raise ValueError("--pp-run-ahead starts each step before the previous one is "
                             "validated: add --pp-post-validate")
        options["run_ahead"] = True
    if getattr(args, "pp_trace_dir", None):
        options["trace"], options["trace_dir"] = True, args.pp_trace_dir
    return options


def _file_options_from_args(path: str, args: Any) -> dict:
    """``install()``'s keyword arguments for ``--pipeline-schedule FILE``, once the file's
    pipeline size, microbatch count, chunks and layout agree with Megatron's arguments."""

    schedule = PipelineOptions(schedule=path).file_schedule()  # validated, NCCL's rules too
    p, m, v = schedule.num_ranks, schedule.num_microbatches, schedule.chunks
    layout = schedule_layout(schedule)
    pp = getattr(args, "pipeline_model_parallel_size", 1) or 1
    if pp != p:
        raise ValueError(
            f"--pipeline-schedule {path} has {p} rows (one per pipeline rank), but "
            f"--pipeline-model-parallel-size is {pp}: set --pipeline-model-parallel-size {p}, "
            f"or write the schedule for p={pp}")
    for flag in ("pp_max_pending_backward", "pp_warmup_forwards"):
        if getattr(args, flag, None) is not None:
            dashed = "--" + flag.replace("_", "-")
            raise ValueError(
                f"{dashed} shapes a built schedule, but --pipeline-schedule {path} "
                f"fixes every rank's order: drop {dashed}")
    asked = getattr(args, "pp_schedule_chunks", None)
    if asked is not None and asked != v:
        raise ValueError(
            f"--pp-schedule-chunks {asked} does not fit --pipeline-schedule {path}, which places "
            f"{v} stage(s) on each rank: drop --pp-schedule-chunks")
    if layout == "v":
        _place_splits_on_v_stages(path, args, pp)
        _refuse_mtp_off_the_last_stage(path, args, pp)
    built = _model_chunks(args)
    if built != v:
        if layout == "v":
            how = ("add --num-virtual-stages-per-pipeline-rank 2 (the file's V layout puts "
                   "stages r and 2p-1-r on rank r)")
        elif v == 1:
            how = _one_chunk_fix(args)
        else:
            how = (f"set --num-virtual-stages-per-pipeline-rank {v} (the file's loop layout puts "
                   f"stage c*p + r in chunk c of rank r)")
        raise ValueError(
            f"--pipeline-schedule {path} places {v} stage(s) on each rank but Megatron builds "
            f"{built} model chunk(s) per rank: {how}")
    for count in step_counts(args) or ():
        if count.num_microbatches != m:
            raise ValueError(
                f"--pipeline-schedule {path} schedules m={m} microbatches, but {count.source} "
                f"is {count.num_microbatches} microbatches per "
                f"{'evaluation step' if count.forward_only else 'step'}: {count.fix(m)}, "
                f"or write the schedule for m={count.num_microbatches}")
    return _with_post_validation(
        dict(schedule=path, chunks=asked, p2p_timeout_s=getattr(args, "pp_p2p_timeout_s", None),
             trace=bool(getattr(args, "pp_trace", False))), args)


def install_from_args(args: Any) -> bool:
    """Install the schedule named by ``args.pipeline_schedule``; return whether it installed.

    Call it on every rank after Megatron has parsed and validated its arguments and before
    ``train()`` first asks for ``get_forward_backward_func()``.
    """
    options = schedule_options_from_args(args)
    if options is None:
        return False
    if getattr(args, "pp_v_split_flags", None) and getattr(args, "rank", 0) == 0:
        print(f"megatron-pp-ext: {' '.join(args.pp_v_split_flags)}, applied to the first and "
              f"the last V stage: building --pipeline-model-parallel-layout "
              f"'{args.pipeline_model_parallel_layout}'", flush=True)
    from .install import install  # lazily: install() patches megatron.core / megatron.training

    install(**options)
    return True


def chain_args_providers(*providers):
    """One ``extra_args_provider`` that applies each given provider in turn (None entries are
    skipped), e.g. ``chain_args_providers(add_modelopt_args, add_pipeline_schedule_args)``."""
    chain = [p for p in providers if p is not None]

    def provider(parser):
        for add in chain:
            parser = add(parser)
        return parser

    return provider


# The V layout's and dualpipe's model providers live in v_layout_models, dual_layout_models and
# layout_providers; the names stay importable from here, where scripts/pretrain_gpt_pp.py and
# users' training scripts find them.
from .layout_providers import model_provider_for_args, pretrain_model_for_args  # noqa: E402
from .script_batches import (  # noqa: E402
    adapt_pretrain_gpt_for_args,
    adapt_pretrain_gpt_for_v_layout,
    v_layout_reads_batch as v_layout_is_first_or_last_stage,
)
from .v_layout_models import (  # noqa: E402
    model_provider_from_config,
    sum_tied_embedding_grads,
    uses_v_layout,
    v_chunk_stage,
    v_layout_model_provider,
)

__all__ = [
    "add_pipeline_schedule_args", "install_from_args", "schedule_options_from_args",
    "chain_args_providers", "schedule_choices", "resolve_schedule_value",
    "adapt_pretrain_gpt_for_args", "adapt_pretrain_gpt_for_v_layout", "model_provider_for_args",
    "model_provider_from_config",
    "pretrain_model_for_args", "sum_tied_embedding_grads", "uses_v_layout", "v_chunk_stage",
    "v_layout_is_first_or_last_stage", "v_layout_model_provider",
]
