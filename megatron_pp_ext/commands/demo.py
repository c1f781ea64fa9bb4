"""``demo``: every registered schedule's simulated timeline for p=4, m=8, then a comparison.

The model is cut into p*v equal stages, so a stage of a v-chunk schedule costs 1/v of a
1-chunk one: makespans compare directly. Per stage of a 1-chunk schedule: t_f = t_i = t_w = 1,
t_b = 2.
"""

from __future__ import annotations

from ..analysis.render import render_ascii
from ..analysis.simulate import CostModel, simulate
from ..schedules import REGISTRY, build_schedule

RANKS, MICROBATCHES = 4, 8


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "demo", help=f"show every schedule's simulated timeline for p={RANKS}, m={MICROBATCHES}",
        description=__doc__,
    )
    parser.set_defaults(func=run)


def run(args) -> int:
    rows = []
    print(f"Simulated timelines, p={RANKS} ranks, m={MICROBATCHES} microbatches; per stage of a "
          "1-chunk schedule t_f = t_i = t_w = 1, t_b = 2 (a v-chunk stage costs 1/v of that).\n")
    for name, spec in REGISTRY.items():
        v = spec.default_chunks
        schedule = build_schedule(name, RANKS, MICROBATCHES, v)  # a ScheduleError is exit 2
        timeline = simulate(schedule, CostModel(t_f=1 / v, t_i=1 / v, t_w=1 / v), validate=False)
        print(render_ascii(timeline) + "\n")
        rows.append((name, f"{100 * timeline.bubble_fraction:.2f}%",
                     str(list(timeline.peak_activations))))
    print(_table(("schedule", "bubble", "peak activations per rank"), rows))
    return 0


def _table(header, rows) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    line = lambda cells: "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths)) + " |"
    rule = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(header), rule, *map(line, rows)])
