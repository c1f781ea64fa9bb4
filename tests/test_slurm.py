"""The SLURM scripts: shell syntax, the GPU job's Megatron-LM arguments (through Megatron's own
parser and validation, for every schedule), and real jobs on a running SLURM.

The real jobs need SLURM: ``bash scripts/test.sh`` (the README's test command) starts a
two-node SLURM on this machine (``--nodes 2``: network namespaces) with ``scripts/slurm/local_cluster.sh`` and stops it afterwards.
Without a running SLURM these tests fail, saying how to start one. They find it through
``$SLURM_CONF``, else the local cluster's ``slurm.conf`` when it exists, else SLURM's default
configuration (a real cluster)."""

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from support.train_cli import P_OVER_M_HINT, assert_no_megatron_warnings

REPO = Path(__file__).resolve().parents[1]
SLURM_DIR = REPO / "scripts" / "slurm"
CPU_JOB = SLURM_DIR / "train_cpu.sbatch"
GPU_JOB = SLURM_DIR / "train_gpu.sbatch"
LOCAL_CLUSTER = SLURM_DIR / "local_cluster.sh"
SCHEDULES = ["gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2", "zb-v", "dualpipev"]
SBATCH_TIMEOUT_S = 300
HOW_TO_START = ("start one with `bash scripts/slurm/local_cluster.sh start` (as root; it installs "
                "slurm-wlm and munge if missing) or run the tests with `bash scripts/test.sh`, "
                "which starts and stops it")


def running_slurm() -> dict:
    """The environment for sbatch (SLURM_CONF set) when a SLURM answers with a usable node;
    otherwise the test fails, saying what is missing and how to start one."""
    env = dict(os.environ)
    if "SLURM_CONF" not in env:
        local = subprocess.run(["bash", str(LOCAL_CLUSTER), "env"], capture_output=True,
                               text=True, check=True).stdout  # export SLURM_CONF=<dir>/slurm.conf
        conf = local.strip().split("=", 1)[1]
        if Path(conf).is_file():
            env["SLURM_CONF"] = conf
    missing = [tool for tool in ("sbatch", "sinfo", "scontrol") if not shutil.which(tool)]
    if missing:
        pytest.fail(f"SLURM is not installed ({', '.join(missing)} not on PATH): {HOW_TO_START}",
                    pytrace=False)
    try:
        info = subprocess.run(["sinfo", "-h", "-o", "%T"], env=env, capture_output=True,
                              text=True, timeout=30)
    except subprocess.TimeoutExpired:
        pytest.fail(f"SLURM is not running (sinfo got no answer in 30 s): {HOW_TO_START}",
                    pytrace=False)
    states = info.stdout.split()
    if info.returncode != 0 or not any(re.match(r"(idle|mixed|allocated)", s) for s in states):
        said = " ".join((info.stdout + info.stderr).split())[:300]
        pytest.fail(f"SLURM is not running (SLURM_CONF={env.get('SLURM_CONF', '(default)')}; "
                    f"sinfo said: {said or 'nothing'}): {HOW_TO_START}", pytrace=False)
    return env


@pytest.mark.parametrize("script", ["train_cpu.sbatch", "train_gpu.sbatch", "local_cluster.sh",
                                    "../ci_slurm.sh", "../test.sh"])
def test_scripts_are_valid_bash(script):
    subprocess.run(["bash", "-n", str(SLURM_DIR / script)], check=True)


def _gpu_dry_run(env_overrides: dict) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "NCCL_"))}
    env.update(DRY_RUN="1", REPO=str(REPO), **env_overrides)
    return subprocess.run(["bash", str(GPU_JOB)], env=env, capture_output=True, text=True,
                          check=True, timeout=60).stdout


def _gpu_launch(env_overrides: dict) -> list[str]:
    return shlex.split(_gpu_dry_run(env_overrides).split("LAUNCH:", 1)[1])


def test_gpu_job_for_two_nodes_sets_the_timeouts_and_leaves_nccl_to_the_site(monkeypatch):
    """The 2-node render: the process groups' timeout goes to Megatron
    (--distributed-timeout-minutes, through its own parser) and no wait of the script's own, so
    the plugin derives its waits from that timeout; a user's P2P_TIMEOUT_S is passed on; the
    site's NCCL_* variables are passed through untouched, none set."""
    import megatron.training.arguments as megatron_arguments

    from megatron_pp_ext.integration.megatron_args import (
        add_pipeline_schedule_args,
        schedule_options_from_args,
    )

    site = dict(NCCL_SOCKET_IFNAME="ib0", NCCL_IB_HCA="mlx5_0,mlx5_1")
    for extra, wait in ((dict(PG_TIMEOUT_MIN="20"), None), (dict(P2P_TIMEOUT_S="200"), 200.0)):
        text = _gpu_dry_run(dict(SLURM_NNODES="2", GPUS_PER_NODE="8", **site, **extra))
        launch = shlex.split(text.split("LAUNCH:", 1)[1])
        assert "torchrun --nnodes 2 --nproc-per-node 8" in " ".join(launch)
        assert not any(arg.startswith("NCCL_") for arg in launch)  # nothing of its own
        assert "nccl (the site's, passed to every node): NCCL_IB_HCA=mlx5_0,mlx5_1 " \
               "NCCL_SOCKET_IFNAME=ib0" in text
        minutes = int(extra.get("PG_TIMEOUT_MIN", "10"))
        said = "derived from them" if wait is None else f"{wait:g} s"
        assert f"timeouts: process groups {minutes * 60} s (--distributed-timeout-minutes " \
               f"{minutes}), the plugin's waits on a peer: {said}" in text
        script = launch.index(str(REPO / "scripts" / "pretrain_gpt_pp.py"))
        monkeypatch.setattr(sys, "argv", launch[script:])
        args = megatron_arguments.parse_args(extra_args_provider=add_pipeline_schedule_args)
        assert args.distributed_timeout_minutes == minutes
        assert schedule_options_from_args(args)["p2p_timeout_s"] == wait


def test_gpu_job_refuses_a_wait_the_nccl_watchdog_would_cut_short():
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(DRY_RUN="1", SLURM_NNODES="2", GPUS_PER_NODE="8", P2P_TIMEOUT_S="600")
    proc = subprocess.run(["bash", str(GPU_JOB)], env=env, capture_output=True, text=True)
    assert proc.returncode == 1 and "LAUNCH:" not in proc.stdout
    assert "P2P_TIMEOUT_S=600 is above 0.45 x the process groups' timeout (600 s" in proc.stderr


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


def test_gpu_job_verify_mode_launches_verify_on_the_same_job():
    """VERIFY=1: one torchrun per node runs ``-m megatron_pp_ext verify`` on the job's
    arguments (the model, the data, the parallel sizes, the timeouts), which verify turns into
    Megatron's 1F1B and the schedule's run: planned here as the ranks will (16 GPUs, dp 2)."""
    from megatron_pp_ext.cli import build_parser
    from megatron_pp_ext.verify.runs import plan_verify
    from megatron_pp_ext.verify.settings import settings_from_namespace

    launch = _gpu_launch(dict(SLURM_NNODES="2", GPUS_PER_NODE="8", SCHEDULE="zb-v", VERIFY="1",
                              VERIFY_LAYERS="8", P2P_TIMEOUT_S="200"))
    at = launch.index("verify")
    assert launch[at - 2:at] == ["-m", "megatron_pp_ext"]
    assert "torchrun --nnodes 2 --nproc-per-node 8" in " ".join(launch[:at])
    args = build_parser().parse_args(launch[at:])
    args.job = args.job[1:]  # the "--"
    plan = plan_verify(settings_from_namespace(args), launched_world=16)
    reference, candidate = (list(run.argv) for run in plan.runs)
    assert (plan.world_size, args.steps, args.num_layers, args.p2p_timeout_s) == (16, 5, 8, 200)
    assert "--pipeline-schedule" not in reference
    assert "--num-virtual-stages-per-pipeline-rank" not in reference
    assert candidate[candidate.index("--pipeline-schedule") + 1] == "zb-v"
    assert candidate[candidate.index("--num-virtual-stages-per-pipeline-rank") + 1] == "2"
    assert candidate[candidate.index("--pp-p2p-timeout-s") + 1] == "200"
    for argv in (reference, candidate):
        assert argv[argv.index("--distributed-timeout-minutes") + 1] == "10"
        assert argv[argv.index("--num-layers") + 1] == "8"


def test_gpu_job_refuses_sizes_that_do_not_divide():
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(DRY_RUN="1", SLURM_NNODES="1", GPUS_PER_NODE="8", TP="3", PP="4")
    proc = subprocess.run(["bash", str(GPU_JOB)], env=env, capture_output=True, text=True)
    assert proc.returncode == 1 and "must divide" in proc.stderr


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


def _submit(tmp_path, script, env_overrides, *sbatch_args) -> tuple[str, Path, dict]:
    """Submit ``script`` to the running SLURM: (job id, its output file, the environment)."""
    output = tmp_path / "job-%j.out"
    env = dict(running_slurm(), REPO=str(REPO), **env_overrides)
    proc = subprocess.run(
        ["sbatch", "--parsable", f"--output={output}", f"--chdir={tmp_path}", *sbatch_args,
         str(script)], env=env, capture_output=True, text=True, timeout=60)
    job_id = proc.stdout.strip().split(";")[0]
    assert proc.returncode == 0 and job_id.isdigit(), f"sbatch said: {proc.stdout!r} {proc.stderr!r}"
    return job_id, tmp_path / f"job-{job_id}.out", env


def _sbatch(tmp_path, script, env_overrides, *sbatch_args):
    """Submit ``script`` to the running SLURM and follow the job to its end; returns (its exit
    status, its output). ``sbatch --wait`` would do the same but polls at 2, 8, then 32 s:
    a 12 s job took 42 s. Here SLURM's own record of the job (``scontrol show job``) is read
    every 0.2 s until it says the job ended."""
    job_id, output, env = _submit(tmp_path, script, env_overrides, *sbatch_args)
    status, _ = _wait_for_job(job_id, env)
    return status, output.read_text()


#: JobState values of a job that has ended (SLURM's job_state_string)
_ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "BOOT_FAIL",
          "DEADLINE", "OUT_OF_MEMORY"}


def _job_fields(job_id: str, env: dict) -> dict:
    shown = subprocess.run(["scontrol", "show", "job", "-o", job_id], env=env,
                           capture_output=True, text=True, timeout=30).stdout
    return dict(f.split("=", 1) for f in shown.split() if "=" in f)


def _wait_for_job(job_id: str, env: dict) -> tuple[int, str]:
    """(the job's exit status, its final JobState) once SLURM records it ended (``ExitCode=N:S``:
    N, or 128 + S when a signal ended it); fails after ``SBATCH_TIMEOUT_S`` naming the job's
    last state."""
    deadline = time.monotonic() + SBATCH_TIMEOUT_S
    state = "unknown"
    while time.monotonic() < deadline:
        fields = _job_fields(job_id, env)
        state = fields.get("JobState", state)
        if state in _ENDED:
            code, _, signal = fields.get("ExitCode", "0:0").partition(":")
            return int(code) or (128 + int(signal or 0) if int(signal or 0) else 0), state
        time.sleep(0.2)
    pytest.fail(f"job {job_id} did not end within {SBATCH_TIMEOUT_S} s (last state {state})")


def _nodes() -> list[str]:
    """The running SLURM's node names, in its order."""
    listed = subprocess.run(["sinfo", "-h", "-N", "-o", "%N"], env=running_slurm(),
                            capture_output=True, text=True, timeout=30).stdout.split()
    return list(dict.fromkeys(listed))


#: one task a node across two nodes (2 fresh ranks, each importing torch and Megatron: the
#: slow part of a job here); the node-lost test puts 2 tasks on each node. m=1 < p: train's
#: hint, printed once by rank 0 of the two srun tasks (the node-lost test runs m=32)
CPU_RUN = dict(SCHEDULE="1f1b", PP="2", M="1", STEPS="2")


@pytest.fixture(scope="module")
def one_node_job(tmp_path_factory):
    """The CPU job on one node: (exit status, output, summary)."""
    tmp_path = tmp_path_factory.mktemp("one-node")
    out = tmp_path / "out"
    status, text = _sbatch(tmp_path, CPU_JOB, dict(CPU_RUN, OUT=str(out)))
    assert status == 0, text[-4000:]
    return text, json.loads((out / "summary.json").read_text())


def test_train_cpu_job(one_node_job):
    """The CPU job's default command, ``python -m megatron_pp_ext train``, under SLURM."""
    text, summary = one_node_job
    assert "schedule=1f1b pp=2 microbatches=1 steps=2" in text
    assert "-m megatron_pp_ext train --schedule 1f1b --pp 2 --microbatches 1 --steps 2" in text
    assert "train_cpu: exit 0" in text
    assert (summary["schedule"], summary["pp"], summary["microbatches"]) == ("1f1b", 2, 1)
    assert summary["launcher"] == "local"  # one task: train started the ranks on the node
    assert len(summary["losses"]) == 2
    printed = re.findall(r"^step (\d)/2  loss +(\d+\.\d{4}) ", text, re.M)
    assert printed == [("1", f"{summary['losses'][0]:.4f}"), ("2", f"{summary['losses'][1]:.4f}")]


def _two_nodes() -> list[str]:
    nodes = _nodes()
    if len(nodes) < 2:
        pytest.fail(f"this SLURM has {len(nodes)} node(s) ({nodes}): the test needs 2; start "
                    "`bash scripts/slurm/local_cluster.sh start --nodes 2` (scripts/test.sh "
                    "does)", pytrace=False)
    return nodes[:2]


def test_train_cpu_job_across_two_nodes(tmp_path, one_node_job):
    """``sbatch --nodes=2``: 2 srun tasks, 1 a node, so ranks 0 and 1 (pipeline neighbours) are
    on different hosts (on the local cluster: network namespaces with their own addresses);
    torch's rendezvous on the first node, gloo across: the same losses as on one node. Each
    task imports Megatron itself: its warnings stay out of the job's output, and p=2 > m=1 is
    hinted once, by rank 0. (Two tasks a node: the node-lost test, and Megatron-LM's loop
    across two nodes.)"""
    nodes = _two_nodes()
    out = tmp_path / "out"
    status, text = _sbatch(tmp_path, CPU_JOB, dict(CPU_RUN, OUT=str(out)),
                           f"--nodelist={nodes[0]},{nodes[1]}", "--nodes=2")
    assert status == 0, text[-4000:]
    placed = re.findall(r"^rank (\d) on node (\S+)$", text, re.M)
    assert placed == [("0", nodes[0]), ("1", nodes[1])], text
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["launcher"], summary["pp"], summary["microbatches"]) == ("srun", 2, 1)
    assert summary["losses"] == one_node_job[1]["losses"]
    assert "gloo via srun" in text
    assert [line for line in text.splitlines() if line.startswith("hint:")] == [P_OVER_M_HINT]
    assert_no_megatron_warnings(text)


def test_a_failing_job_reports_its_exit_status(tmp_path):
    status, text = _sbatch(tmp_path, CPU_JOB, dict(TRAIN_CMD="echo about to fail; exit 7",
                                                   OUT=str(tmp_path / "out")))
    assert status == 7
    assert "about to fail" in text and "train_cpu: exit 7" in text


def test_gpu_job_script_under_slurm_finds_master(tmp_path):
    """train_gpu.sbatch inside a real (GPU-less) allocation, dry run: MASTER_ADDR is the first
    node that ``scontrol show hostnames`` lists."""
    node = _nodes()[0]
    status, text = _sbatch(tmp_path, GPU_JOB, dict(DRY_RUN="1", GPUS_PER_NODE="8"),
                           "--gpus-per-node=0", "--nodes=1", f"--nodelist={node}",
                           "--no-requeue")
    assert status == 0, text
    assert f"--rdzv-endpoint {node}:29500" in text
    assert "--nnodes 1 --nproc-per-node 8" in text


# ------------------------------------------------------------------ a node lost (issue 27)
LOST_P2P_TIMEOUT_S = 3
#: how long a survivor takes to report once a node is cut off: rank 1 times out on rank 2
#: (--p2p-timeout-s), then gives rank 2 one more timeout and the store's 2 s to send a note
#: (agreement._explain: it cannot tell a dead peer from one that waited on another), and
#: reads the notes and hosts (2 store calls of at most 2 s); measured: 9 s at 3 s
SURVIVOR_REPORT_S = 2 * LOST_P2P_TIMEOUT_S + 2 + 2 * 2
#: how long before the soonest SLURM may declare the lost node down the survivors' latest
#: report must come: both are made of timers (the plugin's timeouts and the store's; SLURM's
#: SlurmdTimeout, ping rounds and request timeouts), so a loaded machine delays both alike
REPORT_MARGIN_S = 4
#: what _slurm_config reads
SLURM_TIMES = ("SlurmdTimeout", "AcctGatherNodeFreq", "MessageTimeout", "TCPTimeout")


def _slurm_config(env: dict) -> dict[str, int]:
    """SLURM_TIMES in seconds, as the running controller has them (``scontrol show config``)."""
    shown = subprocess.run(["scontrol", "show", "config"], env=env, capture_output=True,
                           text=True, timeout=30).stdout
    config = {}
    for name in SLURM_TIMES:
        found = re.search(rf"^{name}\s*=\s*(\d+)", shown, re.M)
        assert found, f"no {name} in `scontrol show config`: {shown[-2000:]}"
        config[name] = int(found.group(1))
    return config


def _earliest_node_down_s(config: dict[str, int]) -> float:
    """The soonest SLURM may declare a node down once it is cut off. slurmctld's ping round
    (every SlurmdTimeout / 3) declares a node down once the round before it found the node
    silent for SlurmdTimeout: SlurmdTimeout + one round after the node's last answer, less 1 s
    (times in whole seconds). That answer is at most AcctGatherNodeFreq + 1 s old at the cut
    (slurmctld asks every responding node that often, in its once-a-second loop: 2 s in
    local_cluster.sh), else up to two rounds (a round asks only a node silent for a round)."""
    timeout = config["SlurmdTimeout"]
    round_s = timeout // 3
    heard_every = config["AcctGatherNodeFreq"]
    last_answer_age = heard_every + 1 if 0 < heard_every < round_s else 2 * round_s
    return timeout + round_s - last_answer_age - 1


def _node_loss_bound_s(config: dict[str, int]) -> float:
    """How long SLURM may take to end the job once a node is cut off: SlurmdTimeout and up to 3
    rounds, each of them (from the first request to the lost node on) held off until that
    request gives up (MessageTimeout + TCPTimeout, + 2 s of slurmctld's loop); doubled for a
    loaded machine (measured: 24-26 s at SlurmdTimeout 15, MessageTimeout 5; docs/slurm.md)."""
    round_s = max(config["SlurmdTimeout"] // 3,
                  config["MessageTimeout"] + config["TCPTimeout"] + 2)
    return 2 * (config["SlurmdTimeout"] + 3 * round_s)


def _in_namespace(node: str) -> list[str]:
    """The command lines of the train ranks still running in ``node``'s network namespace."""
    pids = subprocess.run(["ip", "netns", "pids", node], capture_output=True, text=True,
                          timeout=30).stdout.split()
    lines = []
    for pid in pids:
        try:
            line = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if "megatron_pp_ext train" in line:
            lines.append(line)
    return lines


def _restore(node: str, env: dict) -> None:
    """The node's link up again and SLURM told it is back (an admin's `scontrol update
    State=RESUME`), until it is idle: the later tests get both nodes."""
    subprocess.run(["ip", "-n", node, "link", "set", "eth0", "up"], check=True, timeout=30)
    subprocess.run(["scontrol", "update", f"NodeName={node}", "State=RESUME"], env=env,
                   capture_output=True, timeout=30)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        state = subprocess.run(["sinfo", "-h", "-N", "-n", node, "-o", "%T"], env=env,
                               capture_output=True, text=True, timeout=30).stdout.strip()
        if state.startswith("idle"):
            return
        time.sleep(0.2)
    pytest.fail(f"node {node} is {state!r} 60 s after its link came back")


def test_a_node_lost_mid_run_ends_the_job_and_every_survivor_names_it(tmp_path):
    """4 ranks on 2 nodes; once step 1 is printed, the second node's link is cut (its
    namespace's eth0 down: every packet to and from it lost, as when a host dies). Ranks 0 and
    1 (first node) raise the plugin's PipelineTimeoutError within its timeout, each naming
    what it waited for and rank 2 on the lost host as the suspect; srun ends the step, and
    after that SLURM declares the node down and ends the job NODE_FAIL within
    _node_loss_bound_s; nothing of the job is left running on either node."""
    nodes = _two_nodes()
    lost = nodes[1]
    config = _slurm_config(running_slurm())
    # SLURM ends the job (and the survivors with it) once it declares the node down: the
    # survivors' reports must come first whatever the timing, or there is nothing to check.
    # Here (local_cluster.sh) they take at most 12 s and SLURM at least 16 s (in practice
    # 24-26 s: each round first waits for its request to the lost node to give up)
    earliest_down_s = _earliest_node_down_s(config)
    assert SURVIVOR_REPORT_S + REPORT_MARGIN_S <= earliest_down_s, (
        f"SLURM ({', '.join(f'{k}={v} s' for k, v in config.items())}) may declare the node "
        f"down {earliest_down_s:.0f} s after the cut, less than {REPORT_MARGIN_S} s after the "
        f"survivors report (up to {SURVIVOR_REPORT_S} s at --p2p-timeout-s "
        f"{LOST_P2P_TIMEOUT_S}): raise SlurmdTimeout in local_cluster.sh or lower "
        "LOST_P2P_TIMEOUT_S")
    if lost not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                                  timeout=30).stdout:
        pytest.fail(f"node {lost} is not a network namespace of this machine: the test cuts "
                    "a local_cluster.sh node's link (start --nodes 2)", pytrace=False)
    # m=32: a step is mostly the pipeline's point-to-point (1.6 s here), so the cut, made as
    # soon as the test sees step 1's line, lands where --p2p-timeout-s bounds every wait. Cut
    # during the collectives between steps (Megatron's optimizer, the train loop's loss and
    # measurement gathers), a survivor waits for the process group's timeout instead and
    # SLURM ends the job first, with no survivor's report (seen once at m=8 on a loaded machine)
    job_id, output, env = _submit(
        tmp_path, CPU_JOB, dict(CPU_RUN, PP="4", M="32", STEPS="40", OUT=str(tmp_path / "out"),
                                TRAIN_ARGS=f"--p2p-timeout-s {LOST_P2P_TIMEOUT_S}"),
        f"--nodelist={nodes[0]},{lost}", "--nodes=2", "--no-requeue")
    deadline = time.monotonic() + SBATCH_TIMEOUT_S
    while not (output.exists() and re.search(r"step +1/40", output.read_text())):
        assert _job_fields(job_id, env).get("JobState") in ("PENDING", "RUNNING"), \
            output.read_text()[-3000:] if output.exists() else "no output"
        assert time.monotonic() < deadline, "step 1 never came"
        time.sleep(0.2)
    cut = time.monotonic()
    subprocess.run(["ip", "-n", lost, "link", "set", "eth0", "down"], check=True, timeout=30)
    try:
        status, state = _wait_for_job(job_id, env)
        ended_after_s = time.monotonic() - cut
    finally:
        _restore(lost, env)
    text = output.read_text().replace("\r", "\n")
    assert (state, status) == ("NODE_FAIL", 143), text[-3000:]  # ExitCode 0:15 (SIGTERM)
    assert ended_after_s < _node_loss_bound_s(config), ended_after_s
    # in that order: srun ended the survivors' step (--kill-on-bad-exit, once rank 1 had
    # reported and exited), then SLURM the job, for the node's failure (the first node's
    # slurmstepd says when, to the second)
    step_ended = re.search(rf"\*\*\* STEP {job_id}\.\d+ ON {nodes[0]} CANCELLED AT (\S+) \*\*\*",
                           text)
    job_ended = re.search(rf"\*\*\* JOB {job_id} ON {nodes[0]} CANCELLED AT (\S+) DUE TO NODE "
                          "FAILURE", text)
    assert step_ended and job_ended, text[-3000:]
    assert step_ended.group(1) < job_ended.group(1), (step_ended.group(0), job_ended.group(0))
    # rank 0 waits on rank 1: it times out too, or (a moment earlier) sees the connection
    # that rank 1's timed-out gloo wait closes; either way the plugin's error (PeerLostError
    # is a PipelineTimeoutError) with rank 1's report
    errors = dict(re.findall(r"^\[rank(\d)\]: megatron_pp_ext\.runtime\.(?:errors\."
                             r"PipelineTimeoutError|executor\.PeerLostError): (.*)$", text, re.M))
    # global rank 0 serves the store and waits for its peers' explanations; srun may stop it
    # there once rank 1 exits (--kill-on-bad-exit), before its traceback prints: it logged the
    # same error before waiting
    errors.update({rank: message for rank, message in re.findall(
        r"megatron-pp-ext: global rank (0) failed: (?:PipelineTimeoutError|PeerLostError): "
        r"(.*) \(it serves the job's rendezvous store", text) if rank not in errors})
    # the lost node's ranks (2, 3) time out too; whether their reports reach the output
    # depends on whether srun still relays them once the link is restored (seen both ways), so
    # only the survivors' are read
    errors = {rank: message for rank, message in errors.items() if rank in ("0", "1")}
    assert sorted(errors) == ["0", "1"], text[-4000:]
    # it gave up once its timeout had passed (by how much more depends on the machine's load)
    waited = re.match(r"pipeline rank 1 waited (\d+\.\d) s for rank 2 and gave up: pending 1",
                      errors["1"])
    assert waited and float(waited.group(1)) >= LOST_P2P_TIMEOUT_S, errors["1"]
    assert errors["0"].startswith("pipeline rank 0 "), errors["0"]
    for rank, message in errors.items():
        assert "from rank" in message  # the pending action names what it waited for
        assert "Suspected to have failed first: rank(s) [2]" in message, message
        assert f"rank 2 on host {lost}" in message, message
        assert f"rank {rank} (this one) on host {nodes[0]}." in message, message
    for node in nodes:  # the lost node's ranks stop on their own timeout
        deadline = time.monotonic() + 60
        while _in_namespace(node) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _in_namespace(node) == [], node


# ------------------------------------- Megatron-LM's loop across nodes, killed, resumed
LOOP_ITERS = 5
LOOP_KILLED_AT = 3  # train_step(iteration=3): step 2 ran after the checkpoint at 2, lost


def _loop_job(tmp_path, nodes, name, argv, *rank_args):
    """Megatron-LM's loop as 4 srun tasks on ``nodes`` (2 each, block order), through the CPU
    job script (TRAIN_CMD: support/pretrain_rank.py); (exit status, output, per-rank histories
    as each rank last recorded them)."""
    records = tmp_path / name
    command = shlex.join([sys.executable, str(REPO / "tests" / "support" / "pretrain_rank.py"),
                          str(records), *rank_args, "--", *argv])
    status, text = _sbatch(tmp_path, CPU_JOB, dict(NTASKS="4", TRAIN_CMD=command,
                                                   OUT=str(tmp_path / "out")),
                           f"--nodelist={nodes[0]},{nodes[1]}", "--nodes=2", "--no-requeue")
    histories = {int(p.stem.rsplit("rank", 1)[1]): json.loads(p.read_text())
                 for p in records.glob("history-rank*.json")}
    return status, text, histories


def test_megatron_loop_zb_v_across_two_nodes_killed_and_resumed(tmp_path):
    """Megatron-LM's loop (support.megatron_loop: pretrain_gpt.py's, on the CPU) with
    ``--pipeline-schedule zb-v``, pp=2 x dp=2 as 4 srun tasks on 2 nodes: Megatron puts
    pipeline ranks 0 and 2 (and 1 and 3) in one pipeline, so every pipeline spans both hosts.
    The job saves a checkpoint every 2 iterations and is killed at iteration 3 (every rank
    SIGKILLs itself). Its steps have the losses and grad norms of the same run on one node (4
    local processes on this machine, uninterrupted), bit for bit; the same command with
    ``--load``, started again (on this node: a checkpoint does not depend on where its ranks
    ran), runs iterations 2..4 with that run's losses and grad norms too. The checkpoint also
    loads into Megatron's own 1F1B (the loop layout), weights only."""
    from megatron_pp_ext.train.processes import spawn
    from support.megatron_loop import (
        merge_history,
        pretrain_argv,
        run_pretrain,
        run_pretrain_shared,
    )

    nodes = _two_nodes()
    checkpoints = tmp_path / "ck"
    argv = pretrain_argv(pp=2, dp=2, schedule="zb-v", vp=2, iters=LOOP_ITERS)
    status, text, killed = _loop_job(
        tmp_path, nodes, "killed", argv + ["--save", str(checkpoints), "--save-interval", "2"],
        "--kill-at-iteration", str(LOOP_KILLED_AT))
    assert status == 137 and "train_cpu: exit 137" in text, text[-3000:]  # SIGKILL
    placed = re.findall(r"^rank (\d) on node (\S+)$", text, re.M)
    assert placed == [("0", nodes[0]), ("1", nodes[0]), ("2", nodes[1]), ("3", nodes[1])], text
    assert (checkpoints / "latest_checkpointed_iteration.txt").read_text().strip() == "2"

    one_node = merge_history(run_pretrain_shared(4, argv, 300))
    assert one_node["schedule"] == "ScheduleFunction('zb-v')"
    resumed = merge_history(spawn(4, run_pretrain, argv + ["--load", str(checkpoints)],
                                  timeout_s=300))
    assert resumed["iteration"] == [2, 3, 4] and resumed["schedule"] == one_node["schedule"]
    assert resumed["lm loss"] == one_node["lm loss"][2:]
    assert resumed["grad_norm"] == one_node["grad_norm"][2:]
    # the killed job: each rank's steps as far as it recorded them (all ran step 2)
    for rank, history in killed.items():
        done = len(history["iteration"])
        assert history["iteration"] == [0, 1, 2][:done] and done >= 2, (rank, history)
        assert history["grad_norm"] == one_node["grad_norm"][:done]
        if rank in (2, 3):
            assert history["lm loss"] == one_node["lm loss"][:done]
    assert any(len(h["iteration"]) == 3 for h in killed.values())
    # The V chunks saved their layers under their global numbers: Megatron's own 1F1B (the
    # loop layout: other stages on each rank) loads the weights and its first step is the
    # V run's. (Not the optimizer state: its default format, per-rank buckets, refuses
    # another layout with "Global shape mismatch"; docs/megatron-lm.md.)
    loop = merge_history(spawn(4, run_pretrain, pretrain_argv(
        pp=2, dp=2, iters=3, extra=["--load", str(checkpoints), "--no-load-optim"]),
        timeout_s=300))
    assert loop["iteration"] == [2] and loop["lm loss"] == one_node["lm loss"][2:3]
    assert loop["grad_norm"][0] == pytest.approx(one_node["grad_norm"][2], rel=1e-6)
