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


#: the hint ``train`` prints once (rank 0) when p > m, here for p=2, m=1
P_OVER_M_HINT = ("hint: p=2 > m=1: most ranks idle most of the step; use m >= p "
                 "(Megatron needs m >= p for interleaved)")


def assert_no_megatron_warnings(text: str) -> None:
    """Megatron-Core's warnings (apex / Transformer Engine missing, deprecations: Python
    warnings and its logger) never reach train's output."""
    for words in ("UserWarning", "FutureWarning", "warnings.warn", "site-packages/megatron/",
                  "Apex is not installed", "deprecated"):
        assert words not in text, (words, text[-3000:])


def clean_env() -> dict:
    return {k: v for k, v in os.environ.items() if k not in LAUNCHER_ENV}


def run_train(*args: str, timeout: float = 150) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "megatron_pp_ext", "train", *args], cwd=REPO,
                          env=clean_env(), capture_output=True, text=True, timeout=timeout)


def run_train_all(*commands: list[str], timeout: float = 240) -> list[subprocess.CompletedProcess]:
    """Several ``train`` commands started at once (each spends most of its time importing
    Megatron on one core: side by side they use both), their results in order. A command
    still running after ``timeout`` seconds is killed and raises ``TimeoutExpired``."""
    procs = [subprocess.Popen([sys.executable, "-m", "megatron_pp_ext", "train", *args],
                              cwd=REPO, env=clean_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for args in commands]
    results = []
    try:
        for args, proc in zip(commands, procs):
            out, err = proc.communicate(timeout=timeout)
            results.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    return results
