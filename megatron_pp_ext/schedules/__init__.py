"""Schedule builders and their registry, the names they answer to, and schedule files.

Each builder is a pure function ``(num_ranks, num_microbatches, chunks, **options) -> Schedule``;
the registry states each one's layout and constraints, and ``build_schedule`` validates
every schedule it returns. Names are compared case-insensitively, and PyTorch's
(``torch.distributed.pipelining.get_schedule_class``, which torchtitan's
``pipeline_parallel_schedule`` uses) are aliases where they name the same schedule
(``ALIASES``). A schedule *file* (``.csv`` in PyTorch's compute-only format, or ``.json``) is
loaded and checked by ``load_schedule_file``.
"""

from __future__ import annotations

import difflib
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..ir import FORWARD, Schedule, ScheduleError
from ..program import load as load_with_program
from ._common import loop_placement, v_placement
from .dualpipe import build_dualpipe
from .dualpipev import build_dualpipev
from .gpipe import build_gpipe
from .interleaved import build_interleaved
from .one_f_one_b import build_1f1b
from .pipedream import PIPEDREAM, PIPEDREAM_2BW, build_pipedream, build_pipedream_2bw
from .validate import validate_schedule
from .zero_bubble import build_zb_h1, build_zb_h2
from .zb_v import build_zb_v
from .zb_auto import ZB_AUTO_OPTIONS, build_zb_auto
from .controllable_memory import build_v_half, build_v_min
from .pipedream import plan_versions


@dataclass(frozen=True)
class ScheduleSpec:
    name: str
    builder: Callable[..., Schedule]
    # "loop" (chunk c of rank r is stage c*p+r), "v" (rank r: stages r, 2p-1-r), or "auto"
    # (zb-auto: v = 1 builds for the loop layout, v = 2 for the V, none for the faster of both)
    layout: str
    default_chunks: int | None
    split_backward: bool  # uses I/W actions
    constraints: str  # what the builder demands, in words

    def allowed_chunks(self, chunks: int | None) -> bool:
        if self.layout == AUTO_LAYOUT:
            return chunks in (None, 1, 2)
        if self.layout in ("v", DUAL_LAYOUT):
            return chunks == 2
        if self.name == "interleaved":
            return chunks >= 2
        return chunks == 1

    def layout_for(self, chunks: int) -> str:
        """The layout the schedule runs with ``chunks`` model chunks per rank."""
        if self.layout == AUTO_LAYOUT:
            return "v" if chunks == 2 else "loop"
        return self.layout


AUTO_LAYOUT = "auto"
#: dualpipe's: rank r holds model part r (the first direction) and a copy of part p-1-r (the
#: second); in the IR the V placement, with each microbatch crossing one half of the stages
DUAL_LAYOUT = "dual"


REGISTRY: dict[str, ScheduleSpec] = {
    spec.name: spec
    for spec in (
        ScheduleSpec("gpipe", build_gpipe, "loop", 1, False, "any p >= 1, m >= 1; v = 1"),
        ScheduleSpec("1f1b", build_1f1b, "loop", 1, False, "any p >= 1, m >= 1; v = 1"),
        ScheduleSpec(
            "interleaved", build_interleaved, "loop", 2, False,
            "v >= 2; p <= microbatch_group_size_per_vp_stage (default p) <= m; "
            "m mod group is 0 or >= p",
        ),
        ScheduleSpec("zb-h1", build_zb_h1, "loop", 1, True,
                     "any p >= 1, m >= 1; v = 1; max_pending_backward >= 1 (default p)"),
        ScheduleSpec("zb-h2", build_zb_h2, "loop", 1, True,
                     "any p >= 1, m >= 1; v = 1; max_pending_backward >= 1 (default 2p-1)"),
        ScheduleSpec("zb-v", build_zb_v, "v", 2, True, "v = 2 (V layout); any p >= 1, m >= 1; p <= warmup_forwards <= 2p-1 "
                     "(default p)"),
        ScheduleSpec("dualpipev", build_dualpipev, "v", 2, True,
                     "v = 2 (V layout); any p >= 1, m >= 1 (m < 2p: the order for 2p "
                     "microbatches, cut to m); match_dualpipe=True: DualPipe's own order"),
        ScheduleSpec("dualpipe", build_dualpipe, DUAL_LAYOUT, 2, True,
                     "v = 2 (rank r holds model parts r and p-1-r: every part twice); p even, "
                     "m >= 2 (fewer than 2p: the order for 2p, cut to m)"),
        ScheduleSpec("v-half", build_v_half, "v", 2, True,
                     "v = 2 (V layout); any p >= 1, m >= 1; about half of 1F1B's activation "
                     "memory"),
        ScheduleSpec("v-min", build_v_min, "v", 2, True,
                     "v = 2 (V layout); any p >= 1, m >= 1; about a third of 1F1B's "
                     "activation memory"),
        ScheduleSpec("zb-auto", build_zb_auto, AUTO_LAYOUT, None, True,
                     "v = 1 (loop layout), 2 (V layout) or left out (the faster of both); "
                     "any p >= 1, m >= 1; synthesized for t_f, t_i, t_w, t_comm (per rank) "
                     "under memory_budget (per rank, in the unit of activation; default "
                     "1F1B's peak)"),
    )
}


#: PyTorch's schedule names (``torch.distributed.pipelining.schedules.get_schedule_class``,
#: compared case-insensitively there too; torchtitan passes its ``pipeline_parallel_schedule``
#: to it) that name one of ours, lower-cased -> (ours, PyTorch's spelling). Checked against
#: torch 2.13's builders: Interleaved1F1B writes the same order as ``interleaved`` when m is a
#: multiple of p (p = 2, 4; m = 2p, 3p); DualPipeV writes ``dualpipev``'s
#: ``match_dualpipe=True`` order (p = 2, 3, 4; m = 2p..4p; by default ours moves some chunk-0
#: forwards so that every rank interleaves its messages alike, at the same unit-cost makespan
#: and peak); ZBVZeroBubble is the published ZB-V, which starts rank 0 with 2p-1 chunk-0
#: forwards where ``zb-v`` interleaves sooner (same V layout and split backward, the same
#: unit-cost makespan at p = 2, 4). PyTorch's exact order of any of them runs as a CSV file.
#: Not aliased, as no schedule here is the same: InterleavedZeroBubble (the I/W split over
#: v >= 2 loop-layout chunks; zb-h1 and zb-h2 run one chunk per rank) and LoopedBFS
#: (``NO_EQUIVALENT`` says what to do instead).
ALIASES: dict[str, tuple[str, str]] = {
    "gpipe": ("gpipe", "GPipe"),
    "1f1b": ("1f1b", "1F1B"),
    "interleaved1f1b": ("interleaved", "Interleaved1F1B"),
    "zbvzerobubble": ("zb-v", "ZBVZeroBubble"),
    "dualpipev": ("dualpipev", "DualPipeV"),
}
NO_EQUIVALENT: dict[str, str] = {
    "interleavedzerobubble": (
        "PyTorch's InterleavedZeroBubble splits the backward over v >= 2 chunks in the loop "
        "layout; no built-in schedule here does that (zb-h1 and zb-h2 run one chunk per rank)"),
    "loopedbfs": (
        "PyTorch's LoopedBFS runs every microbatch of one chunk before the next chunk; no "
        "built-in schedule here does that"),
}
SCHEDULE_FILE_SUFFIXES = (".csv", ".json")

#: Asynchronous schedules (PipeDream, PipeDream-2BW: ``schedules.pipedream``). They change the
#: optimizer's semantics (each stage updates its weights inside the action list, without a
#: flush), so they live apart from ``REGISTRY``: never a candidate of select / auto / compare,
#: never run by Megatron's ``forward_backward_func`` (which flushes every step); they run
#: through ``megatron_pp_ext.runtime.pipedream`` and ``train --schedule pipedream``.
ASYNC_REGISTRY: dict[str, Callable[..., Schedule]] = {
    PIPEDREAM: build_pipedream,
    PIPEDREAM_2BW: build_pipedream_2bw,
}


def is_async_schedule(name) -> bool:
    """Whether ``name`` (any case) names an asynchronous schedule (``ASYNC_REGISTRY``)."""
    return isinstance(name, str) and name.strip().lower() in ASYNC_REGISTRY


def build_async_schedule(name: str, num_ranks: int, num_microbatches: int, steps: int = 2,
                         validate: bool = True, **options) -> Schedule:
    """Build an asynchronous schedule (``pipedream``, ``pipedream-2bw``) spanning ``steps``
    optimizer batches of ``num_microbatches``, validated like every other."""
    key = str(name).strip().lower()
    if key not in ASYNC_REGISTRY:
        raise ScheduleError(f"unknown asynchronous schedule {name!r}: choose one of "
                            f"{', '.join(ASYNC_REGISTRY)}")
    schedule = ASYNC_REGISTRY[key](num_ranks, num_microbatches, steps=steps, **options)
    if validate:
        validate_schedule(schedule)
        plan_versions(schedule)  # every F's version is made before it runs
    return schedule


def schedule_names() -> list[str]:
    return list(REGISTRY)


def _unknown(name: str) -> ScheduleError:
    key = str(name).strip().lower()
    if key in ASYNC_REGISTRY:
        return ScheduleError(
            f"schedule {name!r} is asynchronous (each stage updates its weights inside the "
            "pipeline, never flushed): Megatron's forward_backward_func flushes every step and "
            "cannot run it; run it with megatron_pp_ext.runtime.pipedream.AsyncPipeline or "
            f"`python -m megatron_pp_ext train --schedule {key}`, draw it with "
            f"`python -m megatron_pp_ext simulate --schedule {key} -p P -m M` "
            "(docs/pipedream.md)")
    if key in NO_EQUIVALENT:
        return ScheduleError(
            f"schedule {name!r} has no equivalent here: {NO_EQUIVALENT[key]}. Write its order "
            "to a CSV (PyTorch's format: a row per rank, an action per cell) and pass the file "
            "as the schedule, or choose one of " + ", ".join(REGISTRY))
    candidates = {n: repr(n) for n in REGISTRY}
    candidates.update({alias: f"{spelled!r} ({ours})" for alias, (ours, spelled)
                       in ALIASES.items() if alias not in REGISTRY})
    close = difflib.get_close_matches(key, candidates, n=1)
    hint = f" Did you mean {candidates[close[0]]}?" if close else ""
    torch_names = ", ".join(spelled for _, spelled in ALIASES.values())
    return ScheduleError(
        f"unknown schedule {name!r}: choose one of {', '.join(REGISTRY)} (in any case; "
        f"PyTorch's names {torch_names} work too), or give a schedule file "
        f"(.csv or .json).{hint}")


def canonical_name(name: str) -> str:
    """The registry's name for ``name``: any case, or PyTorch's name for the same schedule
    (``ALIASES``). Raises ``ScheduleError`` listing the names, with the closest one."""
    if not isinstance(name, str):
        raise ScheduleError(f"a schedule name must be a string, got {name!r}")
    key = name.strip().lower()
    if key in REGISTRY:
        return key
    if key in ALIASES:
        return ALIASES[key][0]
    raise _unknown(name)


def get_spec(name: str) -> ScheduleSpec:
    return REGISTRY[canonical_name(name)]


# --------------------------------------------------------------------------------------------
# Schedule files (PyTorch's compute-only CSV, or our JSON)
# --------------------------------------------------------------------------------------------


#: not a schedule: measure the first step(s), then run the fastest registered one that fits
AUTO = "auto"


def resolve_schedule(value, asynchronous: bool = False) -> str:
    """The one reading of a schedule value (``--pipeline-schedule``, ``install(schedule=)``,
    ``train --schedule``): a schedule file's path as given, ``auto``, an asynchronous
    schedule's name (``asynchronous=True``: ``train`` runs them), else the registry's name
    (any case, or PyTorch's name). Unknown names raise ``ScheduleError`` with the closest one
    suggested."""
    if is_schedule_file(value):
        return value
    if isinstance(value, str) and value.strip().lower() == AUTO:
        return AUTO
    if asynchronous and is_async_schedule(value):
        return value.strip().lower()
    return canonical_name(value)


def candidates_by_layout() -> dict[str, tuple[str, ...]]:
    """The registered schedules by how a model is chunked for them: ``one-chunk`` (the loop
    layout, one chunk per rank), ``loop`` (several chunks per rank: interleaved), ``v`` and
    ``dual`` (dualpipe: every model part held twice)."""
    out: dict[str, list[str]] = {"one-chunk": [], "v": [], "loop": [], DUAL_LAYOUT: []}
    for spec in REGISTRY.values():
        if spec.layout == AUTO_LAYOUT:  # builds for either
            out["one-chunk"].append(spec.name)
            out["v"].append(spec.name)
            continue
        key = (spec.layout if spec.layout in ("v", DUAL_LAYOUT) else
               "one-chunk" if spec.allowed_chunks(1) else "loop")
        out[key].append(spec.name)
    return {key: tuple(names) for key, names in out.items()}


def is_schedule_file(name) -> bool:
    """Whether ``name`` names a schedule file rather than a schedule (``.csv`` or ``.json``)."""
    return isinstance(name, str) and name.strip().lower().endswith(SCHEDULE_FILE_SUFFIXES)


def read_schedule_file(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError as exc:
        raise ScheduleError(f"cannot read schedule file {path}: {exc.strerror or exc}") from None


def schedule_layout(schedule: Schedule) -> str | None:
    """``"loop"`` (chunk c of rank r is stage c*p + r: Megatron's), ``"v"`` (rank r holds
    stages r and 2p-1-r), ``"dual"`` (dualpipe: rank r holds model parts r and p-1-r), or
    None for any other stage-to-rank mapping."""
    p, stages = schedule.num_ranks, schedule.num_stages
    if p >= 1 and stages % p == 0 and schedule.stage_to_rank == loop_placement(p, stages // p):
        return "loop"
    if stages == 2 * p and schedule.stage_to_rank == v_placement(p):
        return DUAL_LAYOUT if schedule.second_direction_from is not None else "v"
    return None


@functools.lru_cache(maxsize=32)
def parse_schedule_file(text: str, path: str, forward_only: bool = False) -> Schedule:
    """A schedule file's text (``path`` says which format and names the schedule), validated
    and checked that it can run: every rank holds its stages in the loop or the V layout (the
    ones a model can be built for). ``forward_only``: the run Megatron makes for evaluation,
    each rank's forwards in the file's order. Cached: the same object for the same text."""
    if forward_only:
        full = parse_schedule_file(text, path)
        only = Schedule(full.name, full.num_microbatches, full.stage_to_rank,
                        [[a for a in row if a.kind == FORWARD] for row in full.actions],
                        {**{k: v for k, v in full.options.items() if k != "communication"},
                         "forward_only": True, "overlapped_pairs": False})  # derived P2P
        validate_schedule(only)
        return only
    name = Path(path).stem or "csv"
    try:
        if path.strip().lower().endswith(".json"):
            schedule = Schedule.from_json(text)
        else:  # with its own P2P communication or without (program.load)
            schedule, _ = load_with_program(text, name=name)
    except ScheduleError as exc:
        raise ScheduleError(f"schedule file {path}: {exc}") from None
    if schedule.options.get("weight_update"):
        raise ScheduleError(
            f"schedule file {path} is asynchronous (its options carry a weight_update rule: "
            f"{schedule.options['weight_update'].get('rule')}): Megatron's forward_backward_func "
            "flushes every step and cannot run it; run it with "
            "megatron_pp_ext.runtime.pipedream.AsyncPipeline(Schedule.from_json(text), ...) "
            "(docs/pipedream.md)")
    if not schedule.num_stages or not schedule.num_microbatches:
        raise ScheduleError(f"schedule file {path} holds no actions: write one row of compute "
                            "actions per pipeline rank (e.g. 0F0,0F1,0B0,0B1)")
    if schedule_layout(schedule) is None:
        p = schedule.num_ranks
        loop = list(loop_placement(p, max(1, schedule.num_stages // p)))
        raise ScheduleError(
            f"schedule file {path} places its stages on ranks {list(schedule.stage_to_rank)} "
            f"(stage s on rank stage_to_rank[s]), but a model can be built only for the loop "
            f"layout (stage s on rank s mod p: {loop}) or the V layout (rank r holds stages r "
            f"and 2p-1-r: {list(v_placement(p))}); renumber the stages to one of them")
    try:
        validate_schedule(schedule)
    except ScheduleError as exc:
        raise ScheduleError(f"schedule file {path} cannot run: {exc}") from None
    return schedule


def load_schedule_file(path: str, forward_only: bool = False) -> Schedule:
    """Read, parse and validate a schedule file (see ``parse_schedule_file``)."""
    return parse_schedule_file(read_schedule_file(path), path, forward_only)


# Builder options that shape one family's order; any other builder would ignore them silently.
SHAPING_OPTIONS = {"max_pending_backward": ("zb-h1", "zb-h2"), "warmup_forwards": ("zb-v",),
                   "microbatch_group_size_per_vp_stage": ("interleaved",),
                   "match_dualpipe": ("dualpipev",),
                   **{option: ("zb-auto",) for option in ZB_AUTO_OPTIONS}}


def takes_option(name: str, option: str) -> bool:
    """Whether the schedule ``name`` is shaped by the builder option ``option``."""
    return name in SHAPING_OPTIONS.get(option, (name,))


def build_schedule(name: str, num_ranks: int, num_microbatches: int, chunks: int | None = None,
                   validate: bool = True, **options) -> Schedule:
    """Build a registered schedule and validate it before anyone runs it."""
    spec = get_spec(name)
    name = spec.name
    for option, value in options.items():
        if value is not None and value is not False and not takes_option(name, option):
            takers = SHAPING_OPTIONS[option]
            raise ScheduleError(
                f"{option}={value!r} shapes {' and '.join(takers)} only, and {name} would "
                f"ignore it: drop it, or choose {' or '.join(takers)}")
    chunks = spec.default_chunks if chunks is None else chunks
    if not spec.allowed_chunks(chunks):
        rule = {"v": "exactly 2 (the V layout)", "loop": "1",
                AUTO_LAYOUT: "1 (loop layout), 2 (V layout) or left out"}[spec.layout]
        if name == "interleaved":
            rule = ">= 2"
        raise ScheduleError(
            f"{name}: chunks v={chunks} is not allowed; v must be {rule} "
            f"(constraints: {spec.constraints})"
        )
    schedule = spec.builder(num_ranks, num_microbatches, chunks=chunks, **options)
    if validate:
        validate_schedule(schedule)
    return schedule
