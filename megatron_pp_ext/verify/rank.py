"""One rank of one ``verify`` run: Megatron-LM's own ``pretrain_gpt.py`` (the job's arguments as
``runs`` set them), recorded; the run's merged record returned on rank 0.

Called in a process of its own for each run (a local gloo process, or the child a launched rank
starts), so the reference and the candidate each begin with Megatron uninitialised and the
device's memory statistics fresh. On the CPU the patches Megatron-LM's loop needs there are
applied first (``train.megatron_lm_cpu``); on GPUs none.

    python -m megatron_pp_ext.verify.rank RUN.json OUT.json   (one rank of a launched run)
"""

from __future__ import annotations

import json
import os
import sys

import torch

from .. import device as device_helper
from ..integration.pretrain_gpt_script import run_pretrain_gpt
from ..train.megatron_lm_cpu import apply_megatron_lm_cpu_patches, prepare_cpu_environment
from ..train.quiet import hide_megatron_warnings
from .recorder import RunRecorder
from .runs import VerifyRun


def _screen_to_log(run: VerifyRun, rank: int):
    """This rank's output (Megatron's arguments, logs, warnings) into
    ``run.log_dir/<run>-rank<r>.log``; returns the screen, for the progress lines."""
    screen = os.fdopen(os.dup(1), "w", buffering=1)
    if run.log_dir is None:
        return screen
    os.makedirs(run.log_dir, exist_ok=True)
    log = open(os.path.join(run.log_dir, f"{run.name}-rank{rank}.log"), "w")
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    return screen


def _progress_to(screen):
    def progress(run: VerifyRun, step: int, record: dict) -> None:
        import torch.distributed as dist

        if dist.get_rank() != dist.get_world_size() - 1:  # the rank that holds the loss
            return
        loss = "" if record["loss"] is None else f" loss {record['loss']:.6f}"
        print(f"verify: {run.name} ({run.title}) step {step}/{run.steps}{loss} "
              f"{record['seconds'] * 1e3:.1f} ms", file=screen, flush=True)

    return progress


def run_verify_rank(rank: int, world_size: int, run: VerifyRun, device=None) -> dict | None:
    """Run ``run`` on this rank (its process group already joined); the merged record on
    rank 0, None elsewhere."""
    device = device or torch.device("cpu")
    if device.type == "cpu":
        apply_megatron_lm_cpu_patches()
        prepare_cpu_environment()
    if run.script_dir and run.script_dir not in sys.path:
        sys.path.insert(0, run.script_dir)
    sys.argv = ["pretrain_gpt.py", *run.argv]
    recorder = RunRecorder(run, device, progress=_progress_to(_screen_to_log(run, rank)))
    run_pretrain_gpt(on_args=recorder.install)
    return recorder.gather()


def run_from_json(text: str) -> VerifyRun:
    data = json.loads(text)
    return VerifyRun(**{**data, "argv": tuple(data["argv"])})


def main(argv: list[str] | None = None) -> int:
    """A launched rank's child: the run in RUN.json, the merged record (rank 0) to OUT.json."""
    import datetime

    import torch.distributed as dist

    run_path, out_path = (argv or sys.argv[1:])[:2]
    with open(run_path) as f:
        run = run_from_json(f.read())
    hide_megatron_warnings()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    backend = device_helper.launcher_backend()
    device = device_helper.bind_local_device(int(os.environ.get("LOCAL_RANK", "0")), backend)
    if backend == "gloo":  # as the train command's launched ranks: OMP_NUM_THREADS, else one
        torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=1800))
    record = run_verify_rank(rank, world, run, device)
    if record is not None:
        with open(out_path, "w") as f:
            json.dump(record, f)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
