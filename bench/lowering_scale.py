"""What the drop-in pays at start-up on NCCL before its first step, and what ``simulate
--communication nccl`` pays, for large pipelines: the lowering pass (``analysis.program_pass``),
the posting choice with NCCL's rules checked and the program with receives posted ahead
(``analysis.lowering.runtime_program``, what the drop-in derives once per schedule, and its
rank's part compiled for the executor) and the NCCL timing model
(``analysis.nccl_timing``), each timed in this process (CPU seconds, ``time.process_time``)
with the peak resident memory of the whole run.

    .venv/bin/python -m bench.lowering_scale                 # p = 8 .. 128, m = 8p
    .venv/bin/python -m bench.lowering_scale --ps 64 --schedules zb-v

Writes ``bench/results/lowering_scale.md`` (and ``.json``). Not a test: figures only.
"""

from __future__ import annotations

import argparse
import json
import resource
import time

from bench.provenance import write_results
from megatron_pp_ext.analysis.lowering import nccl_choice, runtime_program
from megatron_pp_ext.analysis.nccl_timing import time_program
from megatron_pp_ext.analysis.simulate import CostModel, action_durations
from megatron_pp_ext.analysis.program_steps import compile_steps
from megatron_pp_ext.schedules import build_schedule
from megatron_pp_ext.schedules.validate import peak_activations

CHUNKS = {"interleaved": 2, "zb-v": 2, "dualpipev": 2}


def _timed(work):
    start = time.process_time()
    out = work()
    return out, time.process_time() - start


def measure(name: str, p: int, m: int) -> dict:
    v = CHUNKS.get(name, 1)
    # the drop-in builds (and validates) the schedule, derives the program once
    # (RunState.program: nccl_choice's, checked against NCCL's rules) and compiles its rank's
    # part (RunState.program_steps); simulate --communication nccl: the same choice, timed
    schedule, build_s = _timed(lambda: build_schedule(name, p, m, v))
    choice, program_s = _timed(lambda: nccl_choice(schedule))
    _, compile_s = _timed(lambda: compile_steps(runtime_program(schedule, batched=True,
                                                                choice=choice), 0, schedule))
    kind, program = choice.posting, choice.program
    cost = CostModel().per_stage(schedule)
    _, timing_s = _timed(lambda: time_program(program, schedule, action_durations(cost),
                                              cost["t_comm"], peak_activations(schedule),
                                              check=False))
    return {"schedule": name, "p": p, "m": m, "v": v, "posting": kind,
            "actions": sum(len(row) for row in schedule.actions),
            "batches": sum(len(program.batches(r)) for r in range(p)),
            "build_s": build_s, "lowering_and_rules_s": program_s, "timing_s": timing_s,
            "simulate_nccl_s": program_s + timing_s,
            "drop_in_start_s": build_s + program_s + compile_s,
            "peak_mib_so_far": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ps", type=int, nargs="+", default=[8, 16, 32, 64, 128])
    parser.add_argument("--per-rank", type=int, default=8, help="m = this x p")
    parser.add_argument("--schedules", nargs="+",
                        default=["1f1b", "interleaved", "zb-h1", "zb-v", "dualpipev"])
    parser.add_argument("--out", default="bench/results/lowering_scale")
    args = parser.parse_args(argv)
    rows = []
    for p in args.ps:
        for name in args.schedules:
            rows.append(measure(name, p, args.per_rank * p))
            print(json.dumps(rows[-1]), flush=True)
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    lines = [
        "| schedule | p | m | v | posting | actions (count) | batches (count) | build | "
        "lowering + NCCL's rules | timing model | simulate --communication nccl | "
        "drop-in start-up on NCCL | peak RSS so far |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['schedule']} | {r['p']} | {r['m']} | {r['v']} | {r['posting']} | "
                     f"{r['actions']} | {r['batches']} | {r['build_s']:.2f} s | "
                     f"{r['lowering_and_rules_s']:.2f} s | {r['timing_s']:.2f} s | "
                     f"{r['simulate_nccl_s']:.2f} s | {r['drop_in_start_s']:.2f} s | "
                     f"{r['peak_mib_so_far']:.0f} MiB |")
    lines.append("")
    lines.append(f"CPU seconds in one process (time.process_time), rows in this order; peak "
                 "resident memory of the process after each row (the rows before it were "
                 f"smaller and are freed), {peak_mb:.0f} MiB for the whole run. Lowering + "
                 "NCCL's rules: nccl_choice (the program lowered and checked; with Megatron's "
                 "fused calls, also the program with receives posted ahead, checked and timed "
                 "at unit costs). simulate: that + the NCCL timing model. Drop-in start-up: "
                 "what every rank pays once per schedule before its first step: the build "
                 "(validated), nccl_choice and compile_steps (its part read for the "
                 "executor).")
    write_results(args.out, lines, {"rows": rows, "peak_mib": peak_mb})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
