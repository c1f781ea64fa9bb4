"""Pictures of a ``Timeline`` (predicted or measured): an ASCII grid, one self-contained HTML
page, and Chrome trace JSON (chrome://tracing, Perfetto)."""

from __future__ import annotations

import html
import math

from ..timeline import COMM_WAIT, Timeline

IDLE = "."
DEFAULT_WIDTH = 160  # characters of grid when the timeline has to be scaled


# ---------------------------------------------------------------- ASCII
def render_ascii(timeline: Timeline, width: int | None = None) -> str:
    """One row per rank, time flowing right, idle as ``.``, then a summary line.

    When every action starts and ends on a multiple of the shortest action (equal costs, or
    costs that are multiples of one another), each cell is that unit of time, as in the
    GPipe / 1F1B papers' tables; an action longer than one cell continues with ``-``.
    Otherwise (or when the grid would be wider than ``width``) time is scaled to ``width``
    characters.
    """
    quantum = _grid_quantum(timeline)
    cell = max((len(e.label) for e in timeline.compute_events()), default=1)
    cells = round(timeline.makespan / quantum) if quantum else 0
    if quantum and (width is None or cells * (cell + 1) <= width):
        header = f"one cell = {quantum:g} {timeline.unit}"
        rows = _unit_rows(timeline, quantum, cell, cells)
    else:
        width = width or DEFAULT_WIDTH
        header = f"one column = {timeline.makespan / width:.3g} {timeline.unit}"
        rows = _scaled_rows(timeline, width)
    name = f"r{timeline.num_ranks - 1}"
    lines = [
        f"{timeline.schedule} p={timeline.num_ranks} m={timeline.num_microbatches} "
        f"v={timeline.chunks} ({timeline.source}); {header}"
    ]
    lines += [f"{'r' + str(rank):<{len(name)}} |{row}" for rank, row in enumerate(rows)]
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


def _compute_by_rank(timeline: Timeline) -> list[list]:
    """Each rank's compute events by start time, in one pass over the events."""
    by_rank: list[list] = [[] for _ in range(timeline.num_ranks)]
    for e in timeline.compute_events():
        by_rank[e.rank].append(e)
    return [sorted(events, key=lambda e: e.start) for events in by_rank]


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


# ---------------------------------------------------------------- HTML
_COLOURS = {"F": "#4e79a7", "B": "#59a14f", "I": "#f28e2b", "W": "#b07aa1"}
_LANE, _GAP, _LEFT, _PLOT = 22, 4, 64, 1100  # pixels


def render_html(timelines: list[Timeline], title: str = "Pipeline timelines") -> str:
    """One self-contained page (inline CSS and SVG, no scripts): a lane per rank for every
    timeline (predicted above measured), colours per kind, hatched grey for communication
    waits, hover titles with start and end, and a summary table under each picture."""
    ordered = sorted(timelines, key=lambda t: t.source != "predicted")  # stable
    css = "".join(f"rect.{k}{{fill:{c}}} .key.{k}{{background:{c}}}" for k, c in _COLOURS.items())
    legend = " ".join(
        f'<span class="key {k}"></span>{name}'
        for k, name in zip("FBIW", ("forward", "backward", "input grad", "weight grad"))
    )
    parts = [
        "<!DOCTYPE html>",
        '<html><head><meta charset="utf-8">',
        f"<title>{html.escape(title)}</title>",
        "<style>body{font-family:sans-serif;margin:16px}svg{display:block;margin:4px 0}"
        "table{border-collapse:collapse;margin:6px 0 24px}td,th{border:1px solid #ccc;"
        "padding:2px 8px;text-align:right}text{font-size:10px;pointer-events:none}"
        ".lane{font-size:12px;fill:#333}.tick{font-size:10px;fill:#666}"
        ".key{display:inline-block;width:12px;height:12px;margin:0 4px 0 12px;"
        "vertical-align:middle}.key.comm{background:#bbb}" + css + "</style>",
        "</head><body>",
        f"<h1>{html.escape(title)}</h1>",
        f'<p>{legend}<span class="key comm"></span>waiting for a message</p>',
    ]
    for index, timeline in enumerate(ordered):
        parts.append(_timeline_section(timeline, index))
    parts.append("</body></html>")
    return "\n".join(parts)


def _timeline_section(timeline: Timeline, index: int) -> str:
    unit, t0 = timeline.unit, timeline.start
    makespan = timeline.makespan or 1.0
    scale = _PLOT / makespan
    height = timeline.num_ranks * (_LANE + _GAP) + 20
    hatch = f"hatch{index}"
    svg = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{_LEFT + _PLOT + 10}" '
        f'height="{height}">',
        f'<defs><pattern id="{hatch}" width="6" height="6" patternUnits="userSpaceOnUse" '
        'patternTransform="rotate(45)"><rect width="6" height="6" fill="#ddd"/>'
        '<line x1="0" y1="0" x2="0" y2="6" stroke="#999" stroke-width="3"/></pattern></defs>',
    ]
    for rank in range(timeline.num_ranks):
        y = rank * (_LANE + _GAP)
        svg.append(f'<text class="lane" x="4" y="{y + _LANE - 6}">rank {rank}</text>')
        svg.append(f'<rect x="{_LEFT}" y="{y}" width="{_PLOT}" height="{_LANE}" fill="#f6f6f6"/>')
    for e in timeline.events:
        x, w = _LEFT + (e.start - t0) * scale, max(e.duration * scale, 0.5)
        y = e.rank * (_LANE + _GAP)
        tip = html.escape(
            f"{e.label} (rank {e.rank}): {e.start - t0:.6g} to {e.end - t0:.6g} {unit}"
        )
        if e.category == COMM_WAIT:
            fill = f' fill="url(#{hatch})"'
        else:
            fill = f' class="{e.kind}"' if e.kind in _COLOURS else ' fill="#888"'
        svg.append(
            f'<rect x="{x:.2f}" y="{y}" width="{w:.2f}" height="{_LANE}"{fill} '
            f'stroke="#fff" stroke-width="0.5"><title>{tip}</title></rect>'
        )
        if e.category != COMM_WAIT and w >= 7 * len(e.label):
            svg.append(
                f'<text x="{x + 2:.2f}" y="{y + _LANE - 7}" fill="#fff">'
                f"{html.escape(e.label)}</text>"
            )
    step = _nice_step(makespan / 10)
    ticks_y = timeline.num_ranks * (_LANE + _GAP) + 12
    for k in range(int(makespan / step) + 1):
        svg.append(
            f'<text class="tick" x="{_LEFT + k * step * scale:.2f}" y="{ticks_y}">'
            f"{k * step:.4g}</text>"
        )
    svg.append("</svg>")
    heading = (
        f"<h2>{html.escape(timeline.schedule)} — {html.escape(timeline.source)} "
        f"(p={timeline.num_ranks}, m={timeline.num_microbatches}, v={timeline.chunks})</h2>"
    )
    return heading + "\n" + "\n".join(svg) + "\n" + _summary_table(timeline)


def _summary_table(timeline: Timeline) -> str:
    unit = timeline.unit
    rows = [
        f"<tr><th>rank</th><th>busy ({unit})</th><th>comm wait ({unit})</th>"
        f"<th>idle ({unit})</th><th>peak activations</th></tr>"
    ]
    for s in timeline.per_rank_summary():
        peak = "" if s["peak_activations"] is None else s["peak_activations"]
        rows.append(
            f"<tr><td>{s['rank']}</td><td>{s['busy']:.6g}</td><td>{s['comm_wait']:.6g}</td>"
            f"<td>{s['idle']:.6g}</td><td>{peak}</td></tr>"
        )
    rows.append(
        f'<tr><th colspan="5">makespan {timeline.makespan:.6g} {unit}, '
        f"bubble {100 * timeline.bubble_fraction:.2f}%</th></tr>"
    )
    return "<table>" + "".join(rows) + "</table>"


def _nice_step(raw: float) -> float:
    if raw <= 0:
        return 1.0
    power = 10 ** math.floor(math.log10(raw))
    return next(m * power for m in (1, 2, 5, 10) if m * power >= raw)


# ---------------------------------------------------------------- Chrome trace
_MICROSECONDS = {"t": 1000.0, "s": 1e6, "ms": 1e3, "us": 1.0}


def render_chrome_trace(timeline: Timeline) -> dict:
    """Chrome trace event JSON: an "X" event per action or wait, pid 0, tid = rank.

    Cost-model time maps 1 t to 1000 us; measured seconds map to microseconds. Times start at
    the timeline's first event.
    """
    if timeline.unit not in _MICROSECONDS:
        raise ValueError(
            f"timeline unit {timeline.unit!r} is not one of {', '.join(_MICROSECONDS)}"
        )
    scale, t0 = _MICROSECONDS[timeline.unit], timeline.start
    events: list[dict] = [
        {"name": "process_name", "ph": "M", "pid": 0, "tid": 0,
         "args": {"name": f"{timeline.schedule} ({timeline.source})"}},
    ]
    for rank in range(timeline.num_ranks):
        events.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": rank,
                       "args": {"name": f"rank {rank}"}})
        events.append({"name": "thread_sort_index", "ph": "M", "pid": 0, "tid": rank,
                       "args": {"sort_index": rank}})
    for e in timeline.events:
        events.append({
            "name": e.label,
            "cat": e.kind if e.category != COMM_WAIT else "comm_wait",
            "ph": "X",
            "ts": (e.start - t0) * scale,
            "dur": e.duration * scale,
            "pid": 0,
            "tid": e.rank,
            "args": {"start": e.start, "end": e.end, "unit": timeline.unit},
        })
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "schedule": timeline.schedule,
            "source": timeline.source,
            "makespan": timeline.makespan,
            "bubble_fraction": timeline.bubble_fraction,
            "peak_activations": list(timeline.peak_activations),
        },
    }
