"""Running ``python -m megatron_pp_ext train`` as a user would, in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
#: what a launcher (torchrun, srun) sets: kept out, so the command runs its local launcher
LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_STEP_ID",
                "PYTHONWARNINGS")


def clean_env() -> dict:
    return {k: v for k, v in os.environ.items() if k not in LAUNCHER_ENV}


def run_train(*args: str, timeout: float = 150) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "megatron_pp_ext", "train", *args], cwd=REPO,
                          env=clean_env(), capture_output=True, text=True, timeout=timeout)
