"""Megatron-LM's own ``pretrain_gpt.py`` with the plugin: ``scripts/pretrain_gpt_pp.py`` and
``pretrain_gpt.py`` patched with ``patches/pretrain_gpt_core_r0.19.0.patch``.

These need a checkout of NVIDIA/Megatron-LM (``pretrain_gpt.py`` and its builders are not in the
megatron-core wheel): the script on any branch of the window (core_r0.17.0 to core_r0.19.0,
main), the patch on ``core_r0.19.0``; ``scripts/check_megatron_tree.sh PATH`` runs them, so they live outside ``tests/`` and are not
part of ``pytest tests``. Run them with the checkout's path:

    MEGATRON_LM_PATH=/path/to/Megatron-LM .venv/bin/python -m pytest -q tests_megatron_lm

Without ``MEGATRON_LM_PATH`` every test here fails, saying so (see docs/megatron-lm.md for the
last recorded run).
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_pp_ext.integration.megatron_args import ENV_SCHEDULE

REPO = Path(__file__).resolve().parents[1]
PATCH = REPO / "patches" / "pretrain_gpt_core_r0.19.0.patch"

MEGATRON_ARGV = [
    "pretrain_gpt.py", "--num-layers", "8", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "1",
    "--global-batch-size", "8", "--train-iters", "2", "--lr", "1e-3", "--mock-data",
    "--tokenizer-type", "NullTokenizer", "--vocab-size", "128",
    "--pipeline-model-parallel-size", "4",
]

_SCRIPT_HARNESS = r"""
import json, runpy, sys
import megatron.training
from megatron_pp_ext import megatron_compat
calls = []
form = megatron_compat.pretrain_form()
def stop_before_cuda(*a, **k):  # pretrain() needs CUDA/NCCL: record how it was called
    calls.append((a, k))
    if form == "args":  # 0.17: pretrain() parses the arguments, get_model calls the provider
        from megatron.training.arguments import parse_args, validate_args
        from megatron.training.global_vars import set_global_variables
        args = parse_args(k.get("extra_args_provider"))
        validate_args(args, k.get("args_defaults", {}))
        set_global_variables(args, build_tokenizer=False)
        try:
            a[1]()  # its first call installs the schedule; the build needs parallel state
        except Exception:
            pass
megatron.training.pretrain = stop_before_cuda
sys.argv = [SCRIPT] + json.loads(sys.argv[1])
runpy.run_path(SCRIPT, run_name="__main__")
a, kwargs = calls[0]
datasets, forward_step = {"args": (0, 3), "provider": (1, 4), "config": (1, 3)}[form]
datasets, forward_step = a[datasets], a[forward_step]
from megatron.training import get_args
import megatron.training.training as training
args = get_args()
fn = training.get_forward_backward_func(pp_size=args.pipeline_model_parallel_size,
                                        vp_size=args.virtual_pipeline_model_parallel_size)
print("RESULT", json.dumps(dict(forward_step=forward_step.__module__,
                                datasets=datasets.__module__, schedule=args.pipeline_schedule,
                                embedding_ranks=kwargs["get_embedding_ranks"].__name__,
                                fb_module=fn.__module__,
                                megatron_core=__import__("megatron.core").core.__file__)))
"""


def megatron_lm_checkout() -> Path:
    """The Megatron-LM checkout named by MEGATRON_LM_PATH; the test fails, saying why, without
    one."""
    value = os.environ.get("MEGATRON_LM_PATH")
    if not value:
        pytest.fail("MEGATRON_LM_PATH is not set: these tests need a checkout of NVIDIA/Megatron-LM "
                    "at branch core_r0.19.0 (git clone -b core_r0.19.0 "
                    "https://github.com/NVIDIA/Megatron-LM); run "
                    "MEGATRON_LM_PATH=/path/to/Megatron-LM .venv/bin/python -m pytest -q "
                    "tests_megatron_lm", pytrace=False)
    path = Path(value)
    if not (path / "pretrain_gpt.py").is_file():
        pytest.fail(f"MEGATRON_LM_PATH={value} has no pretrain_gpt.py: point it at the root of a "
                    "Megatron-LM checkout (branch core_r0.19.0)", pytrace=False)
    return path


@pytest.mark.parametrize("script", ["wrapper", "patched"])
@pytest.mark.parametrize("how", [None, "env", "flag"])
def test_scripts_call_pretrain_like_pretrain_gpt(tmp_path, script, how):
    """scripts/pretrain_gpt_pp.py, and pretrain_gpt.py with the patch applied, run up to
    pretrain() (replaced: it needs CUDA): pretrain_gpt's own providers, and the plugin's
    forward_backward_func exactly when a schedule is asked for."""
    megatron_lm = megatron_lm_checkout()
    if script == "wrapper":
        path = REPO / "scripts" / "pretrain_gpt_pp.py"
    else:
        assert shutil.which("patch"), "the `patch` program is needed to apply " + str(PATCH)
        shutil.copy(megatron_lm / "pretrain_gpt.py", tmp_path / "pretrain_gpt.py")
        done = subprocess.run(["patch", "-p1", "-i", str(PATCH)], cwd=tmp_path,
                              capture_output=True, text=True)
        assert done.returncode == 0, f"{PATCH.name} does not apply:\n{done.stdout}{done.stderr}"
        path = tmp_path / "pretrain_gpt.py"
    env = dict(os.environ, WORLD_SIZE="4", RANK="0",
               PYTHONPATH=os.pathsep.join([str(megatron_lm), os.environ.get("PYTHONPATH", "")]))
    env.pop(ENV_SCHEDULE, None)
    argv = MEGATRON_ARGV[1:]
    if how == "env":
        env[ENV_SCHEDULE] = "1f1b"
    elif how == "flag":
        argv = argv + ["--pipeline-schedule", "1f1b"]
    code = f"SCRIPT = {str(path)!r}\n" + _SCRIPT_HARNESS
    proc = subprocess.run([sys.executable, "-W", "ignore", "-c", code, json.dumps(argv)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.split("RESULT ", 1)[1].splitlines()[0])
    own = "pretrain_gpt" if script == "wrapper" else "__main__"
    assert result["forward_step"] == result["datasets"] == own
    assert result["embedding_ranks"] == "get_embedding_ranks"
    assert result["schedule"] == ("1f1b" if how else None)
    assert result["fb_module"].startswith("megatron_pp_ext") == bool(how)
    # Megatron-Core is the checkout's (PYTHONPATH first), not the installed wheel's
    assert Path(result["megatron_core"]).resolve().is_relative_to(megatron_lm.resolve())
