"""Where a figure comes from: the commit, whether the tree had uncommitted changes, the UTC
time and the exact command line of the run that produced it.

Every section of ``bench/results/results.json`` carries one of these, so a results file that
was regenerated in parts (``run_all.py --only``) still says which run made which rows.
"""

from __future__ import annotations

import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def utc_now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _git(*args: str) -> str:
    try:  # rstrip only: porcelain status lines start with a meaningful space
        return subprocess.run(["git", *args], cwd=ROOT, text=True, capture_output=True,
                              timeout=10).stdout.rstrip()
    except (OSError, subprocess.SubprocessError):
        return "?"


def command_line(argv=None) -> str:
    """The command as typed from the repository root: the interpreter (relative when it lives
    under the current folder, e.g. ``.venv/bin/python``) and the script's arguments."""
    python = sys.executable
    relative = os.path.relpath(python)
    if not relative.startswith(".."):
        python = relative
    args = sys.argv if argv is None else [sys.argv[0], *argv]
    return shlex.join([python, *args])


def load() -> str:
    try:
        return " ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        return "?"


def current(argv=None) -> dict:
    """This run's provenance, taken when it starts. ``dirty`` is True when tracked or
    untracked files differ from the commit (other people's edits included: they may have
    changed the code that was measured); ``dirty_paths`` says which."""
    status = _git("status", "--porcelain", "--untracked-files=normal")
    dirty_paths = [line[3:] for line in status.splitlines() if line.strip()]
    return {
        "commit": _git("rev-parse", "HEAD"), "dirty": bool(dirty_paths),
        "dirty_paths": dirty_paths, "utc_start": utc_now(), "command": command_line(argv),
        "cpus": os.cpu_count(), "python": platform.python_version(), "load_before": load(),
    }


def finish(prov: dict, started: float) -> dict:
    """Close a provenance record: end time, load after, seconds."""
    return {**prov, "utc_end": utc_now(), "load_after": load(),
            "seconds": round(time.perf_counter() - started, 1)}


def short(prov: dict) -> str:
    """One line for Markdown: commit (dirty), UTC start, command."""
    commit = prov.get("commit", "?")[:10]
    dirty = f" + uncommitted changes in {len(prov['dirty_paths'])} files" if prov.get(
        "dirty") else ""
    return f"commit `{commit}`{dirty}, {prov.get('utc_start', '?')}, `{prov.get('command', '?')}`"


def write_results(out, lines: list[str], data: dict) -> None:
    """``out``.md (the lines) and ``out``.json (the data) beside it, and the lines printed."""
    import json
    from pathlib import Path

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    out.with_suffix(".json").write_text(json.dumps(data, indent=1))
    print("\n".join(lines))
