"""Time the validator and the simulator on a big pipeline (not a test).

    .venv/bin/python bench/bench_analysis.py [--ranks 64] [--microbatches 512] [--repeats 3]

Prints a Markdown table: per schedule, its action count and the seconds to validate and to
simulate (the median of ``--repeats`` runs of wall time; ``measure`` also takes the CPU time;
the simulator is timed without its own validation). Target: under 2 s each at p=64, m=512 (v=2 for interleaved, zb-v, dualpipev).
``measure`` returns the rows, for ``bench/run_all.py``.
"""

from __future__ import annotations

import argparse
import statistics
import time

from megatron_pp_ext.analysis.simulate import simulate
from megatron_pp_ext.schedules.validate import validate_schedule
from megatron_pp_ext.ir import ScheduleError
from megatron_pp_ext.schedules import REGISTRY, build_schedule


def median_of(repeats: int, work, clock=time.perf_counter) -> float:
    times = []
    for _ in range(repeats):
        start = clock()
        work()
        times.append(clock() - start)
    return statistics.median(times)


def wall_and_cpu(repeats: int, work, spread: dict | None = None) -> tuple[float, float]:
    """Median wall seconds and median CPU seconds of this process (what other work on a
    shared machine does not inflate) over the same ``repeats`` runs; ``spread``, if given,
    receives every run's (wall, CPU) under "wall" and "cpu"."""
    wall, cpu = [], []
    for _ in range(repeats):
        start, start_cpu = time.perf_counter(), time.process_time()
        work()
        cpu.append(time.process_time() - start_cpu)
        wall.append(time.perf_counter() - start)
    if spread is not None:
        spread.update(wall=wall, cpu=cpu)
    return statistics.median(wall), statistics.median(cpu)


def measure(p: int, m: int, repeats: int = 3, names=None) -> list[dict]:
    """One row per schedule: actions, build / validate / simulate seconds (median), bubble;
    ``note`` holds a builder or validator error instead."""
    rows = []
    for name in (names or REGISTRY):
        v = REGISTRY[name].default_chunks
        row = {"schedule": name, "v": v, "p": p, "m": m, "note": ""}
        rows.append(row)
        try:
            start = time.perf_counter()
            schedule = build_schedule(name, p, m, v, validate=False)
            row["build_s"] = time.perf_counter() - start
        except ScheduleError as exc:
            row["note"] = " ".join(str(exc).split())
            continue
        row["actions"] = sum(len(r) for r in schedule.actions)
        row["validate_rounds"], row["simulate_rounds"] = {}, {}
        try:
            row["validate_s"], row["validate_cpu_s"] = wall_and_cpu(
                repeats, lambda: validate_schedule(schedule), row["validate_rounds"])
        except ScheduleError as exc:  # still worth timing how fast it says so
            row["validate_s"] = median_of(1, lambda: _rejects(schedule))
            row["note"] = f"invalid: {' '.join(str(exc).split())[:60]}..."
            continue
        timeline = simulate(schedule, validate=False)
        row["simulate_s"], row["simulate_cpu_s"] = wall_and_cpu(
            repeats, lambda: simulate(schedule, validate=False), row["simulate_rounds"])
        row["bubble"] = timeline.bubble_fraction
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=64)
    parser.add_argument("--microbatches", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    p, m = args.ranks, args.microbatches

    print(f"p={p}, m={m}; seconds, median of {args.repeats}\n")
    print("| schedule | v | actions | validate (s) | simulate (s) | bubble |")
    print("|---|---|---|---|---|---|")
    for row in measure(p, m, args.repeats):
        if "simulate_s" not in row:
            validate = f"{row['validate_s']:.3f}" if "validate_s" in row else "-"
            print(f"| {row['schedule']} | {row['v']} | {row.get('actions', '-')} | {validate} "
                  f"| - | {row['note']} |")
            continue
        print(f"| {row['schedule']} | {row['v']} | {row['actions']} | {row['validate_s']:.3f} | "
              f"{row['simulate_s']:.3f} | {100 * row['bubble']:.2f}% |")


def _rejects(schedule) -> None:
    try:
        validate_schedule(schedule)
    except ScheduleError:
        pass


if __name__ == "__main__":
    main()
