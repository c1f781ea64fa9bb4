"""Pictures of a ``Timeline`` (predicted or measured): an ASCII grid, one self-contained HTML
page, and Chrome trace JSON (chrome://tracing, Perfetto).

Units. A timeline's times are seconds (``unit="s"``, measured, or predicted from measured
costs) or cost-model units (``unit="t"``). Pictures show seconds as milliseconds and cost units
as ``t``; they never show cost units as milliseconds, except where Chrome's trace format
forces a wall-clock axis (see :func:`render_chrome_trace`).
"""

from __future__ import annotations

import html
import math
from typing import NamedTuple

from ..timeline import COMM_WAIT, COMPUTE, P2P, Timeline
from ..units import format_bytes_iec

IDLE = "."
P2P_MARK = "="  # ASCII: a P2P batch in flight on the rank's communication stream
DEFAULT_WIDTH = 160  # characters of grid when the timeline has to be scaled


def display_unit(unit: str) -> tuple[float, str]:
    """``(factor, name)``: a time in ``unit`` times ``factor`` is that time in ``name``, the
    unit pictures show it in (seconds and microseconds in ms; cost units ``t`` as they are)."""
    return {"s": (1e3, "ms"), "ms": (1.0, "ms"), "us": (1e-3, "ms")}.get(unit, (1.0, unit))


def _p2p_events(timeline: Timeline) -> list:
    return [e for e in timeline.events if e.category == P2P]


# ---------------------------------------------------------------- ASCII
def render_ascii(timeline: Timeline, width: int | None = None) -> str:
    """One row per rank, time flowing right, idle as ``.``, then a summary line.

    When every action starts and ends on a multiple of the shortest action (equal costs, or
    costs that are multiples of one another), each cell is that unit of time, as in the
    GPipe / 1F1B papers' tables; an action longer than one cell continues with ``-``.
    Otherwise (or when the grid would be wider than ``width``) time is scaled to ``width``
    characters. A timeline with P2P events (NCCL-rules simulation) gets a second row per rank,
    ``rN p2p``, with ``=`` where a P2P batch is in flight on the rank's communication stream.
    """
    quantum = _grid_quantum(timeline)
    cell = max((len(e.label) for e in timeline.compute_events()), default=1)
    cells = round(timeline.makespan / quantum) if quantum else 0
    p2p = _p2p_events(timeline)
    if quantum and (width is None or cells * (cell + 1) <= width):
        header = f"one cell = {quantum:g} {timeline.unit}"
        rows = _unit_rows(timeline, quantum, cell, cells)
        p2p_rows = _unit_p2p_rows(timeline, quantum, cell, cells) if p2p else None
    else:
        width = width or DEFAULT_WIDTH
        header = f"one column = {timeline.makespan / width:.3g} {timeline.unit}"
        rows = _scaled_rows(timeline, width)
        p2p_rows = _scaled_p2p_rows(timeline, width) if p2p else None
    names = [f"r{rank}" for rank in range(timeline.num_ranks)]
    if p2p_rows is not None:
        names += [f"r{rank} p2p" for rank in range(timeline.num_ranks)]
    pad = max(len(n) for n in names) if names else 2
    lines = [
        f"{timeline.schedule} p={timeline.num_ranks} m={timeline.num_microbatches} "
        f"{timeline.layout_text} ({timeline.source}); {header}"
    ]
    for rank, row in enumerate(rows):
        lines.append(f"{'r' + str(rank):<{pad}} |{row}")
        if p2p_rows is not None:
            lines.append(f"{'r' + str(rank) + ' p2p':<{pad}} |{p2p_rows[rank]}")
    if p2p_rows is not None:
        lines.append(f"p2p rows: {P2P_MARK} a P2P batch in flight on the rank's communication "
                     "stream (beside its compute)")
    lines.append(summary_line(timeline))
    return "\n".join(lines)


def summary_line(timeline: Timeline) -> str:
    unit = "" if timeline.unit == "t" else timeline.unit
    return (
        f"makespan={timeline.makespan:.6g}{unit} bubble={100 * timeline.bubble_fraction:.2f}% "
        f"peak activations per rank: {list(timeline.peak_activations)}"
    )


def _grid_quantum(timeline: Timeline) -> float | None:
    """The shortest action, if every event boundary lies on a multiple of it; else None."""
    durations = [e.duration for e in timeline.compute_events()]
    if not durations or min(durations) <= 0:
        return None
    quantum, t0 = min(durations), timeline.start
    for e in timeline.events:
        for t in (e.start - t0, e.end - t0):
            if abs(t / quantum - round(t / quantum)) > 1e-6:
                return None
    return quantum


def _by_rank(timeline: Timeline, category: str) -> list[list]:
    """Each rank's events of ``category`` by start time, in one pass over the events."""
    by_rank: list[list] = [[] for _ in range(timeline.num_ranks)]
    for e in timeline.events:
        if e.category == category and 0 <= e.rank < timeline.num_ranks:
            by_rank[e.rank].append(e)
    return [sorted(events, key=lambda e: e.start) for events in by_rank]


def _compute_by_rank(timeline: Timeline) -> list[list]:
    return _by_rank(timeline, COMPUTE)


def _unit_rows(timeline: Timeline, quantum: float, cell: int, cells: int) -> list[str]:
    t0, rows = timeline.start, []
    for events in _compute_by_rank(timeline):
        tokens, at = [], 0
        for e in events:
            first, span = round((e.start - t0) / quantum), round(e.duration / quantum)
            tokens += [IDLE.ljust(cell)] * (first - at)
            # an action of `span` cells covers them and the separators between them
            tokens.append(e.label.ljust(span * (cell + 1) - 1, "-"))
            at = first + span
        tokens += [IDLE.ljust(cell)] * (cells - at)
        rows.append(" ".join(tokens))
    return rows


def _unit_p2p_rows(timeline: Timeline, quantum: float, cell: int, cells: int) -> list[str]:
    """The P2P rows on the unit grid: a batch covering cells a..b-1 fills them and the
    separators between them with ``=``; a cell with no batch shows ``.``."""
    t0, rows = timeline.start, []
    for events in _by_rank(timeline, P2P):
        chars = list(" ".join([IDLE.ljust(cell)] * cells))
        for e in events:
            a = round((e.start - t0) / quantum)
            b = round((e.end - t0) / quantum)
            if b > a:
                chars[a * (cell + 1):b * (cell + 1) - 1] = P2P_MARK * ((b - a) * (cell + 1) - 1)
        rows.append("".join(chars))
    return rows


def _scaled_rows(timeline: Timeline, width: int) -> list[str]:
    t0, makespan = timeline.start, timeline.makespan or 1.0
    rows = []
    for events in _compute_by_rank(timeline):
        chars = [IDLE] * width
        for e in events:
            a = min(width - 1, int(round((e.start - t0) / makespan * width)))
            b = max(a + 1, min(width, int(round((e.end - t0) / makespan * width))))
            # the label and a space to part it from the next action when they fit, else the kind
            span = b - a
            if len(e.label) < span:
                text = e.label.ljust(span - 1, "-") + " "
            else:
                text = e.kind * span
            chars[a:b] = text
        rows.append("".join(chars))
    return rows


def _scaled_p2p_rows(timeline: Timeline, width: int) -> list[str]:
    t0, makespan = timeline.start, timeline.makespan or 1.0
    rows = []
    for events in _by_rank(timeline, P2P):
        chars = [IDLE] * width
        for e in events:
            if e.duration <= 0:
                continue
            a = min(width - 1, int(round((e.start - t0) / makespan * width)))
            b = max(a + 1, min(width, int(round((e.end - t0) / makespan * width))))
            chars[a:b] = P2P_MARK * (b - a)
        rows.append("".join(chars))
    return rows


# ---------------------------------------------------------------- HTML
_COLOURS = {"F": "#4e79a7", "B": "#59a14f", "I": "#f28e2b", "W": "#b07aa1"}
_OTHER = "#888888"  # a compute event of no known kind
_IDLE_FILL = "#e9e9e9"  # the lane inside the step where nothing runs
_P2P_FILL = "#e15759"
_COMM_HATCH = ("#dddddd", "#999999")  # background, stripes
_LANE, _GAP, _LEFT, _PLOT, _RIGHT = 22, 4, 84, 1100, 60  # pixels
_P2P_ROW = 7  # pixels: the thin P2P band under a rank
#: Above this many events a timeline is drawn aggregated (per rank, time buckets merged per
#: kind) instead of one rectangle per event: p=64, m=512 stays a page of a few hundred KB.
AGGREGATE_EVENTS = 20_000
_BUCKET_PX = 2.0  # aggregated view: the narrowest time bucket
_BUCKET_ACTIONS = 8  # aggregated view: a bucket spans at least this many mean actions
_KINDS = ("F", "B", "I", "W", "other", "comm")  # aggregated view: stacking order in a lane

_LEGEND_TEXT = {
    "F": "forward",
    "B": "backward",
    "I": "input-gradient backward",
    "W": "weight-gradient backward",
    "other": "other action",
    "comm": "waiting for a message (comm wait)",
    "idle": "idle: nothing runs (plain gap inside the step)",
    "p2p": "P2P batch in flight on the rank's communication stream (row \u201crank r p2p\u201d)",
}


def _kind_key(e) -> str:
    if e.category == COMM_WAIT:
        return "comm"
    if e.category == P2P:
        return "p2p"
    return e.kind if e.kind in _COLOURS else "other"


def _fmt(x: float) -> str:
    return f"{x:.6g}"


def render_html(timelines: list[Timeline], title: str = "Pipeline timelines",
                aggregate: bool | None = None) -> str:
    """One self-contained page (inline CSS and SVG, no scripts): a lane per rank for every
    timeline (predicted above measured), colours per kind, hatched grey for communication
    waits, a thin band per rank for P2P batches in flight, hover titles with start and end
    (in ms for timelines in seconds), a labelled time axis, and a summary table under each.

    Every timeline of one unit is drawn on one scale (pixels per ms, or per ``t``), so a step
    that took 45% longer is drawn 45% longer; a page that mixes units says so and gives each
    unit its own scale. ``aggregate``: draw per rank the share of each kind in time buckets
    instead of one rectangle per event; by default only timelines of more than
    ``AGGREGATE_EVENTS`` events.
    """
    ordered = sorted(timelines, key=lambda t: t.source != "predicted")  # stable
    groups: dict[str, float] = {}  # display unit -> longest makespan in it
    for t in ordered:
        factor, name = display_unit(t.unit)
        groups[name] = max(groups.get(name, 0.0), t.makespan * factor)
    scales = {name: _PLOT / (longest or 1.0) for name, longest in groups.items()}

    used = {"idle"}
    for t in ordered:
        used.update(_kind_key(e) for e in t.events)
    legend = " ".join(f'<span class="key {k}"></span>{html.escape(_LEGEND_TEXT[k])}'
                      for k in (*_KINDS, "p2p", "idle") if k in used)

    hatch_bg, hatch_fg = _COMM_HATCH
    css = "".join(f"rect.{k}{{fill:{c}}} .key.{k}{{background:{c}}}" for k, c in _COLOURS.items())
    css += (f"rect.other{{fill:{_OTHER}}} .key.other{{background:{_OTHER}}}"
            f"rect.idle{{fill:{_IDLE_FILL}}} .key.idle{{background:{_IDLE_FILL};"
            "outline:1px solid #ccc}"
            f"rect.p2p{{fill:{_P2P_FILL}}} .key.p2p{{background:{_P2P_FILL};height:5px}}"
            f".key.comm{{background:repeating-linear-gradient(45deg,{hatch_fg} 0 2px,"
            f"{hatch_bg} 2px 5px)}}")
    parts = [
        "<!DOCTYPE html>",
        '<html><head><meta charset="utf-8">',
        f"<title>{html.escape(title)}</title>",
        "<style>body{font-family:sans-serif;margin:16px}svg{display:block;margin:4px 0}"
        "table{border-collapse:collapse;margin:6px 0 24px}td,th{border:1px solid #ccc;"
        "padding:2px 8px;text-align:right}text{font-size:10px;pointer-events:none}"
        "rect.a{stroke:#fff;stroke-width:0.5}"
        ".lane{font-size:12px;fill:#333}.p2plabel{font-size:8px;fill:#555}"
        ".tick{font-size:10px;fill:#555}.axis{stroke:#555;stroke-width:1}"
        ".scale{color:#444;margin:2px 0}.note{color:#a33}"
        ".key{display:inline-block;width:12px;height:12px;margin:0 4px 0 12px;"
        "vertical-align:middle}" + css + "</style>",
        "</head><body>",
        f"<h1>{html.escape(title)}</h1>",
        f'<p class="legend">{legend}</p>',
    ]
    if len(groups) > 1:
        named = ", ".join("milliseconds (timelines in seconds)" if n == "ms" else
                          "cost-model units t" if n == "t" else n for n in groups)
        parts.append(
            f'<p class="note">This page mixes time units: {html.escape(named)}. Each unit\'s '
            "timelines share one scale, labelled on their axes; lengths compare only within "
            "one unit.</p>")
    for index, timeline in enumerate(ordered):
        factor, name = display_unit(timeline.unit)
        draw_aggregated = (len(timeline.events) > AGGREGATE_EVENTS if aggregate is None
                           else aggregate)
        parts.append(_timeline_section(timeline, index, scales[name], groups[name],
                                       draw_aggregated))
    parts.append("</body></html>")
    return "\n".join(parts)


def _timeline_section(timeline: Timeline, index: int, px_per_unit: float, longest: float,
                      aggregated: bool) -> str:
    """One timeline's heading, scale line, SVG and table. ``px_per_unit``: pixels per display
    unit (ms or t), the same for every timeline of that unit on the page."""
    factor, unit = display_unit(timeline.unit)
    scale = px_per_unit * factor  # pixels per unit of the timeline's own times
    extent = timeline.makespan * scale  # pixels of this step
    has_p2p = any(e.category == P2P for e in timeline.events)
    row = _LANE + _GAP + ((_P2P_ROW + _GAP) if has_p2p else 0)
    axis_y = timeline.num_ranks * row + 2
    height = axis_y + 28
    hatch = f"hatch{index}"
    hatch_bg, hatch_fg = _COMM_HATCH
    svg = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{_LEFT + _PLOT + _RIGHT}" '
        f'height="{height}">',
        f'<defs><pattern id="{hatch}" width="6" height="6" patternUnits="userSpaceOnUse" '
        f'patternTransform="rotate(45)"><rect width="6" height="6" fill="{hatch_bg}"/>'
        f'<line x1="0" y1="0" x2="0" y2="6" stroke="{hatch_fg}" stroke-width="3"/></pattern>'
        "</defs>",
    ]
    for rank in range(timeline.num_ranks):
        y = rank * row
        svg.append(f'<text class="lane" x="4" y="{y + _LANE - 6}">rank {rank}</text>')
        svg.append(f'<rect class="idle" x="{_LEFT}" y="{y}" width="{extent:.2f}" '
                   f'height="{_LANE}"/>')
        if has_p2p:
            yp = y + _LANE + _GAP
            svg.append(f'<text class="p2plabel" x="4" y="{yp + _P2P_ROW}">rank {rank} p2p'
                       "</text>")
            svg.append(f'<rect class="idle" x="{_LEFT}" y="{yp}" width="{extent:.2f}" '
                       f'height="{_P2P_ROW}"/>')
    if aggregated:
        svg += _aggregated_rects(timeline, scale, factor, unit, row, hatch)
    else:
        svg += _event_rects(timeline, scale, factor, unit, row, hatch)
    svg += _axis(timeline.makespan * factor, px_per_unit, longest, unit, axis_y)
    svg.append("</svg>")
    heading = (
        f"<h2>{html.escape(timeline.schedule)} — {html.escape(timeline.source)} "
        f"(p={timeline.num_ranks}, m={timeline.num_microbatches}, "
        f"{html.escape(timeline.layout_text)})</h2>"
    )
    how = (f"step {_fmt(timeline.makespan * factor)} {unit}, drawn at {px_per_unit:.4g} px per "
           f"{unit}: the scale of every timeline in {unit} on this page")
    if aggregated:
        how += (f"; aggregated view of {len(timeline.events):,} events: each lane shows, per "
                "stretch of time (buckets of a few pixels, merged while alike), the share of "
                "it each kind of action took (hover for the numbers)")
    parts = [heading, f'<p class="scale">{html.escape(how)}</p>', "\n".join(svg),
             _summary_table(timeline, has_p2p)]
    return "\n".join(parts)


def _event_rects(timeline: Timeline, scale: float, factor: float, unit: str, row: int,
                 hatch: str) -> list[str]:
    """One rectangle per event, with a hover title (times in the display unit)."""
    t0, out = timeline.start, []
    for e in timeline.events:
        if not 0 <= e.rank < timeline.num_ranks:
            continue
        x, w = _LEFT + (e.start - t0) * scale, max(e.duration * scale, 0.5)
        key = _kind_key(e)
        tip = html.escape(
            f"{e.label} (rank {e.rank}): {_fmt((e.start - t0) * factor)} to "
            f"{_fmt((e.end - t0) * factor)} {unit} ({_fmt(e.duration * factor)} {unit})"
        )
        if key == "p2p":
            y = e.rank * row + _LANE + _GAP
            out.append(f'<rect class="a p2p" x="{x:.2f}" y="{y}" width="{w:.2f}" '
                       f'height="{_P2P_ROW}"><title>{tip}</title></rect>')
            continue
        y = e.rank * row
        fill = f'fill="url(#{hatch})"' if key == "comm" else f'class="a {key}"'
        out.append(f'<rect {fill} x="{x:.2f}" y="{y}" width="{w:.2f}" height="{_LANE}">'
                   f"<title>{tip}</title></rect>")
        if key != "comm" and w >= 7 * len(e.label):
            out.append(f'<text x="{x + 2:.2f}" y="{y + _LANE - 7}" fill="#fff">'
                       f"{html.escape(e.label)}</text>")
    return out


class _Buckets(NamedTuple):
    """The aggregated view's time buckets of one timeline."""

    count: int  # buckets per lane
    length: float  # one bucket, in the timeline's unit
    px: float  # one bucket, in pixels
    tolerance: float  # the share by which neighbouring buckets may differ and still merge


def _buckets(timeline: Timeline, scale: float) -> _Buckets:
    """Buckets of ``_BUCKET_PX`` pixels, or of ``_BUCKET_ACTIONS`` mean actions when wider."""
    makespan = timeline.makespan
    # A bucket spans several actions, so that the buckets of a steady state look alike: their
    # shares then differ by about one action's share of a bucket, which is the tolerance.
    durations = [e.duration for e in timeline.events if e.category == COMPUTE]
    mean_px = scale * sum(durations) / len(durations) if durations else 0.0
    nb = max(1, math.ceil(makespan * scale / max(_BUCKET_PX, _BUCKET_ACTIONS * mean_px)))
    bucket = makespan / nb  # in the timeline's unit
    bpx = makespan * scale / nb
    tolerance = max(1.0 / _LANE, 1.5 * mean_px / bpx)  # a share
    return _Buckets(nb, bucket, bpx, tolerance)


def _bucket_times(timeline: Timeline, buckets: _Buckets):
    """``(per rank, per bucket, time per kind of _KINDS; per rank, per bucket, time a P2P batch
    was in flight; whether there was any)``: each event's time split over its buckets."""
    t0, nb, bucket = timeline.start, buckets.count, buckets.length
    index = {k: i for i, k in enumerate(_KINDS)}
    kinds = len(_KINDS)
    acc = [[[0.0] * kinds for _ in range(nb)] for _ in range(timeline.num_ranks)]
    p2p = [[0.0] * nb for _ in range(timeline.num_ranks)]
    has_p2p = False
    for e in timeline.events:
        if not 0 <= e.rank < timeline.num_ranks or e.duration <= 0:
            continue
        key = _kind_key(e)
        a, b = (e.start - t0) / bucket, (e.end - t0) / bucket
        first, last = max(0, int(a)), min(nb - 1, int(b))
        for k in range(first, last + 1):
            share = (min(b, k + 1) - max(a, k)) * bucket
            if share <= 0:
                continue
            if key == "p2p":
                p2p[e.rank][k] += share
                has_p2p = True
            else:
                acc[e.rank][k][index[key]] += share
    return acc, p2p, has_p2p


def _stack_groups(rank: int, y: int, times: list[list[float]], buckets: _Buckets,
                  factor: float, unit: str, hatch: str) -> list[str]:
    """One rank's compute lane: a ``<g>`` of stacked kinds per stretch of similar buckets, with
    the kinds' shares and the idle share in its tooltip."""
    bucket, bpx = buckets.length, buckets.px
    out = []
    shares = [[min(1.0, v / bucket) for v in counts] for counts in times]
    for first, last, mean in _runs(shares, buckets.tolerance):
        x, w = _LEFT + first * bpx, (last - first) * bpx
        heights = _stack_heights(mean, _LANE)
        parts = ", ".join(f"{k} {100 * s:.0f}%" for k, s in zip(_KINDS, mean) if s >= 0.005)
        idle = max(0.0, 1.0 - sum(mean))
        tip = html.escape(
            f"rank {rank}, {_fmt(first * bucket * factor)} to {_fmt(last * bucket * factor)}"
            f" {unit}: {parts + ', ' if parts else ''}idle {100 * idle:.0f}%")
        rects, top = [], y
        for k, h in zip(_KINDS, heights):
            if h <= 0:
                continue
            fill = f'fill="url(#{hatch})"' if k == "comm" else f'class="{k}"'
            rects.append(f'<rect {fill} x="{x:.2f}" y="{top}" width="{w:.2f}" '
                         f'height="{h}"/>')
            top += h
        if rects:
            out.append(f"<g><title>{tip}</title>{''.join(rects)}</g>")
    return out


def _p2p_flight_rects(rank: int, y: int, times: list[float], buckets: _Buckets,
                      factor: float, unit: str) -> list[str]:
    """One rank's P2P row: per stretch of similar buckets, a bar as high as the share of time a
    batch was in flight."""
    bucket, bpx = buckets.length, buckets.px
    out = []
    yp = y + _LANE + _GAP
    flight = [[min(1.0, v / bucket)] for v in times]
    for first, last, mean in _runs(flight, buckets.tolerance):
        h = round(mean[0] * _P2P_ROW)
        if h <= 0:
            continue
        x, w = _LEFT + first * bpx, (last - first) * bpx
        tip = html.escape(
            f"rank {rank} p2p, {_fmt(first * bucket * factor)} to "
            f"{_fmt(last * bucket * factor)} {unit}: a batch in flight "
            f"{100 * mean[0]:.0f}% of the time")
        out.append(f'<rect class="p2p" x="{x:.2f}" y="{yp + _P2P_ROW - h}" '
                   f'width="{w:.2f}" height="{h}"><title>{tip}</title></rect>')
    return out


def _aggregated_rects(timeline: Timeline, scale: float, factor: float, unit: str, row: int,
                      hatch: str) -> list[str]:
    """Per rank, time cut into buckets of ``_BUCKET_PX`` pixels (or of ``_BUCKET_ACTIONS`` mean
    actions, when wider); each bucket's time is summed per kind (F, B, I, W, other, comm wait)
    and drawn as a stack whose heights are the kinds' shares; neighbouring buckets whose shares
    differ by less than a pixel or one action's share of a bucket are merged into one stretch.
    P2P batches: the share of time a batch was in flight, in the rank's P2P row."""
    if timeline.makespan <= 0:
        return []
    buckets = _buckets(timeline, scale)
    acc, p2p, has_p2p = _bucket_times(timeline, buckets)
    out = []
    for rank in range(timeline.num_ranks):
        y = rank * row
        out += _stack_groups(rank, y, acc[rank], buckets, factor, unit, hatch)
        if has_p2p:
            out += _p2p_flight_rects(rank, y, p2p[rank], buckets, factor, unit)
    return out


def _runs(shares: list[list[float]], tolerance: float):
    """``(first, last, mean shares)`` for stretches of buckets (``first`` to ``last - 1``)
    whose every share stays within ``tolerance`` of the stretch's mean."""
    if not shares:
        return
    first, total = 0, list(shares[0])
    for k in range(1, len(shares)):
        n = k - first
        if all(abs(s - t / n) <= tolerance for s, t in zip(shares[k], total)):
            total = [t + s for t, s in zip(total, shares[k])]
            continue
        yield first, k, [t / n for t in total]
        first, total = k, list(shares[k])
    yield first, len(shares), [t / (len(shares) - first) for t in total]


def _stack_heights(shares: list[float], pixels: int) -> list[int]:
    """Whole-pixel heights for ``shares`` of a lane ``pixels`` high (largest remainder)."""
    want = [s * pixels for s in shares]
    total = min(pixels, round(sum(want)))
    heights = [int(w) for w in want]
    order = sorted(range(len(want)), key=lambda i: want[i] - heights[i], reverse=True)
    for i in order[:max(0, total - sum(heights))]:
        heights[i] += 1
    return heights


def _axis(extent: float, px_per_unit: float, longest: float, unit: str, y: int) -> list[str]:
    """A time axis under the lanes, from 0 to this step's end (``extent``, display unit), with
    ticks every "nice" step of the page's longest step in that unit, labelled in ``unit``."""
    step = _nice_step((longest or 1.0) / 10)
    x_end = _LEFT + extent * px_per_unit
    out = [f'<line class="axis" x1="{_LEFT}" y1="{y}" x2="{x_end:.2f}" y2="{y}"/>',
           f'<text class="tick" x="4" y="{y + 12}">time ({html.escape(unit)})</text>']
    for k in range(int(extent / step + 1e-9) + 1):
        x = _LEFT + k * step * px_per_unit
        out.append(f'<line class="axis" x1="{x:.2f}" y1="{y}" x2="{x:.2f}" y2="{y + 4}"/>')
        out.append(f'<text class="tick" x="{x:.2f}" y="{y + 14}" text-anchor="middle">'
                   f"{k * step:.4g}</text>")
    out.append(f'<text class="tick" x="{x_end:.2f}" y="{y + 26}" text-anchor="end">'
               f"end of step: {_fmt(extent)} {html.escape(unit)}</text>")
    return out


def _summary_table(timeline: Timeline, has_p2p: bool = False) -> str:
    factor, unit = display_unit(timeline.unit)
    p2p_head = f"<th>p2p in flight ({unit})</th>" if has_p2p else ""
    peak_head = ("peak activations (count)" if timeline.chunks <= 1 else
                 f"peak activations (count of chunks of 1/{timeline.chunks} of a rank's "
                 "layers)")
    with_bytes = any(b is not None for b in timeline.peak_bytes)
    bytes_head = ("<th>peak activation bytes (" + ("measured" if timeline.source == "measured"
                                                  else "predicted") + ")</th>"
                  if with_bytes else "")
    rows = [
        f"<tr><th>rank</th><th>busy ({unit})</th><th>comm wait ({unit})</th>"
        f"<th>idle ({unit})</th>{p2p_head}<th>{html.escape(peak_head)}</th>{bytes_head}</tr>"
    ]
    in_flight = [0.0] * timeline.num_ranks
    if has_p2p:
        for e in timeline.events:
            if e.category == P2P and 0 <= e.rank < timeline.num_ranks:
                in_flight[e.rank] += e.duration
    for s in timeline.per_rank_summary():
        peak = "" if s["peak_activations"] is None else s["peak_activations"]
        p2p_cell = f"<td>{_fmt(in_flight[s['rank']] * factor)}</td>" if has_p2p else ""
        rows.append(
            f"<tr><td>{s['rank']}</td><td>{_fmt(s['busy'] * factor)}</td>"
            f"<td>{_fmt(s['comm_wait'] * factor)}</td><td>{_fmt(s['idle'] * factor)}</td>"
            f"{p2p_cell}<td>{peak}</td>{_bytes_cell(s['peak_bytes']) if with_bytes else ''}"
            "</tr>"
        )
    rows.append(
        f'<tr><th colspan="{(6 if has_p2p else 5) + (1 if with_bytes else 0)}">makespan {_fmt(timeline.makespan * factor)} '
        f"{unit}, bubble {100 * timeline.bubble_fraction:.2f}%</th></tr>"
    )
    return "<table>" + "".join(rows) + "</table>"


def _bytes_cell(value) -> str:
    """A byte count in binary units, the exact number in its tooltip."""
    if value is None:
        return "<td></td>"
    return f'<td title="{int(value)} bytes">{html.escape(format_bytes_iec(value))}</td>'


def _nice_step(raw: float) -> float:
    if raw <= 0:
        return 1.0
    power = 10 ** math.floor(math.log10(raw))
    return next(m * power for m in (1, 2, 5, 10) if m * power >= raw)


# ---------------------------------------------------------------- Chrome trace
_MICROSECONDS = {"t": 1000.0, "s": 1e6, "ms": 1e3, "us": 1.0}


def _chrome_units(timeline: Timeline) -> tuple[str, str, str, float]:
    """``(process name, note, unit of the events' args, factor to it)``: cost units stay t (and
    the name and the note say the viewer's ms are t); measured times go to ms."""
    if timeline.unit == "t":
        name = (f"{timeline.schedule} ({timeline.source}), in cost units t: the viewer's ms are "
                "t, not milliseconds")
        note = ("times are cost-model units t, not wall-clock time: ts and dur place 1 t at "
                "1000 us, so the viewer's 1 ms reads as 1 t; args hold the times in t")
        arg_unit, arg_factor = "t", 1.0
    else:
        factor, arg_unit = display_unit(timeline.unit)
        arg_factor = factor
        name = f"{timeline.schedule} ({timeline.source})"
        note = f"times measured in {timeline.unit}; ts and dur in microseconds, args in ms"
    return name, note, arg_unit, arg_factor


def _chrome_metadata(timeline: Timeline, name: str) -> list[dict]:
    """The "M" events: the process name, and a named thread per rank (tid = rank) and per rank
    with P2P batches (tid = p + rank), sorted so that each P2P thread follows its rank's."""
    p2p_ranks = sorted({e.rank for e in timeline.events if e.category == P2P})
    events: list[dict] = [
        {"name": "process_name", "ph": "M", "pid": 0, "tid": 0, "args": {"name": name}},
    ]
    for rank in range(timeline.num_ranks):
        events.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": rank,
                       "args": {"name": f"rank {rank}"}})
        events.append({"name": "thread_sort_index", "ph": "M", "pid": 0, "tid": rank,
                       "args": {"sort_index": 2 * rank}})
    for rank in p2p_ranks:
        tid = timeline.num_ranks + rank
        events.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": tid,
                       "args": {"name": f"rank {rank} p2p"}})
        events.append({"name": "thread_sort_index", "ph": "M", "pid": 0, "tid": tid,
                       "args": {"sort_index": 2 * rank + 1}})
    return events


def _chrome_event(e, num_ranks: int, t0: float, scale: float, arg_unit: str,
                  arg_factor: float) -> dict:
    """One event as an "X" event, timed from ``t0``: ``ts`` and ``dur`` in microseconds,
    ``args`` in ``arg_unit``; its thread is its rank's, or its rank's P2P thread."""
    if e.category == COMM_WAIT:
        cat, tid = "comm_wait", e.rank
    elif e.category == P2P:
        cat, tid = "p2p", num_ranks + e.rank
    else:
        cat, tid = e.kind, e.rank
    return {
        "name": e.label,
        "cat": cat,
        "ph": "X",
        "ts": (e.start - t0) * scale,
        "dur": e.duration * scale,
        "pid": 0,
        "tid": tid,
        "args": {"start": (e.start - t0) * arg_factor, "end": (e.end - t0) * arg_factor,
                 "duration": e.duration * arg_factor, "unit": arg_unit},
    }


def render_chrome_trace(timeline: Timeline) -> dict:
    """Chrome trace event JSON: an "X" event per action or wait (pid 0, tid = rank) and, for
    P2P batches in flight, per rank a thread "rank r p2p" (tid = p + r) under its rank.

    Chrome's format has ``ts`` and ``dur`` in microseconds and shows them as wall-clock time
    (``displayTimeUnit`` may only be "ms" or "ns"). Times in seconds become microseconds as it
    expects. Cost-model units have no wall-clock meaning: 1 t is placed at 1000 us, so the
    viewer's "1 ms" reads as 1 t, and the process name, every event's ``args`` (``start``,
    ``end``, ``duration`` with ``unit`` "t") and ``otherData`` say so. Times start at the
    timeline's first event.
    """
    if timeline.unit not in _MICROSECONDS:
        raise ValueError(
            f"timeline unit {timeline.unit!r} is not one of {', '.join(_MICROSECONDS)}"
        )
    scale, t0 = _MICROSECONDS[timeline.unit], timeline.start
    name, note, arg_unit, arg_factor = _chrome_units(timeline)
    events = _chrome_metadata(timeline, name)
    events += [_chrome_event(e, timeline.num_ranks, t0, scale, arg_unit, arg_factor)
               for e in timeline.events]
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "schedule": timeline.schedule,
            "source": timeline.source,
            "time_unit": timeline.unit,
            "note": note,
            "makespan": timeline.makespan,
            "bubble_fraction": timeline.bubble_fraction,
            "peak_activations": list(timeline.peak_activations),  # a count
            "peak_bytes": list(timeline.peak_bytes),  # activation bytes per rank
        },
    }
