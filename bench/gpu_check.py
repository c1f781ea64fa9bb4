"""GPU check: one short script to run whenever a GPU is at hand.

    .venv/bin/python bench/gpu_check.py                # cuda if torch sees a GPU, else cpu
    .venv/bin/python bench/gpu_check.py --quick        # p=2, 4; m=4 (NCCL part: m=4)
    .venv/bin/python bench/gpu_check.py --device cpu --quick    # the part CI runs

Three parts, then a one-screen summary; the exit code is non-zero if any check failed.
This script is the command line and the flow; each part's helpers, and what it checks, are in
a module of their own:

1. every schedule over the in-memory NCCL-rules fabric, gradients and losses against pp=1
   (``bench/gpu_fabric.py``; its timers: ``bench/gpu_timing.py``);
2. CUDA streams, CUDA only: part 1's fabric on CUDA and the control that a read needs the
   wait (``bench/gpu_streams.py``), and what an MoE F&B pair in Megatron's plan order hides of
   its all-to-alls on two streams (``bench/gpu_moe.py``: at least 80 %);
3. real NCCL where torch sees 2 or more GPUs, 2 spawned ranks (``bench/gpu_nccl.py``);
   else NOT RUN and why (never counted as a pass);
4. ``verify`` on 2 GPUs: Megatron-LM's own pretrain_gpt.py under Megatron's 1F1B and zb-h1
   (NCCL, Transformer Engine where installed), the verdict, both step times and CUDA's peak
   memory per rank (``bench/gpu_verify.py``); NOT RUN as part 3.

The summary: ``bench/gpu_summary.py``. No network; nothing is written except a temporary
folder for the NCCL ranks' results.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for _path in (str(ROOT / "tests"), str(ROOT)):  # the toy stages live with the tests' support
    if _path not in sys.path:
        sys.path.insert(0, _path)

import torch  # noqa: E402

from bench.gpu_fabric import (SCHEDULES, TOLERANCES, TWO_CHUNKS, Run, build,  # noqa: E402
                              compare, reference, run_on_fabric)
from bench.gpu_nccl import (NCCL_WORLD, NOT_RUN, NcclPart, _nccl_rank,  # noqa: E402
                            nccl_part, nccl_unavailable)
from bench.gpu_streams import (CudaStreamFabric, rank_stream, stream_check,  # noqa: E402
                               stream_part)
from bench.gpu_summary import print_summary  # noqa: E402
from bench.gpu_verify import verify_part  # noqa: E402
from bench.gpu_timing import (KINDS, ActionTimer, TimedWork, format_ms,  # noqa: E402
                              merge_ms, merge_runs_ms)

__all__ = ["ROOT", "SCHEDULES", "TWO_CHUNKS", "KINDS", "TOLERANCES", "NCCL_WORLD", "NOT_RUN",
           "build", "ActionTimer", "TimedWork", "merge_ms", "format_ms", "merge_runs_ms",
           "CudaStreamFabric", "rank_stream", "reference", "compare", "Run", "run_on_fabric",
           "stream_check", "nccl_unavailable", "_nccl_rank", "NcclPart", "nccl_part",
           "parse_args", "main"]


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cpu", "cuda"], default=None,
                        help="default: cuda if torch sees a GPU, else cpu")
    parser.add_argument("--quick", action="store_true", help="m=4 only (a short run)")
    parser.add_argument("--ps", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--ms", type=int, nargs="+", default=None, help="default 4 8")
    parser.add_argument("--rows", type=int, default=None, help="default cpu 4, cuda 64")
    parser.add_argument("--width", type=int, default=None, help="default cpu 16, cuda 512")
    parser.add_argument("--dtype", choices=["float32", "float64"], default=None,
                        help="default cpu float64, cuda float32")
    parser.add_argument("--timeout", type=float, default=60.0, help="per step, seconds")
    parser.add_argument("--sleep-cycles", type=int, default=100_000,
                        help="CUDA: GPU sleep before each fabric copy")
    parser.add_argument("--no-nccl", action="store_true", help="skip the real NCCL part")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: --device cuda, but torch sees no GPU", file=sys.stderr)
        return 2
    cuda = args.device == "cuda"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dtype = getattr(torch, args.dtype or ("float32" if cuda else "float64"))
    ms = args.ms or ([4] if args.quick else [4, 8])
    rows = args.rows or (64 if cuda else 4)
    width = args.width or (512 if cuda else 16)
    rtol, atol = TOLERANCES[dtype]
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = False
    name = torch.cuda.get_device_name(device) if cuda else "CPU"
    # `reference` looked up here at each call: a test may replace gpu_check.reference
    run_on_fabric("1f1b", 2, 2, device, dtype, rows, width, args.timeout, args.sleep_cycles,
                  reference_fn=reference)  # warm-up (CUDA context, cuBLAS, autograd), unreported
    header = (f"device {device} ({name}), {dtype}, toy stages {rows}x{width}, "
              f"rtol {rtol:g} atol {atol:g} against pp=1 on the same device")
    print(f"gpu_check: {header}", flush=True)
    started = time.perf_counter()

    print("[1] every schedule over the in-memory NCCL-rules fabric"
          + (" (CUDA streams, events)" if cuda else " (perf_counter timing)"), flush=True)
    runs = []
    for schedule in SCHEDULES:
        for p in args.ps:
            for m in ms:
                run = run_on_fabric(schedule, p, m, device, dtype, rows, width, args.timeout,
                                    args.sleep_cycles, reference_fn=reference)
                runs.append(run)
                print("  " + run.line(), flush=True)

    if cuda:
        print("[2] CUDA stream check", flush=True)
        stream_status, stream_detail = stream_part(device, dtype)
    else:
        stream_status, stream_detail = NOT_RUN, "device is cpu (no CUDA streams)"

    print("[3] real NCCL, 2 processes", flush=True)
    nccl = nccl_part(ms, rows if cuda else 64, width if cuda else 512, args.timeout,
                     args.no_nccl, reference_fn=reference)
    for run in nccl.runs:
        print("  " + run.line(), flush=True)

    print("[4] verify through pretrain_gpt.py, 2 GPUs", flush=True)
    verify = verify_part(args.no_nccl)
    ok = print_summary(header, runs, stream_status, stream_detail, nccl, cuda, started, verify)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
