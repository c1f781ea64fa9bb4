"""Measured costs in, for ``select``, ``simulate`` and ``compare``: read what a run measured
(one rank's share of one microbatch, per kind, in seconds) from a file, say what it is, and
turn it into a ``CostModel``.

Files it reads (``load_costs``):

* ``summary.json`` of ``python -m megatron_pp_ext train``: its ``measured_costs_per_rank_s``
  (each rank's mean F, and B or I and W, per microbatch over all of its stages, last step).
  The message latency ``t_comm`` comes from the ``trace.json`` beside it when there is one.
* A Chrome trace of a measured step: ``train``'s ``trace.json``, or, from Megatron-LM,
  ``DIR/pp_trace.json`` written by ``--pp-trace-dir DIR`` (``install(trace=True,
  trace_dir=DIR)``) on pipeline rank 0.
* A measured ``Timeline`` as JSON (``Timeline.to_dict()``, e.g. of ``state.last_timeline``).

What comes out is per rank, in seconds. A split schedule's run (zb-h1, zb-h2, zb-v,
dualpipev) measured I and W; any other run measured only whole backwards B, and then the
split schedules cannot be predicted: they are refused with the reason, unless an assumption
is stated (``assume_split(costs, x)``, ``--assume-split X``: I = x B, W = (1 - x) B).
Nothing is filled in silently.

Costs measured under one schedule describe another only as far as the layers per rank are
the same: a V layout puts the first and the last stage (embedding; output layer and loss)
both on rank 0, a loop layout on ranks 0 and p-1. The per-rank shares are carried over as
they are; that difference is not modelled.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..ir import KINDS, Action, Schedule, ScheduleError
from ..timeline import COMM_WAIT, COMPUTE, Event, Timeline
from .measured import mean_durations, message_latency
from .simulate import RANK, CostModel

#: What a peak count of v=1 activations means, for labels.
ACTIVATION_UNIT = ("v=1 units: one microbatch's activations for all of a rank's layers; a "
                   "chunk-activation of a v-chunk schedule counts 1/v (a V chunk holds half a "
                   "rank's layers: 0.5); dualpipe's chunks are whole parts (1 each), and it "
                   "holds every part's parameters, gradients and optimizer state twice, which "
                   "these counts leave out (plan counts them)")


@dataclass
class MeasuredCosts:
    """A rank's share of one microbatch, per kind, in seconds, as a run measured it."""

    path: str
    what: str  # "train summary", "Chrome trace", "timeline"
    schedule: str | None  # the schedule that ran, when the file says
    num_ranks: int
    num_microbatches: int | None
    chunks: int | None
    t_f: list[float]
    t_b: list[float] | None = None
    t_i: list[float] | None = None
    t_w: list[float] | None = None
    t_comm: float | None = None  # message latency, seconds; None when not measured
    t_comm_from: str | None = None  # where t_comm was measured
    # Activation memory (bytes), from a train summary.json (runtime/memory.py): per rank, what
    # one microbatch's F leaves saved on all of the rank's layers (its stages' one-F bytes
    # summed: v=1 units, what the selector's activation_bytes means), and the run's measured
    # peak per rank; None when the file does not say.
    activation_bytes: list[int] | None = None
    peak_activation_bytes: list[int] | None = None

    @property
    def split(self) -> bool:
        """Whether the run measured the two halves of the backward (I and W)."""
        return self.t_i is not None and self.t_w is not None

    def cost_model(self, assume: float | None = None, t_comm: float | None = None,
                   t_overhead: float = 0.0) -> CostModel:
        """The ``CostModel`` (a rank's share, seconds). ``assume``: the fraction of B that is
        I, for a run that measured only B (refused for a run that measured I and W).
        ``t_comm``: overrides the measured message latency (default: measured, else 0)."""
        if t_comm is None:
            t_comm = self.t_comm or 0.0
        if self.split:
            if assume is not None:
                raise ValueError(
                    f"{self.path} has measured I and W ({self.schedule or 'a split schedule'} "
                    "ran): --assume-split applies only to a run that measured whole backwards")
            return CostModel(t_f=list(self.t_f), t_i=list(self.t_i), t_w=list(self.t_w),
                             t_b=None if self.t_b is None else list(self.t_b),
                             t_comm=t_comm, t_overhead=t_overhead)
        costs = CostModel(t_f=list(self.t_f), t_b=list(self.t_b), t_comm=t_comm,
                          t_overhead=t_overhead)
        return costs if assume is None else assume_split(costs, assume)

    def describe(self, assume: float | None = None) -> str:
        """The costs with their units, one row per rank, and where each came from."""
        ran = f" of a {self.schedule} run" if self.schedule else ""
        shape = ", ".join(f"{k}={v}" for k, v in (("p", self.num_ranks),
                                                  ("m", self.num_microbatches),
                                                  ("v", self.chunks)) if v is not None)
        lines = [f"measured costs{ran} ({shape}), from {self.path}: per rank, one microbatch "
                 "through all of the rank's layers, mean of the last measured step"]
        columns = [("F", self.t_f)]
        if self.split:
            columns += [("I", self.t_i), ("W", self.t_w)]
            if self.t_b is not None:
                columns.append(("B", self.t_b))
        else:
            columns.append(("B", self.t_b))
            if assume is not None:
                columns += [(f"I={assume:g}B", [assume * b for b in self.t_b]),
                            (f"W={1 - assume:g}B", [(1 - assume) * b for b in self.t_b])]
        cells = [["rank", *(name for name, _ in columns)]]
        cells += [[str(r), *(format_seconds(values[r]) for _, values in columns)]
                  for r in range(self.num_ranks)]
        widths = [max(len(row[c]) for row in cells) for c in range(len(cells[0]))]
        lines += ["  " + "  ".join(cell.rjust(w) for cell, w in zip(row, widths))
                  for row in cells]
        if self.split:
            lines.append("  the backward was measured split (I and W): every schedule can be "
                         "predicted")
        elif assume is None:
            lines.append("  only whole backwards (B) were measured: schedules that split the "
                         "backward into I and W (zb-h1, zb-h2, zb-v, dualpipev) cannot be "
                         "predicted from them; measure a split schedule or pass "
                         "--assume-split X (I = X B, W = (1 - X) B)")
        else:
            lines.append(f"  I and W are NOT measured: assumed I = {assume:g} B, "
                         f"W = {1 - assume:g} B (--assume-split {assume:g})")
        if self.t_comm is not None:
            lines.append(f"  message latency t_comm = {format_seconds(self.t_comm)} "
                         f"(measured in {self.t_comm_from})")
        else:
            lines.append("  message latency not measured: t_comm = 0 unless --t-comm is given")
        return "\n".join(lines)


def assume_split(costs: CostModel, fraction: float) -> CostModel:
    """``costs`` with only ``t_b`` given, completed by an explicit assumption: ``t_i =
    fraction * t_b``, ``t_w = (1 - fraction) * t_b`` (per rank or per stage as ``t_b`` is)."""
    if not 0 <= fraction <= 1:
        raise ValueError(f"--assume-split {fraction!r}: give the fraction of B that is I, "
                         "between 0 and 1 (e.g. 0.5)")
    if costs.t_b is None or costs.t_i is not None or costs.t_w is not None:
        raise ValueError("--assume-split splits a measured whole backward t_b into I and W: "
                         "give t_b without t_i and t_w")

    def part(x):
        if isinstance(x, (int, float)):
            return float(x) * fraction, float(x) * (1 - fraction)
        return [float(b) * fraction for b in x], [float(b) * (1 - fraction) for b in x]

    t_i, t_w = part(costs.t_b)
    return CostModel(t_f=costs.t_f, t_i=t_i, t_w=t_w, t_b=costs.t_b, t_comm=costs.t_comm,
                     t_overhead=costs.t_overhead, per=costs.per)


def format_seconds(seconds: float) -> str:
    """``2.49 ms``: seconds as milliseconds, 3 significant decimals at least."""
    ms = seconds * 1e3
    if ms == 0 or abs(ms) >= 0.01:
        return f"{ms:.3f} ms"
    return f"{ms:.3g} ms"


def format_time(value: float, unit: str) -> str:
    """A predicted time with its unit: seconds as ms, cost units as ``t``."""
    return format_seconds(value) if unit == "s" else f"{value:.4g} t"


def activations_in_v1_units(counts, chunks: int) -> list:
    """Peak chunk-activation counts -> counts of v=1 activations (one microbatch through all of
    a rank's layers): a chunk of a v-chunk schedule holds 1/v of a rank's layers."""
    out = []
    for count in counts:
        value = count / chunks if chunks > 1 else count
        out.append(int(value) if float(value).is_integer() else round(value, 4))
    return out


def format_counts(values) -> str:
    """``[4, 4.5, 4.33]``: counts with at most two decimals."""
    return "[" + ", ".join(f"{round(v, 2):g}" for v in values) + "]"


# ---------------------------------------------------------------- reading files
def load_costs(path: str) -> MeasuredCosts:
    """Read measured per-rank costs from ``path`` (see the module docstring). Raises
    ``ValueError`` (or ``OSError``) naming the file and what is wrong with it."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise OSError(f"cannot read costs file {path}: {exc.strerror or exc}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not JSON ({exc.msg} at line {exc.lineno}): give --costs "
                         "a train summary.json, a Chrome trace of a measured step, or a "
                         "measured timeline's JSON") from None
    if isinstance(data, dict) and "measured_costs_per_rank_s" in data:
        return _from_summary(path, data)
    if isinstance(data, dict) and "traceEvents" in data or isinstance(data, list):
        return _from_timeline(path, _chrome_timeline(path, data), "Chrome trace")
    if isinstance(data, dict) and "events" in data and "unit" in data:
        timeline = Timeline.from_dict(data)
        if timeline.unit != "s":
            raise ValueError(f"{path} is a timeline in {timeline.unit!r} units, not measured "
                             "seconds: give a measured one")
        return _from_timeline(path, timeline, "timeline")
    raise ValueError(f"{path} is neither a train summary.json (measured_costs_per_rank_s), a "
                     "Chrome trace (traceEvents) nor a timeline's JSON (events)")


def _from_summary(path: str, data: dict) -> MeasuredCosts:
    measured = data.get("measured_costs_per_rank_s")
    if not measured:
        raise ValueError(f"{path} has no measured costs (measured_costs_per_rank_s is "
                         f"{measured!r}): the run was not traced; run train without --no-trace")
    ran = data.get("schedule")
    if data.get("auto_choice"):  # auto measured first, then ran its choice
        ran = f"{data['auto_choice']} (auto)"
    p = int(data.get("pp") or len(measured["t_f"]))
    for key, values in measured.items():
        if len(values) != p:
            raise ValueError(f"{path}: {key} has {len(values)} values for pp={p} ranks")
    costs = MeasuredCosts(path=path, what="train summary", schedule=ran, num_ranks=p,
                          num_microbatches=data.get("microbatches"), chunks=data.get("chunks"),
                          t_f=list(measured["t_f"]), t_b=measured.get("t_b"),
                          t_i=measured.get("t_i"), t_w=measured.get("t_w"))
    per_stage = data.get("activation_bytes_per_stage")
    if per_stage:
        costs.activation_bytes = activation_bytes_per_rank(
            per_stage, p, int(data.get("chunks") or 1), data.get("layout") or "loop")
    if data.get("peak_activation_bytes") and None not in data["peak_activation_bytes"]:
        costs.peak_activation_bytes = [int(b) for b in data["peak_activation_bytes"]]
    _check_kinds(path, costs)
    trace = Path(path).with_name("trace.json")
    if trace.exists():
        try:
            costs.t_comm = _latency(_chrome_timeline(str(trace), json.loads(trace.read_text())))
            costs.t_comm_from = str(trace)
        except (ValueError, OSError):
            pass  # a stale or foreign trace: t_comm stays unmeasured, and says so
    return costs


def activation_bytes_per_rank(per_stage: list, num_ranks: int, chunks: int,
                              layout: str = "loop") -> list[int]:
    """Per rank, one microbatch's activation bytes over all of the rank's layers (v=1 units)
    from one F's bytes per stage: a rank's stages are r, r + p, ... (loop layout) or r and
    2p - 1 - r (the V layout)."""
    p = num_ranks
    if len(per_stage) != p * chunks:
        raise ValueError(f"activation_bytes_per_stage has {len(per_stage)} stages, not "
                         f"p x v = {p} x {chunks}")
    if chunks > 1 and str(layout).lower() == "v":
        return [int(per_stage[r]) + int(per_stage[2 * p - 1 - r]) for r in range(p)]
    return [sum(int(per_stage[r + k * p]) for k in range(chunks)) for r in range(p)]


def _check_kinds(path: str, costs: MeasuredCosts) -> None:
    if (costs.t_i is None) != (costs.t_w is None):
        raise ValueError(f"{path} has only one half of the split backward (I or W)")
    if not costs.split and costs.t_b is None:
        raise ValueError(f"{path} has no backward times (neither B nor I and W)")


def _chrome_timeline(path: str, data) -> Timeline:
    """The Chrome trace ``render_chrome_trace`` writes, back as a Timeline in seconds."""
    events = data if isinstance(data, list) else data.get("traceEvents", [])
    out: list[Event] = []
    ranks, microbatches = set(), 0
    for e in events:
        if not isinstance(e, dict) or e.get("ph") != "X":
            continue
        unit = (e.get("args") or {}).get("unit", "s")
        if unit == "t":
            raise ValueError(f"{path} is a predicted trace in cost units (t), not a measured "
                             "one in seconds")
        rank = int(e.get("tid", 0))
        start, end = e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6
        name, cat = str(e.get("name", "")), e.get("cat", "")
        if cat == "comm_wait":
            out.append(Event(rank, name, start, end, COMM_WAIT))
            continue
        if cat not in KINDS:
            continue
        try:
            action = Action.parse(name)
        except ScheduleError:
            continue
        if str(action) != name:
            continue
        out.append(Event(rank, name, start, end, COMPUTE))
        ranks.add(rank)
        microbatches = max(microbatches, action.microbatch + 1)
    if not ranks:
        raise ValueError(f"{path} has no compute events (F, B, I, W) to measure")
    other = data.get("otherData", {}) if isinstance(data, dict) else {}
    p = max(ranks) + 1
    stages = {Action.parse(e.label).stage for e in out if e.category == COMPUTE}
    return Timeline(schedule=other.get("schedule", "?"), num_ranks=p,
                    num_microbatches=microbatches, chunks=max(1, len(stages) // p),
                    events=out, peak_activations=list(other.get("peak_activations", [])),
                    source="measured", unit="s")


def _from_timeline(path: str, timeline: Timeline, what: str) -> MeasuredCosts:
    owner = {Action.parse(e.label).stage: e.rank
             for e in timeline.events if e.category == COMPUTE}
    p = timeline.num_ranks
    shares: dict[str, list[float]] = {}
    for (stage, kind), mean in mean_durations(timeline).items():
        # each stage's mean, summed over the stages of its rank: the rank's share
        shares.setdefault(kind, [0.0] * p)[owner[stage]] += mean
    if "F" not in shares:
        raise ValueError(f"{path} has no forward (F) events")
    name = timeline.schedule if timeline.schedule not in ("", "?") else None
    costs = MeasuredCosts(path=path, what=what, schedule=name, num_ranks=p,
                          num_microbatches=timeline.num_microbatches, chunks=timeline.chunks,
                          t_f=shares["F"], t_b=shares.get("B"), t_i=shares.get("I"),
                          t_w=shares.get("W"))
    _check_kinds(path, costs)
    try:
        costs.t_comm, costs.t_comm_from = _latency(timeline), path
    except ValueError:
        pass
    return costs


def _latency(timeline: Timeline) -> float:
    """The measured message latency (``analysis.measured.message_latency``, the one ``train``
    predicts with), on the stage placement the events show."""
    owner: dict[int, int] = {}
    for e in timeline.events:
        if e.category == COMPUTE:
            owner[Action.parse(e.label).stage] = e.rank
    if sorted(owner) != list(range(len(owner))):
        raise ValueError("stages missing from the trace")
    placement = Schedule(timeline.schedule, timeline.num_microbatches,
                         tuple(owner[s] for s in range(len(owner))),
                         [[] for _ in range(timeline.num_ranks)])
    return message_latency(timeline, placement)


__all__ = ["MeasuredCosts", "load_costs", "assume_split", "format_seconds", "format_time",
           "activations_in_v1_units", "format_counts", "ACTIVATION_UNIT", "RANK"]
