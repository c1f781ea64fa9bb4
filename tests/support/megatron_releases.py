"""Other megatron-core releases beside the pinned one, for the release matrix.

``overlay(version)`` installs that release's wheel (no dependencies: torch and the rest are the
venv's) into ``.venv/megatron-releases/<version>/`` once, and returns the folder; put first on
``PYTHONPATH``, it shadows the venv's megatron-core for that process and the ranks it starts.
``scripts/test.sh`` runs the window's tests that way (``python tests/support/megatron_releases.py
VERSION`` prints the folder)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RELEASES = ROOT / ".venv" / "megatron-releases"

#: the releases of the supported window besides the pinned one (requirements.txt), and the
#: one below the window that install() must refuse
WINDOW = ("0.17.1", "0.18.2")
BELOW_WINDOW = "0.16.1"


def overlay(version: str) -> Path:
    target = RELEASES / version
    done = target / ".installed"
    if done.exists():
        return target
    partial = RELEASES / f".{version}.partial-{os.getpid()}"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check",
                    "--no-deps", "--target", str(partial), f"megatron-core=={version}"],
                   check=True, timeout=600)
    (partial / ".installed").write_text(version + "\n")
    try:
        partial.rename(target)  # whole or not at all (another process may have won)
    except OSError:
        subprocess.run(["rm", "-rf", str(partial)], check=False)
    return target


if __name__ == "__main__":
    for name in sys.argv[1:]:
        print(overlay(name))
