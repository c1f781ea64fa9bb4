"""The GPU check's part 4: ``verify`` on the GPUs, the user's path end to end. Megatron-LM's own
``pretrain_gpt.py`` (``$MEGATRON_LM_PATH``, else the release's copy in the shared folder) runs a
tiny GPT under Megatron's 1F1B and under zb-h1 through ``torchrun --nproc-per-node 2 -m
megatron_pp_ext verify`` (NCCL, one GPU a rank, Transformer Engine's layers where it is
installed, bf16): the verdict must be IDENTICAL or WITHIN TOLERANCE, and the summary line gives
both median steps and CUDA's peak allocated bytes per rank from ``verify.json``.

NOT RUN (never counted as a pass) with fewer than 2 GPUs (one GPU cannot host two NCCL ranks) or
without ``pretrain_gpt.py``. Nothing is written except a temporary folder for verify's files.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from bench.gpu_nccl import NCCL_WORLD, NOT_RUN, nccl_unavailable

ROOT = Path(__file__).resolve().parent.parent
TINY_GPT = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "8",
            "--seq-length", "512", "--max-position-embeddings", "512", "--micro-batch-size", "1",
            "--global-batch-size", "8", "--train-iters", "10", "--lr", "1e-4", "--bf16",
            "--pipeline-model-parallel-size", "2", "--use-distributed-optimizer",
            "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "1024",
            "--untie-embeddings-and-output-weights", "--log-interval", "1"]


def pretrain_gpt_script() -> Path | None:
    """Megatron-LM's pretrain_gpt.py: a checkout's, else the shared folder's for this release."""
    checkout = os.environ.get("MEGATRON_LM_PATH")
    if checkout and (Path(checkout) / "pretrain_gpt.py").is_file():
        return Path(checkout) / "pretrain_gpt.py"
    sys.path.insert(0, str(ROOT / "tests"))
    try:
        from support.megatron_lm_scripts import scripts_folder

        return scripts_folder() / "pretrain_gpt.py"
    except (ImportError, FileNotFoundError):
        return None


def verify_unavailable(no_nccl: bool) -> str | None:
    reason = nccl_unavailable(no_nccl)
    if reason is None and pretrain_gpt_script() is None:
        reason = "no pretrain_gpt.py (set MEGATRON_LM_PATH to a Megatron-LM checkout)"
    return reason


def _transformer_impl() -> list[str]:
    try:
        import transformer_engine  # noqa: F401
        return ["--transformer-impl", "transformer_engine"]
    except ImportError:
        return ["--transformer-impl", "local"]


def verify_part(no_nccl: bool, timeout_s: float = 900.0) -> tuple[str, str]:
    """(PASS / FAIL / NOT RUN, what it says)."""
    reason = verify_unavailable(no_nccl)
    if reason is not None:
        return NOT_RUN, reason
    out = Path(tempfile.mkdtemp(prefix="gpu_check_verify_"))
    script = pretrain_gpt_script()
    command = [os.path.join(os.path.dirname(sys.executable), "torchrun"), "--nproc-per-node",
               str(NCCL_WORLD), "-m", "megatron_pp_ext", "verify", "--schedule", "zb-h1",
               "--steps", "5", "--out", str(out), "--", str(script), *TINY_GPT,
               *_transformer_impl()]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(script.parent), str(ROOT), os.environ.get("PYTHONPATH", "")]),
        CUDA_DEVICE_MAX_CONNECTIONS="1")
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True,
                              timeout=timeout_s)
        return _verdict(done, out / "verify.json")
    except subprocess.TimeoutExpired:
        return "FAIL", f"verify did not end within {timeout_s:g} s"
    finally:
        shutil.rmtree(out, ignore_errors=True)


def _verdict(done, summary_path: Path) -> tuple[str, str]:
    if not summary_path.exists():
        return "FAIL", f"verify exited {done.returncode} without verify.json: {done.stderr[-600:]}"
    summary = json.loads(summary_path.read_text())
    if summary["verdict"] not in ("IDENTICAL", "WITHIN TOLERANCE"):
        said = summary.get("first_difference") or summary.get("error", "")
        return "FAIL", f"verdict {summary['verdict']}: {said}"[:800]
    stats = {name: run["stats"] for name, run in summary["runs"].items()}
    peaks = {name: [f"{b / 2**20:.0f} MiB" for b in s["peak_bytes_per_rank"] if b]
             for name, s in stats.items()}
    return "PASS", (f"verdict {summary['verdict']} on {torch.cuda.get_device_name(0)}; median "
                    f"step 1F1B {stats['reference']['median_step_s'] * 1e3:.1f} ms, zb-h1 "
                    f"{stats['candidate']['median_step_s'] * 1e3:.1f} ms; CUDA peak per rank "
                    f"{peaks['reference']} / {peaks['candidate']}")
