"""Pick a schedule: rank every candidate by its predicted step time, among those that fit
a per-rank activation-memory budget, and say why each other one was left out.

    selection = select_schedules(4, 16, CostModel(t_f=20, t_i=20, t_w=20, t_comm=0.5),
                                 activation_bytes=64 * MiB, memory_budget_bytes=512 * MiB)
    selection.ranked[0]        # Ranked(name='zb-v', chunks=2, makespan=..., bubble=..., ...)
    selection.excluded         # [Excluded(name='gpipe', chunks=1, reason='peak 16 x 64 MiB ...')]

What the inputs mean
--------------------
Costs (a ``CostModel``, the same convention as ``simulate``) are those of one microbatch on one
*rank*, i.e. on the whole part of the model that a rank holds (its ``L/p`` layers): ``t_f`` the
forward, ``t_i`` the input-gradient half of the backward, ``t_w`` the weight-gradient half,
``t_b`` a full backward (default ``t_i + t_w``). Each is one number or a list with one number
per rank (uneven stages). ``t_comm`` is the time one activation or gradient message takes to
arrive; it does not depend on the schedule. Measured costs: ``analysis.costs.load_costs``.

A schedule with ``v`` model chunks per rank (``interleaved`` v=2,3,4; ``zb-v`` and
``dualpipev``, whose V layout has v=2) splits each rank's part into ``v`` chunks of ``L/(p v)``
layers, so one chunk's F/I/W/B costs ``1/v`` of the rank's cost (``CostModel`` scales it) and
holds ``1/v`` of its activation. The total work per rank is the same for every candidate; what
differs is how well it is packed (the bubble) and how many activations are alive at once.

Costs with a whole backward only (``t_b`` without ``t_i``, ``t_w``: what a run of 1f1b, gpipe
or interleaved measures) cannot predict the schedules that split it (zb-h1, zb-h2, zb-v,
dualpipev): those land in ``excluded`` with that reason, unless the split is assumed
explicitly (``analysis.costs.assume_split``).

``activation_bytes`` is what one microbatch's forward leaves alive on one rank (for the whole
``L/p`` layers, v=1), ``memory_budget_bytes`` what a rank can spend on activations (its
memory less weights, gradients and optimizer state). A rank's peak is its peak count of live
chunk-activations (``validate.activation_trace``: an activation lives from the end of its F to
the end of its B, or of its W under a split backward -- conservative, as the I already frees
part of it) times ``activation_bytes / v``: in v=1 units (one microbatch through all of a
rank's layers) that count divided by v. A candidate fits when the largest peak over the ranks
is within the budget. ``activation_bytes`` may be one number per rank (the first and last
ranks hold the embedding and the output layer): measured, it is what ``train`` writes to
summary.json (``activation_bytes_per_stage``, one F's saved tensors per stage, summed over a
rank's stages by ``analysis.costs``), and each rank's peak is its count times its own bytes.

Bytes in, bytes out: ``parse_size("2GiB")`` reads a size with a unit (B, KB/MB/GB: powers
of 1000; KiB/MiB/GiB: powers of 1024; a bare number is bytes).

What is ranked
--------------
The single-step makespan of the simulator (``simulate``): the time from the first forward of
a step to the last backward (or W) of the step, on any rank. Consecutive steps do not overlap
in Megatron-LM training: the optimizer step, with its gradient-norm and (for fp16) inf-check
all-reduces over the model-parallel group, synchronizes every pipeline rank between two steps,
so a schedule whose shape would let the next step's warmup run under this step's cooldown
(zb-h2's parallelogram) does not gain that overlap; the single-step makespan is what a step
measures. Ties (same makespan) go to the smaller peak, then to a fixed schedule before
zb-auto (which then found the same), then the name. Everything outside the
pipeline (optimizer, data-parallel gradient reduction) is the same for every candidate and is
left out.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, NamedTuple, Sequence

from ..ir import Schedule, ScheduleError
from ..schedules import REGISTRY, build_schedule, get_spec
from ..schedules._common import loop_placement
from ..schedules.zb_auto import NAME as ZB_AUTO
from ..timeline import Timeline
from .costs import activations_in_v1_units
from .simulate import RANK, CostModel, simulate

MiB = 1024 * 1024

_UNITS = {"": 1, "b": 1, "kb": 1000, "mb": 1000 ** 2, "gb": 1000 ** 3, "tb": 1000 ** 4,
          "kib": 1024, "mib": 1024 ** 2, "gib": 1024 ** 3, "tib": 1024 ** 4,
          "k": 1024, "m": 1024 ** 2, "g": 1024 ** 3, "t": 1024 ** 4}


def parse_size(text) -> float:
    """Bytes from ``"2GiB"``, ``"512 MiB"``, ``"1.5GB"``, ``"3000000"`` (bytes); K/M/G alone
    are binary (KiB/MiB/GiB), as PyTorch and SLURM read them."""
    import re

    if isinstance(text, (int, float)):
        return float(text)
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*",
                         str(text))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(f"{text!r} is not a size: give bytes with a unit, e.g. 2GiB, 512MiB, "
                         "1.5GB, 3000000 (bytes)")
    return float(match.group(1)) * _UNITS[unit]


class Ranked(NamedTuple):
    name: str
    chunks: int  # v: model chunks per rank
    makespan: float  # predicted step time, in the unit of the costs
    bubble: float  # idle fraction of ranks x makespan
    peak_bytes: float  # largest activation memory over the ranks


class Excluded(NamedTuple):
    name: str
    chunks: int
    reason: str


@dataclass
class Selection:
    ranked: list[Ranked]  # fits the budget; fastest first
    excluded: list[Excluded]
    num_ranks: int
    num_microbatches: int
    costs: CostModel
    activation_bytes: float | list  # v=1 units: one number, or one per rank
    memory_budget_bytes: float
    #: per candidate (name, v) that was simulated: peak chunk-activations per rank (a chunk
    #: holds 1/v of a rank's layers; ``activations_in_v1_units`` converts)
    peak_activations: dict[tuple[str, int], list[int]] = field(default_factory=dict)
    #: per candidate (name, v) that was simulated: its predicted timeline
    timelines: dict[tuple[str, int], Timeline] = field(default_factory=dict, repr=False)

    def peak_bytes_per_rank(self, name: str, chunks: int) -> list[float]:
        """The candidate's predicted peak activation bytes on each rank."""
        counts = self.peak_activations[(name, chunks)]
        unit = self._unit(name, chunks)
        return [counts[r] * _per_rank(self.activation_bytes, r) / unit
                for r in range(len(counts))]

    def _unit(self, name: str, chunks: int) -> int:
        """A chunk-activation is 1/unit of a v=1 one (v; 1 for dualpipe's whole parts)."""
        timeline = self.timelines.get((name, chunks))
        return chunks if timeline is None else timeline.chunks

    def peak_activations_v1(self, name: str, chunks: int) -> list:
        """The candidate's peak per rank in v=1 units (one microbatch, all of a rank's
        layers): comparable across chunk counts."""
        return activations_in_v1_units(self.peak_activations[(name, chunks)],
                                       self._unit(name, chunks))

    @property
    def best(self) -> Ranked | None:
        return self.ranked[0] if self.ranked else None

    def to_dict(self) -> dict:
        return {
            "ranks": self.num_ranks,
            "microbatches": self.num_microbatches,
            "costs": {k: getattr(self.costs, k)
                      for k in ("t_f", "t_i", "t_w", "t_b", "t_comm", "t_overhead")},
            "activation_bytes": self.activation_bytes,
            "memory_budget_bytes": self.memory_budget_bytes,
            "activation_unit": "peak_activations: v=1 units (one microbatch's activations for "
                               "all of a rank's layers); peak_chunk_activations: chunk-"
                               "activations of 1/v of that",
            "ranked": [
                {**r._asdict(), "peak_activations": self.peak_activations_v1(r.name, r.chunks),
                 "peak_chunk_activations": self.peak_activations[(r.name, r.chunks)],
                 "peak_bytes_per_rank": [int(round(b)) for b in
                                         self.peak_bytes_per_rank(r.name, r.chunks)]}
                for r in self.ranked
            ],
            "excluded": [e._asdict() for e in self.excluded],
        }


def _per_rank(activation_bytes, rank: int) -> float:
    if isinstance(activation_bytes, (int, float)):
        return float(activation_bytes)
    return float(activation_bytes[rank])


def format_bytes(value: float) -> str:
    """``448 MiB``, ``21.33 MiB``: MiB with at most two decimals, trailing zeros dropped."""
    text = f"{value / MiB:.2f}".rstrip("0").rstrip(".")
    return f"{text} MiB"


def candidate_list(candidates: Iterable | None, chunks_options: Sequence[int]) -> list[tuple[str, int]]:
    """(name, v) pairs: a name alone expands to its chunk counts (interleaved: every
    ``chunks_options``; V layouts: 2; others: 1); a (name, v) pair is taken as given."""
    pairs: list[tuple[str, int]] = []
    for item in (REGISTRY if candidates is None else candidates):
        if isinstance(item, (tuple, list)):
            name, v = item
            get_spec(name)  # unknown names raise here, with a suggestion
            pairs.append((name, None if v is None else int(v)))  # None: zb-auto picks
            continue
        spec = get_spec(item)
        if spec.name == "interleaved":
            pairs += [(spec.name, int(v)) for v in chunks_options]
        else:  # zb-auto's None: the builder picks the layout
            pairs.append((spec.name, spec.default_chunks))
    return pairs


def zb_auto_options(costs: CostModel, num_ranks: int, activation_bytes,
                    memory_budget_bytes) -> dict:
    """zb-auto's builder options for a selection's inputs: each rank's share of F, I, W,
    message time and runtime overhead (as ``costs`` has them), activation and budget."""
    one_chunk = Schedule("costs", 1, loop_placement(num_ranks, 1), [[] for _ in range(num_ranks)])
    cost = costs.per_stage(one_chunk)
    return {"t_f": _frozen(cost["t_f"]), "t_i": _frozen(cost["t_i"]),
            "t_w": _frozen(cost["t_w"]), "t_comm": _frozen(cost["t_comm"]),
            "t_overhead": _frozen(cost["t_overhead"]),
            "activation": _frozen(activation_bytes), "memory_budget": memory_budget_bytes}


def _frozen(value):
    """A list as a tuple: the options key the drop-in's cache of built schedules."""
    return value if value is None or isinstance(value, (int, float)) else tuple(value)


def _check_inputs(num_ranks, num_microbatches, activation_bytes, memory_budget_bytes,
                  chunks_options) -> None:
    if not isinstance(num_ranks, int) or num_ranks < 1:
        raise ValueError(f"num_ranks={num_ranks!r} must be an integer >= 1")
    if not isinstance(num_microbatches, int) or num_microbatches < 1:
        raise ValueError(f"num_microbatches={num_microbatches!r} must be an integer >= 1")
    if isinstance(activation_bytes, (int, float)):
        if not activation_bytes >= 0:
            raise ValueError(f"activation_bytes={activation_bytes!r} must be >= 0")
    elif len(activation_bytes) != num_ranks or not all(b >= 0 for b in activation_bytes):
        raise ValueError(f"activation_bytes={list(activation_bytes)!r}: give one number, or "
                         f"one number >= 0 per rank ({num_ranks})")
    if not memory_budget_bytes > 0:
        raise ValueError(f"memory_budget_bytes={memory_budget_bytes!r} must be > 0")
    bad = [v for v in chunks_options if not isinstance(v, int) or v < 2]
    if bad:
        raise ValueError(f"chunks_options={tuple(chunks_options)!r}: interleaved needs v >= 2, "
                         f"not {bad[0]!r}")


def select_schedules(num_ranks: int, num_microbatches: int, costs: CostModel,
                     activation_bytes, memory_budget_bytes: float,
                     candidates: Iterable | None = None,
                     chunks_options: Sequence[int] = (2, 3, 4),
                     options: dict | None = None) -> Selection:
    """Rank the candidates that fit ``memory_budget_bytes`` by predicted step time.

    ``candidates``: schedule names and/or (name, v) pairs (default: every registered
    schedule, interleaved at each of ``chunks_options``). ``options``: builder options per
    schedule name, e.g. ``{"zb-h2": {"max_pending_backward": 5}}``. A candidate that cannot
    be built (e.g. interleaved with m < p) or that exceeds the budget lands in ``excluded``
    with the reason. Costs are per rank; see the module docstring.
    """
    _check_inputs(num_ranks, num_microbatches, activation_bytes, memory_budget_bytes,
                  chunks_options)
    costs = costs or CostModel()
    if costs.per != RANK:
        raise ValueError("select compares schedules with different chunks per rank: give costs "
                         "as a rank's share (CostModel(...), per='rank'), not per stage")
    for key in ("t_f", "t_i", "t_w", "t_b", "t_comm", "t_overhead"):
        value = getattr(costs, key)
        if value is None or isinstance(value, (int, float)):
            if value is not None and value < 0:
                raise ValueError(f"{key}={value!r} must be >= 0")
            continue
        if len(value) != num_ranks or any(x < 0 for x in value):
            raise ValueError(
                f"{key}={list(value)!r}: give one number or one number >= 0 per rank "
                f"({num_ranks}); costs are per rank (a rank's whole part of the model)")
    options = options or {}
    ranked, excluded, peaks, timelines = [], [], {}, {}
    for name, v in candidate_list(candidates, chunks_options):
        if get_spec(name).split_backward and not costs.split_known:
            excluded.append(Excluded(name, v, (
                "splits the backward into I and W, but the costs have only whole backwards "
                "(t_b): measure a split schedule, or assume a split (--assume-split X: "
                "I = X B, W = (1 - X) B)")))
            continue
        built_with = dict(options.get(name, {}))
        if name == ZB_AUTO:  # synthesized for these very costs and this budget
            built_with = {**zb_auto_options(costs, num_ranks, activation_bytes,
                                            memory_budget_bytes), **built_with}
        try:
            schedule = build_schedule(name, num_ranks, num_microbatches, v, **built_with)
            timeline = simulate(schedule, costs, validate=False)  # chunks cost 1/v each
        except ScheduleError as exc:
            excluded.append(Excluded(name, v, " ".join(str(exc).split())))
            continue
        v = schedule.chunks  # zb-auto's layout is its own choice
        counts = list(timeline.peak_activations)
        peaks[(name, v)] = counts
        timelines[(name, v)] = timeline
        unit = timeline.chunks  # a chunk-activation is 1/unit of a v=1 one (dualpipe: 1)
        per_rank = [counts[r] * _per_rank(activation_bytes, r) / unit for r in range(num_ranks)]
        worst = max(range(num_ranks), key=lambda r: (per_rank[r], -r))
        peak_bytes = per_rank[worst]
        per_chunk = _per_rank(activation_bytes, worst) / unit
        if peak_bytes > memory_budget_bytes:
            what = "" if unit == 1 else (f" chunk-activations (1/{unit} of "
                                      f"{format_bytes(_per_rank(activation_bytes, worst))})")
            excluded.append(Excluded(name, v, (
                f"peak {counts[worst]} x {format_bytes(per_chunk)}{what} = "
                f"{format_bytes(peak_bytes)} on rank {worst} exceeds the "
                f"{format_bytes(memory_budget_bytes)} budget")))
            continue
        ranked.append(Ranked(name, v, timeline.makespan, timeline.bubble_fraction, peak_bytes))
    # ties: the smaller peak, then a fixed order before zb-auto (which found the same), the name
    ranked.sort(key=lambda r: (float(f"{r.makespan:.12g}"), r.peak_bytes, r.name == ZB_AUTO,
                               r.name, r.chunks))
    return Selection(ranked, excluded, num_ranks, num_microbatches, costs, activation_bytes,
                     memory_budget_bytes, peaks, timelines)
