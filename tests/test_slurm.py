"""The SLURM scripts: shell syntax, the GPU job's Megatron-LM arguments (through Megatron's own
parser and validation, for every schedule), and, with a running SLURM (``MEGATRON_PP_SLURM=1``,
as ``scripts/ci_slurm.sh`` sets after ``scripts/slurm/local_cluster.sh start``), real jobs."""

import os
import shlex
import shutil
import subprocess
import sys
from importlib.util import find_spec
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SLURM_DIR = REPO / "scripts" / "slurm"
CPU_JOB = SLURM_DIR / "train_cpu.sbatch"
GPU_JOB = SLURM_DIR / "train_gpu.sbatch"
SCHEDULES = ["gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2", "zb-v", "dualpipev"]
SBATCH_TIMEOUT_S = 300

needs_slurm = pytest.mark.skipif(
    os.environ.get("MEGATRON_PP_SLURM") != "1",
    reason="needs a running SLURM: scripts/ci_slurm.sh starts one and sets MEGATRON_PP_SLURM=1",
)


@pytest.mark.parametrize("script", ["train_cpu.sbatch", "train_gpu.sbatch", "local_cluster.sh",
                                    "../ci_slurm.sh"])
def test_scripts_are_valid_bash(script):
    subprocess.run(["bash", "-n", str(SLURM_DIR / script)], check=True)


def _gpu_launch(env_overrides: dict) -> list[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(DRY_RUN="1", REPO=str(REPO), **env_overrides)
    out = subprocess.run(["bash", str(GPU_JOB)], env=env, capture_output=True, text=True,
                         check=True, timeout=60).stdout
    return shlex.split(out.split("LAUNCH:", 1)[1])


def test_gpu_job_launches_one_torchrun_per_node():
    launch = _gpu_launch(dict(SLURM_NNODES="2", GPUS_PER_NODE="8", SCHEDULE="zb-h1", TP="2",
                              PP="4", MICROBATCHES="12"))
    head = " ".join(launch[: launch.index("--rdzv-endpoint") + 2])
    assert head.startswith("srun --ntasks-per-node=1 ")
    assert "torchrun --nnodes 2 --nproc-per-node 8" in head
    assert "--rdzv-backend c10d --rdzv-endpoint localhost:29500" in head
    args = launch[launch.index(str(REPO / "scripts" / "pretrain_gpt_pp.py")) + 1:]
    # 16 GPUs / (TP 2 * PP 4) = DP 2; global batch = 1 * 2 * 12 microbatches
    assert args[args.index("--global-batch-size") + 1] == "24"
    assert args[args.index("--pipeline-schedule") + 1] == "zb-h1"


def test_gpu_job_refuses_sizes_that_do_not_divide():
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(DRY_RUN="1", SLURM_NNODES="1", GPUS_PER_NODE="8", TP="3", PP="4")
    proc = subprocess.run(["bash", str(GPU_JOB)], env=env, capture_output=True, text=True)
    assert proc.returncode == 1 and "must divide" in proc.stderr


@pytest.mark.skipif(find_spec("megatron.training") is None,
                    reason="megatron.training is not importable")
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_gpu_job_arguments_pass_megatron_validation(monkeypatch, schedule):
    """The exact arguments train_gpu.sbatch passes, through Megatron-LM's parse_args and
    validate_args (2 nodes x 8 GPUs), then the plugin's own check of them."""
    import megatron.training.arguments as megatron_arguments

    from megatron_pp_ext.integration.megatron_args import (
        ENV_SCHEDULE,
        add_pipeline_schedule_args,
        schedule_options_from_args,
    )

    launch = _gpu_launch(dict(SLURM_NNODES="2", GPUS_PER_NODE="8", SCHEDULE=schedule))
    script = launch.index(str(REPO / "scripts" / "pretrain_gpt_pp.py"))
    monkeypatch.setattr(sys, "argv", launch[script:])
    monkeypatch.delenv(ENV_SCHEDULE, raising=False)
    # What the job's ranks see: 16 ranks; the sbatch exports CUDA_DEVICE_MAX_CONNECTIONS=1.
    monkeypatch.setenv("WORLD_SIZE", "16")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    # validate_args asks the GPU for its architecture when TP > 1: answer as a Hopper would.
    monkeypatch.setattr(megatron_arguments, "get_device_arch_version", lambda: 9)
    args = megatron_arguments.parse_args(extra_args_provider=add_pipeline_schedule_args)
    megatron_arguments.validate_args(args)
    options = schedule_options_from_args(args)
    assert options["schedule"] == schedule
    assert args.data_parallel_size == 2
    expect_chunks = {"interleaved": 2, "zb-v": 2, "dualpipev": 2}.get(schedule)
    assert options["chunks"] == expect_chunks
    assert (args.virtual_pipeline_model_parallel_size or 1) == (expect_chunks or 1)


# --- real jobs on a running SLURM ----------------------------------------------------------


def _sbatch(tmp_path, script, env_overrides, *sbatch_args):
    """``sbatch --wait`` (under ``timeout``); returns (exit status, the job's output)."""
    assert shutil.which("sbatch"), "MEGATRON_PP_SLURM=1 but sbatch is not on PATH"
    output = tmp_path / "job-%j.out"
    env = dict(os.environ, REPO=str(REPO), **env_overrides)
    proc = subprocess.run(
        ["timeout", str(SBATCH_TIMEOUT_S), "sbatch", "--wait", "--parsable",
         f"--output={output}", f"--chdir={tmp_path}", *sbatch_args, str(script)],
        env=env, capture_output=True, text=True, timeout=SBATCH_TIMEOUT_S + 30,
    )
    assert proc.returncode != 124, f"sbatch --wait timed out after {SBATCH_TIMEOUT_S} s"
    job_id = proc.stdout.strip().split(";")[0]
    assert job_id.isdigit(), f"sbatch said: {proc.stdout!r} {proc.stderr!r}"
    text = (tmp_path / f"job-{job_id}.out").read_text()
    return proc.returncode, text


def _train_cmd() -> tuple[str | None, str]:
    """The CPU job's command and the word its output must contain: the plugin's ``train``
    command when it exists, else ``demo`` (simulated timelines)."""
    python = str(REPO / ".venv" / "bin" / "python")
    has_train = subprocess.run([python, "-m", "megatron_pp_ext", "train", "--help"],
                               capture_output=True, cwd=REPO, timeout=120).returncode == 0
    if has_train:
        return None, "loss"  # the sbatch's own default TRAIN_CMD
    return f"{shlex.quote(python)} -m megatron_pp_ext demo", "bubble"


@needs_slurm
def test_train_cpu_job(tmp_path):
    train_cmd, expect = _train_cmd()
    env = dict(SCHEDULE="1f1b", PP="2", M="4", STEPS="2", OUT=str(tmp_path / "out"))
    if train_cmd:
        env["TRAIN_CMD"] = train_cmd
    status, text = _sbatch(tmp_path, CPU_JOB, env)
    assert status == 0, text[-4000:]
    assert "schedule=1f1b pp=2 microbatches=4 steps=2" in text
    assert "train_cpu: exit 0" in text
    assert expect in text.lower(), text[-4000:]


@needs_slurm
def test_failing_job_fails_sbatch_wait(tmp_path):
    status, text = _sbatch(tmp_path, CPU_JOB, dict(TRAIN_CMD="echo about to fail; exit 7",
                                                   OUT=str(tmp_path / "out")))
    assert status == 7
    assert "about to fail" in text and "train_cpu: exit 7" in text


@needs_slurm
def test_gpu_job_script_under_slurm_finds_master(tmp_path):
    """train_gpu.sbatch inside a real (GPU-less) allocation, dry run: MASTER_ADDR is the first
    node that ``scontrol show hostnames`` lists."""
    status, text = _sbatch(tmp_path, GPU_JOB, dict(DRY_RUN="1", GPUS_PER_NODE="8"),
                           "--gpus-per-node=0", "--nodes=1", "--no-requeue")
    assert status == 0, text
    node = subprocess.run(["hostname", "-s"], capture_output=True, text=True).stdout.strip()
    assert f"--rdzv-endpoint {node}:29500" in text
    assert "--nnodes 1 --nproc-per-node 8" in text
