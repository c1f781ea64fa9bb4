"""Time the validator and the simulator on a big pipeline (not a test).

    .venv/bin/python bench/bench_analysis.py [--ranks 64] [--microbatches 512]

Prints a Markdown table: per schedule, its action count and the seconds to validate and to
simulate (best of a few runs; the simulator is timed without its own validation). Target:
under 2 s each at p=64, m=512.
"""

from __future__ import annotations

import argparse
import time

from megatron_pp_ext.analysis.simulate import simulate
from megatron_pp_ext.analysis.validate import validate_schedule
from megatron_pp_ext.ir import ScheduleError
from megatron_pp_ext.schedules import REGISTRY, build_schedule


def best_of(repeats: int, work) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=64)
    parser.add_argument("--microbatches", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    p, m = args.ranks, args.microbatches

    print(f"p={p}, m={m}; seconds, best of {args.repeats}\n")
    print("| schedule | v | actions | validate (s) | simulate (s) | bubble |")
    print("|---|---|---|---|---|---|")
    for name, spec in REGISTRY.items():
        v = spec.default_chunks
        try:
            schedule = build_schedule(name, p, m, v, validate=False)
        except ScheduleError as exc:
            print(f"| {name} | {v} | - | - | - | {' '.join(str(exc).split())} |")
            continue
        actions = sum(len(row) for row in schedule.actions)
        note = ""
        try:
            t_validate = best_of(args.repeats, lambda: validate_schedule(schedule))
        except ScheduleError as exc:  # still worth timing how fast it says so
            t_validate = best_of(1, lambda: _rejects(schedule))
            note = f" (invalid: {str(exc)[:50]}...)"
        timeline = simulate(schedule, validate=False)
        t_simulate = best_of(args.repeats, lambda: simulate(schedule, validate=False))
        print(f"| {name} | {v} | {actions} | {t_validate:.3f} | {t_simulate:.3f} | "
              f"{100 * timeline.bubble_fraction:.2f}%{note} |")


def _rejects(schedule) -> None:
    try:
        validate_schedule(schedule)
    except ScheduleError:
        pass


if __name__ == "__main__":
    main()
