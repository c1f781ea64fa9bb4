"""Every benchmark in one command; writes bench/results/{results.md, results.json, results.png}.

    .venv/bin/python bench/run_all.py              # full: p=4, 8; m=8, 16, 32
    .venv/bin/python bench/run_all.py --quick      # p=4; m=8, 16; fewer repeats
    .venv/bin/python bench/run_all.py --only a     # one part; the others' rows stay as they were

(a) emulated device (sleeping stages, real Executor over gloo; Megatron's own schedules on a
    fake Megatron model; torch.distributed.pipelining's on the same device), calibrated on one
    run and judged on another, (b) the tiny real GPTModel: plugin 1f1b vs Megatron's 1F1B
    over several fresh runs, (c) executor overhead per action, (d) validator and simulator at
    p=64, m=512, (e) every schedule over the in-memory NCCL-rules fabric against the
    simulator's NCCL model, (f) the tiny GPT's activation memory in bytes at p=4, m=8 for
    every schedule, measured beside the simulator's count in bytes calibrated by a separate run.
Every figure is a median with its min-max over the repeated runs; every ratio is taken between
runs of the same process tree, round by round. Every part records the commit, UTC time and
command that produced it. See bench/README.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # `bench.*` for the spawned ranks (forkserver keeps sys.path)

from bench import (  # noqa: E402
    bench_analysis,
    calibration,
    emulated_device,
    executor_overhead,
    memory_bytes,
    nccl_fabric,
    provenance,
    real_gpt,
    report,
)

T = 0.020  # t_F = t_I = t_W per rank, seconds
FORMAT = 2  # results.json with one provenance per part


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="p=4; m=8, 16; fewer repeats and (b) runs")
    parser.add_argument("--ps", type=int, nargs="+", help="(a) pipeline sizes (default 4 8; "
                        "--quick: 4)")
    parser.add_argument("--ms", type=int, nargs="+", help="(a) microbatch counts (default 8 16 "
                        "32; --quick: 8 16)")
    parser.add_argument("--calibrate-m", type=int,
                        help="(a) the m whose 1F1B run calibrates (default: the smallest)")
    parser.add_argument("--reps", type=int, help="(a) rounds per judged configuration "
                        "(default 3)")
    parser.add_argument("--gpt-runs", type=int, help="(b) fresh process trees (default 5; "
                        "--quick: 3)")
    parser.add_argument("--only", default="abcdef", help="which parts to run, e.g. 'ab'")
    parser.add_argument("--niceness", type=int, default=-20,
                        help="renice the emulated-device ranks (sleep-bound; 0: leave alone)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    parser.add_argument("--render", action="store_true",
                        help="rewrite results.md (and the plot) from results.json, measuring "
                        "nothing")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    results = previous_results(args.out)
    if args.render:
        print(write(results, args.out).splitlines()[-1])
        return 0
    parts = {"a": ("emulated", run_emulated), "b": ("real_gpt", run_real_gpt),
             "c": ("overhead", run_overhead), "d": ("analysis", run_analysis),
             "e": ("nccl_fabric", run_nccl_fabric), "f": ("memory_bytes", run_memory_bytes)}
    for letter, (key, runner) in parts.items():
        if letter in args.only:
            # taken per part: the tree may change under a long run (others edit it too)
            prov, started = provenance.current(argv), time.perf_counter()
            section = runner(args)
            section["provenance"] = provenance.finish(prov, started)
            results["sections"][key] = section
            print(f"    {time.perf_counter() - started:.0f} s", flush=True)
    print(write(results, args.out))
    return 0


def previous_results(out: Path) -> dict:
    """The results file to update: parts not rerun keep their rows and provenance. A file
    of the older format (one header for everything) is not merged: its header cannot say
    which run made which part."""
    path = out / "results.json"
    if path.exists():
        old = json.loads(path.read_text())
        if old.get("format") == FORMAT:
            return old
        print(f"{path}: older format without per-part provenance; starting afresh")
    return {"format": FORMAT, "t": T, "sections": {}}


def write(results: dict, out: Path) -> str:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    markdown = report.render(results)
    (out / "results.md").write_text(markdown)
    if "emulated" in results["sections"]:
        report.plot(results["sections"]["emulated"], out / "results.png")
    return markdown + f"\nwrote {out}/results.md, results.json" + (
        ", results.png" if "emulated" in results["sections"] else "")


# ------------------------------------------------------------------ the parts
def run_emulated(args) -> dict:
    """Calibration trees first, then a fresh judged tree per p (every schedule, every m),
    predicted with the calibration's numbers. A calibration tree runs what a judged tree runs
    at the calibration m (the same processes, process groups and rotation, so the same load
    on the machine), but only its 1F1B steps and ping-pongs are kept and used."""
    ps = args.ps or ((4,) if args.quick else (4, 8))
    ms = tuple(args.ms or ((8, 16) if args.quick else (8, 16, 32)))
    cal_m = args.calibrate_m or min(ms)
    reps, k_steps = args.reps or 3, 4
    cals = {}
    for p in ps:
        print(f"(a) calibration run p={p} m={cal_m} (1f1b kept) ...", flush=True)
        tree = emulated_device.run(p, (cal_m,), t=T, reps=reps, niceness=args.niceness)
        cals[p] = calibration.calibrate(tree, cal_m)
    trees = []
    for p in ps:
        print(f"(a) judged run p={p} m={ms} ...", flush=True)
        tree = emulated_device.run(p, ms, t=T, reps=reps, back_to_back_ms=(min(ms),),
                                   k_steps=k_steps, b2b_reps=3, niceness=args.niceness)
        calibration.apply(tree, cals[p], k_steps)
        trees.append(tree)
    return {"ps": list(ps), "ms": list(ms), "calibrate_m": cal_m, "reps": reps,
            "k_steps": k_steps, "calibration": list(cals.values()), "trees": trees}


def run_real_gpt(args) -> dict:
    print("(b) tiny GPTModel, plugin 1f1b vs Megatron 1F1B ...", flush=True)
    runs = args.gpt_runs or (3 if args.quick else 5)
    steps = 10 if args.quick else 30
    return {"mode": "quick" if args.quick else "full",
            **real_gpt.run(p=4, m=8, steps=steps, runs=runs)}


def run_overhead(args) -> dict:
    print("(c) executor overhead ...", flush=True)
    return {"rows": executor_overhead.run(quick=args.quick)}


def run_analysis(args) -> dict:
    print("(d) validator and simulator at p=64, m=512 ...", flush=True)
    names = ["interleaved", "zb-v", "dualpipev"] if args.quick else None
    return {"rows": bench_analysis.measure(64, 512, repeats=3, names=names)}


def run_nccl_fabric(args) -> dict:
    """p=4: a calibration run (1F1B alone) for t_overhead, then every schedule judged."""
    p, ms, reps = 4, ((8,) if args.quick else (8, 16)), args.reps or 3
    print(f"(e) NCCL-rules fabric: calibration p={p} m={ms[0]} ...", flush=True)
    cal = nccl_fabric.calibrate(p, ms[0], T, reps=5)
    print(f"(e) NCCL-rules fabric: judged p={p} m={ms} ...", flush=True)
    return {"p": p, "ms": list(ms), "reps": reps, "calibration": cal,
            "rows": nccl_fabric.run(p, ms, T, reps, cal)}


def run_memory_bytes(args) -> dict:
    """p=4, m=8: every schedule's measured peak activation bytes per rank, beside the
    simulator's count in bytes from a separate calibration run per layout (m=p)."""
    print("(f) activation bytes of the tiny GPT, p=4, m=8 ...", flush=True)
    return memory_bytes.run(p=4, m=8, steps=2)


if __name__ == "__main__":
    sys.exit(main())
