"""What a run leaves in ``--out``: summary.json, timeline.html (predicted above measured) and
trace.json (the measured step as a Chrome trace, for chrome://tracing or Perfetto)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..analysis.render import render_chrome_trace, render_html
from ..timeline import Timeline


def write_outputs(out: str, summary: dict, predicted: Timeline | None,
                  measured: Timeline | None) -> list[str]:
    """Write the files; returns their paths. Timelines are written only when measured."""
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    written = [_write(folder / "summary.json", json.dumps(summary, indent=1) + "\n")]
    for stale in ("timeline.html", "trace.json"):  # from an earlier run into the same folder
        if measured is None and (folder / stale).exists():
            os.remove(folder / stale)
    if measured is not None:
        timelines = [t for t in (predicted, measured) if t is not None]
        title = (f"{summary['schedule']}: p={summary['pp']}, m={summary['microbatches']}, "
                 f"v={summary['chunks']}, step {summary['steps']} (predicted from the measured "
                 "action costs, above what was measured)")
        written.append(_write(folder / "timeline.html", render_html(timelines, title=title)))
        written.append(_write(folder / "trace.json",
                              json.dumps(render_chrome_trace(measured)) + "\n"))
    return written


def _write(path: Path, text: str) -> str:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
    return str(path)
