"""Bench (f): activation memory in bytes, measured beside the simulator's prediction.

The tiny Megatron-Core GPT (``python -m megatron_pp_ext train``'s default model: 8 layers,
hidden 64, micro-batch 4 x 32 tokens, fp32) on p gloo processes, every schedule at p=4, m=8.
Each rank measures its peak activation bytes (``runtime/memory.py``: the unique storages held
by the saved tensors of in-flight microbatches, the W queue's inputs and output gradients, and
arrivals waiting for their action), written to summary.json.

Prediction, never fitted to the run it judges: a separate CALIBRATION run per layout (1f1b for
one chunk per rank, interleaved for the loop of v=2 chunks, zb-v for the V layout; m=p, one
step) gives one F's saved bytes for each stage (microbatch 0's:
``activation_bytes_per_stage``); the prediction of a judged run is the simulator's walk of
held chunk-activations with those bytes per stage (``runtime.memory.predicted_peak_bytes``:
+ a stage's bytes at the end of its F, - at the end of the B or W that frees it). It counts
a split schedule's activation as held until its W, whole: an upper bound where I frees the
graph and W keeps only the linears' inputs and output gradients.

Also per schedule: the W queue's bytes at the measured peak, and W's share of the backward
(the measured W time over I + W, per rank, and the weight GEMMs W ran).

    .venv/bin/python bench/memory_bytes.py               # p=4, m=8, every schedule
    .venv/bin/python bench/run_all.py --only f           # the same, into bench/results
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

SCHEDULES = ("1f1b", "interleaved", "zb-h1", "zb-h2", "zb-v", "dualpipev", "gpipe")
CALIBRATE_WITH = {("loop", 1): "1f1b", ("loop", 2): "interleaved", ("v", 2): "zb-v"}
LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_STEP_ID")


def train(schedule: str, p: int, m: int, steps: int, out: Path) -> dict:
    """One ``train`` run (fresh processes); its summary.json."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_ENV}
    cmd = [sys.executable, "-m", "megatron_pp_ext", "train", "--schedule", schedule,
           "-p", str(p), "-m", str(m), "--steps", str(steps), "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    return json.loads((out / "summary.json").read_text())


def layout_key(summary: dict) -> tuple[str, int]:
    return (str(summary.get("layout") or "loop").lower(), int(summary.get("chunks") or 1))


def predicted(summary: dict, per_stage: list) -> list[int]:
    from megatron_pp_ext.runtime.memory import predicted_peak_bytes
    from megatron_pp_ext.schedules import build_schedule

    schedule = build_schedule(summary["schedule"], summary["pp"], summary["microbatches"],
                              summary["chunks"])
    return predicted_peak_bytes(schedule, dict(enumerate(per_stage)))


def w_share(summary: dict) -> dict | None:
    """W's share of the backward: measured W time / (I + W) per rank, and GEMMs per rank."""
    costs = summary.get("measured_costs_per_rank_s") or {}
    if "t_w" not in costs:
        return None
    share = [w / (i + w) if i + w > 0 else 0.0 for i, w in zip(costs["t_i"], costs["t_w"])]
    grads = summary.get("weight_grads_per_rank") or []
    return {"time_share": share,
            "gemms_in_w": [g.get("in_w") if g else None for g in grads],
            "kept_in_i": [g.get("kept_in_i") if g else None for g in grads]}


def run(p: int = 4, m: int = 8, steps: int = 2, schedules=SCHEDULES, calibrate_m: int | None = None,
        workdir: Path | None = None) -> dict:
    """Calibration runs (one per layout needed), then every schedule judged."""
    from bench.provenance import utc_now

    calibrate_m = calibrate_m or p
    work = Path(workdir or tempfile.mkdtemp(prefix="pp_memory_bench_"))
    judged = []
    for name in schedules:
        print(f"(f) judged run {name} p={p} m={m} ...", flush=True)
        started = utc_now()
        summary = train(name, p, m, steps, work / f"judged_{name}")
        judged.append((summary, started, utc_now()))
    calibration = {}
    for key in sorted({layout_key(s) for s, _a, _b in judged}):
        name = CALIBRATE_WITH[key]
        print(f"(f) calibration run {name} p={p} m={calibrate_m} ...", flush=True)
        summary = train(name, p, calibrate_m, 1, work / f"calibration_{name}")
        calibration[f"{key[0]}:{key[1]}"] = {
            "schedule": name, "m": calibrate_m,
            "activation_bytes_per_stage": summary["activation_bytes_per_stage"]}
    rows = []
    for summary, started, ended in judged:
        key = layout_key(summary)
        cal = calibration[f"{key[0]}:{key[1]}"]
        measured = summary["peak_activation_bytes"]
        pred = predicted(summary, cal["activation_bytes_per_stage"])
        rows.append({
            "schedule": summary["schedule"], "chunks": summary["chunks"],
            "layout": summary["layout"],
            "peak_activations": summary["peak_activations"],
            "measured_bytes": measured,
            "predicted_bytes": pred,
            "error": [(mb - pb) / pb if pb else None for mb, pb in zip(measured, pred)],
            "parts": summary["peak_activation_bytes_parts"],
            "own_activation_bytes_per_stage": summary["activation_bytes_per_stage"],
            "calibrated_with": cal["schedule"],
            "w_share": w_share(summary),
            "device_peak_bytes": summary.get("device_peak_bytes"),
            "utc_start": started, "utc_end": ended,
        })
    return {"p": p, "m": m, "steps": steps, "calibrate_m": calibrate_m,
            "calibration": calibration, "rows": rows}


def markdown(section: dict) -> list[str]:
    """The table: peak bytes on the first and last rank, measured and predicted."""
    from megatron_pp_ext.units import format_bytes_iec as fmt

    p, m = section["p"], section["m"]
    out = [f"Tiny GPT (8 layers, hidden 64, micro-batch 4 x 32 tokens, fp32), p={p}, m={m}, "
           f"gloo on the CPU; the last of {section['steps']} steps. Predicted = the simulator's "
           f"count x one F's saved bytes per stage, from a separate calibration run "
           f"(m={section['calibrate_m']}) of the same layout.", "",
           "| schedule | v | peak count (chunk-activations) first / last | measured first | "
           "predicted first | "
           "measured last | predicted last | W queue at peak (first / last) | "
           "W share of I+W time (first / last) |",
           "|---|---|---|---|---|---|---|---|---|"]
    for row in section["rows"]:
        meas, pred, parts = row["measured_bytes"], row["predicted_bytes"], row["parts"]
        counts = row["peak_activations"]

        def cell(i):
            err = row["error"][i]
            pct = abs(round(100 * err, 1)) if err is not None and abs(err) < 5e-4 else (
                None if err is None else round(100 * err, 1))
            return fmt(meas[i]), fmt(pred[i]) + (f" ({pct:+.1f}%)" if pct is not None else "")
        first, last = cell(0), cell(-1)
        share = row["w_share"]
        share_text = ("-" if share is None else
                      f"{100 * share['time_share'][0]:.0f}% / {100 * share['time_share'][-1]:.0f}%")
        out.append(f"| {row['schedule']} | {row['chunks']} | {counts[0]} / {counts[-1]} | "
                   f"{first[0]} | {first[1]} | {last[0]} | {last[1]} | "
                   f"{fmt(parts[0]['w_queue'])} / {fmt(parts[-1]['w_queue'])} | {share_text} |")
    out += ["", "(measured vs predicted in parentheses: (measured - predicted) / predicted; "
            "exact bytes in results.json)"]
    return out


def main(argv=None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-p", type=int, default=4)
    parser.add_argument("-m", type=int, default=8)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--json", type=Path, help="also write the section's JSON here")
    args = parser.parse_args(argv)
    section = run(args.p, args.m, args.steps)
    if args.json:
        args.json.write_text(json.dumps(section, indent=1) + "\n")
    print("\n".join(markdown(section)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
