"""What ``verify`` says: one screen of text (the verdict first), ``verify.json``, ``verify.html``
(both measured timelines on one time axis) and each run's measured timeline as a costs file
(``costs-reference.json``, ``costs-candidate.json``: ``select --costs`` and ``plan --costs``
read them), with the step time the simulator predicts from those costs.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from ..analysis.measured import predicted_timeline
from ..analysis.render import render_html
from ..schedules import build_schedule
from ..timeline import Timeline
from .compare import Verdict
from .runs import VerifyPlan


def _timeline(record: dict) -> Timeline | None:
    data = record.get("timeline")
    return Timeline.from_dict(data) if data else None


def run_stats(record: dict) -> dict:
    """A run's figures: the median step after the first, the measured bubble per pipeline
    rank and the simulator's step from the measured costs (last step), the peak memory."""
    seconds = [step["seconds"] for step in record["steps"]]
    stats = {"median_step_s": statistics.median(seconds[1:]) if len(seconds) > 1 else None,
             "step_s": seconds, "peak_bytes_per_rank": record["peak_bytes"],
             "bubble_per_rank": None, "predicted_step_s": None, "measured_step_s": None}
    timeline = _timeline(record)
    if timeline is None or timeline.makespan <= 0:
        return stats
    stats["bubble_per_rank"] = [timeline.idle(r) / timeline.makespan
                                for r in range(timeline.num_ranks)]
    stats["measured_step_s"] = timeline.makespan
    chunks = timeline.chunks if timeline.chunks > 1 else None
    if timeline.directions == 2:
        chunks = 2
    schedule = build_schedule(record["order"], timeline.num_ranks, timeline.num_microbatches,
                              chunks=chunks)
    stats["predicted_step_s"] = predicted_timeline(timeline, schedule).makespan
    return stats


def _ms(value) -> str:
    return "-" if value is None else f"{value * 1e3:.1f} ms"


def _list(values, fmt) -> str:
    return "-" if not values else "[" + ", ".join("-" if v is None else fmt(v)
                                                  for v in values) + "]"


def _mib(value) -> str:
    return f"{value / 2 ** 20:.1f} MiB" if value >= 2 ** 20 else f"{value / 1024:.0f} KiB"


def text_report(plan: VerifyPlan, verdict: Verdict, records: dict, stats: dict) -> str:
    ref, cand = plan.runs
    lines = [f"VERDICT: {verdict.verdict}: {cand.title} against {ref.title}, {plan.settings.steps} "
             f"steps, {verdict.compared} numbers compared",
             f"  tolerance: {verdict.tolerance.reason}",
             "  per step: " + ", ".join(f"{k + 1} {v}" + (f" ({verdict.worst[k]:.1e})"
                                                            if verdict.worst[k] else "")
                                        for k, v in enumerate(verdict.per_step))]
    if verdict.first_difference is not None:
        lines.append(f"  first difference: {verdict.first_difference.text()}")
    lines += ["", f"{'':24}{ref.title:>26}{cand.title:>26}"]
    rows = [("median step (2..N)", lambda s: _ms(s["median_step_s"])),
            ("predicted step", lambda s: _ms(s["predicted_step_s"])),
            ("traced step (last)", lambda s: _ms(s["measured_step_s"])),
            ("bubble per rank", lambda s: _list(s["bubble_per_rank"], lambda b: f"{b:.0%}")),
            ("peak memory per rank", lambda s: _list(s["peak_bytes_per_rank"], _mib))]
    for label, cell in rows:
        lines.append(f"{label:24}{cell(stats[ref.name]):>26}{cell(stats[cand.name]):>26}")
    ref_s, cand_s = stats[ref.name]["median_step_s"], stats[cand.name]["median_step_s"]
    if ref_s and cand_s:
        lines.append(f"{'speed-up':24}{'':>26}{ref_s / cand_s:>25.3f}x")
    for name in (ref.name, cand.name):
        losses = " ".join(f"{s['loss']:.6f}" if s["loss"] is not None else "-"
                          for s in records[name]["steps"])
        lines.append(f"{'losses ' + name:24}{losses}")
    lines += [""] + [f"note: {note}" for note in plan.notes]
    return "\n".join(lines)


def write_outputs(plan: VerifyPlan, verdict: Verdict, records: dict, stats: dict) -> list[str]:
    """verify.json, verify.html and the costs files in ``--out``; their paths."""
    out = Path(plan.settings.out)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    summary = {"verdict": verdict.verdict, "exit_code": verdict.exit_code,
               "tolerance": vars(verdict.tolerance), "per_step": verdict.per_step,
               "worst_relative_difference": verdict.worst, "compared": verdict.compared,
               "first_difference": (vars(verdict.first_difference)
                                    if verdict.first_difference else None),
               "notes": plan.notes, "world_size": plan.world_size,
               "runs": {name: {**records[name], "stats": stats[name]} for name in records}}
    written.append(_write(out / "verify.json", json.dumps(summary, indent=1, default=str)))
    timelines = [t for t in (_timeline(records[run.name]) for run in plan.runs) if t]
    for run in plan.runs:
        if records[run.name].get("timeline"):
            written.append(_write(out / f"costs-{run.name}.json",
                                  json.dumps(records[run.name]["timeline"])))
    if timelines:
        title = f"verify: {plan.runs[1].title} against {plan.runs[0].title} (last step)"
        written.append(_write(out / "verify.html", render_html(timelines, title=title)))
    return written


def failure_report(plan: VerifyPlan, run_name: str, error: str) -> tuple[str, dict]:
    """A run that did not finish: HANG (the plugin's timeout named the rank, the peer and the
    pending action) or FAILED, with the message."""
    hang = "PipelineTimeoutError" in error or "waited" in error and "gave up" in error
    verdict = "HANG" if hang else "FAILED"
    lines = [line for line in error.splitlines() if line.strip()]
    said = next((line for line in reversed(lines) if "Error" in line), lines[-1] if lines else "")
    text = f"VERDICT: {verdict}: the {run_name} run did not finish: {said.strip()}"
    return text, {"verdict": verdict, "exit_code": 1, "run": run_name, "error": error[-6000:],
                  "notes": plan.notes}


def _write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)
