"""Who starts the ranks.

* No launcher around the command (no ``RANK``/``WORLD_SIZE``, not a multi-task ``srun`` step):
  the command starts ``--pp`` processes on this machine itself (``train.processes.spawn``), joined by
  gloo, on the CPU (with ``train.cpu_shims``).
* ``torchrun`` (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``): one
  rank per process, ``init_process_group(init_method="env://")``.
* ``srun`` with more than one task (``SLURM_PROCID``, ``SLURM_NTASKS``/``SLURM_STEP_NUM_TASKS``,
  ``SLURM_LOCALID``): as torchrun; ``MASTER_ADDR`` is taken from the environment, else the first
  host of ``scontrol show hostnames $SLURM_JOB_NODELIST`` (127.0.0.1 on one node);
  ``MASTER_PORT`` from the environment, else derived from the job id.

Under a launcher the backend is NCCL where the process sees a GPU, else gloo with the CPU shims.
A launcher that starts a single process counts as none (e.g. ``srun --ntasks=1``). Under every
launcher Megatron-Core's warnings stay out of the output (``train.quiet``).
"""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
from dataclasses import dataclass
from typing import Mapping

from .processes import RankFunction, SpawnError, destroy, spawn, start_server
from .quiet import hide_megatron_warnings
from .settings import TrainSettings


@dataclass(frozen=True)
class Launch:
    kind: str  # "local", "torchrun" or "srun"
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    master_addr: str | None = None
    master_port: str | None = None

    def export(self) -> None:
        """Put this rank and the rendezvous into the environment, where ``env://`` (and
        Megatron's own initialisation) read them."""
        os.environ.update(RANK=str(self.rank), WORLD_SIZE=str(self.world_size),
                          LOCAL_RANK=str(self.local_rank))
        if self.master_addr:
            os.environ["MASTER_ADDR"] = self.master_addr
        if self.master_port:
            os.environ["MASTER_PORT"] = self.master_port


def detect(environ: Mapping[str, str] | None = None) -> Launch:
    env = os.environ if environ is None else environ
    if "RANK" in env and "WORLD_SIZE" in env and int(env["WORLD_SIZE"]) > 1:
        return Launch("torchrun", int(env["RANK"]), int(env["WORLD_SIZE"]),
                      int(env.get("LOCAL_RANK", "0")), env.get("MASTER_ADDR"),
                      env.get("MASTER_PORT"))
    # A batch script also carries SLURM_PROCID/SLURM_NTASKS; only an srun step has a step id.
    tasks = int(env.get("SLURM_STEP_NUM_TASKS") or env.get("SLURM_NTASKS") or "1")
    if "SLURM_PROCID" in env and "SLURM_STEP_ID" in env and tasks > 1:
        return Launch("srun", int(env["SLURM_PROCID"]), tasks, int(env.get("SLURM_LOCALID", "0")),
                      env.get("MASTER_ADDR") or slurm_master_addr(env),
                      env.get("MASTER_PORT") or slurm_master_port(env))
    return Launch("local")


def slurm_master_addr(env: Mapping[str, str]) -> str:
    """The first host of the job's node list (``scontrol show hostnames``); 127.0.0.1 on one
    node or without scontrol."""
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or ""
    if not nodelist or env.get("SLURM_NNODES", "1") == "1":
        return "127.0.0.1"
    try:
        hosts = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True,
                               text=True, timeout=30, check=True).stdout.split()
    except (OSError, subprocess.SubprocessError):
        hosts = []
    return hosts[0] if hosts else "127.0.0.1"


def slurm_master_port(env: Mapping[str, str]) -> str:
    """A port from the job id (15000-34999), so two jobs on one node do not collide."""
    job = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID") or "0"
    return str(15000 + int(job) % 20000) if job.isdigit() else "29500"


#: what each rank runs, imported there (this process, the command's, never imports torch)
TRAIN_RANK = RankFunction("megatron_pp_ext.train.loop", "train_rank")
ASYNC_TRAIN_RANK = RankFunction("megatron_pp_ext.train.async_loop", "async_train_rank")


def run(settings: TrainSettings) -> int:
    """Train under whatever launched us; returns the exit status. The asynchronous schedules
    (pipedream, pipedream-2bw: not Megatron's forward_backward_func) run one pipeline over
    gloo under every launcher."""
    # Before anything imports Megatron: here (torchrun / srun: this process is a rank) and in
    # the processes started from here (the local launcher's forkserver imports Megatron).
    hide_megatron_warnings()
    launch = detect()
    target = ASYNC_TRAIN_RANK if settings.is_async else TRAIN_RANK
    if launch.kind == "local":
        return run_local(settings, target)
    try:
        settings.check_world(launch.world_size)
    except ValueError:
        if launch.rank == 0:
            raise  # one 'error:' line from rank 0; the other ranks exit 2 quietly
        return 2
    return run_launched(settings, launch, target, backend="gloo" if settings.is_async else None)


def start_local_server() -> None:
    """For a local launch, before this process imports torch: Megatron's warnings hidden for
    the processes started from here, and their forkserver importing Megatron meanwhile."""
    hide_megatron_warnings()
    start_server()


def run_local(settings: TrainSettings, target=TRAIN_RANK) -> int:
    """``settings.pp`` gloo processes on this machine, each running ``target``."""
    start_local_server()  # (a no-op when started already)
    print(f"starting {settings.pp} gloo processes on this machine's CPUs (each imports torch "
          "and Megatron-Core first: a few seconds)", flush=True)
    for attempt in range(3):
        try:
            spawn(settings.pp, target, settings, timeout_s=settings.run_timeout_s)
            return 0
        except SpawnError as exc:
            # The free port spawn picked was taken before rank 0 listened on it: try another.
            if "EADDRINUSE" in str(exc) and attempt < 2:
                continue
            print(f"error: training failed: {exc}", file=sys.stderr)
            return 1
    return 1


def run_launched(settings: TrainSettings, launch: Launch, target, backend: str | None = None) -> int:
    """Run ``target(rank, world_size, settings, launcher=...)`` in this process, one rank of a
    torchrun / srun launch: the process group from the launcher's environment, destroyed after.
    ``backend`` None: the device's (NCCL on GPUs, bound to the local rank's GPU and passed to
    ``target`` as ``device``; else gloo with OMP_NUM_THREADS intra-op threads); a backend
    given (the asynchronous path's gloo) is used as it is."""
    import torch.distributed as dist

    from .. import device as device_helper

    launch.export()
    extra = {}
    if backend is None:
        backend = device_helper.launcher_backend()
        extra["device"] = device_helper.bind_local_device(launch.local_rank, backend)
        if backend == "gloo":
            import torch

            torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    dist.init_process_group(backend, init_method="env://", rank=launch.rank,
                            world_size=launch.world_size,
                            timeout=datetime.timedelta(seconds=settings.run_timeout_s))
    try:
        target(launch.rank, launch.world_size, settings, launcher=launch.kind, **extra)
    finally:
        destroy()
        dist.destroy_process_group()
    return 0
