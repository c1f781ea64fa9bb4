"""``demo``: every registered schedule's simulated timeline for p=4, m=8, then a comparison.

Every schedule gets the same costs, a rank's share of one microbatch: t_f = t_i = t_w = 1,
t_b = 2 (a schedule with v chunks per rank runs actions of 1/v of that), so makespans compare
directly. Peak activations are counted in v=1 units (one microbatch through all of a rank's
layers; a chunk of a v-chunk schedule counts 1/v). ``-p`` and ``-m`` change the sizes.
"""

from __future__ import annotations

from ..analysis.costs import ACTIVATION_UNIT, activations_in_v1_units, format_counts
from ..analysis.render import render_ascii
from ..analysis.simulate import CostModel, simulate
from ..ir import ScheduleError
from ..schedules import REGISTRY, build_schedule
from .hints import warn_p_exceeds_m
from .common import peak_line

RANKS, MICROBATCHES = 4, 8


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "demo", help=f"show every schedule's simulated timeline for p={RANKS}, m={MICROBATCHES}",
        description=__doc__,
    )
    parser.add_argument("--ranks", "-p", "--pp", dest="ranks", type=int, default=RANKS,
                        metavar="P", help=f"pipeline size (default {RANKS})")
    parser.add_argument("--microbatches", "-m", type=int, default=MICROBATCHES, metavar="M",
                        help=f"microbatches per step (default {MICROBATCHES})")
    parser.set_defaults(func=run)


def run(args) -> int:
    p = getattr(args, "ranks", RANKS)
    m = getattr(args, "microbatches", MICROBATCHES)
    warn_p_exceeds_m(p, m)
    rows, skipped = [], []
    print(f"Simulated timelines, p={p} ranks, m={m} microbatches; costs per rank and "
          "microbatch (all of a rank's layers) t_f = t_i = t_w = 1, t_b = 2: a v-chunk "
          "schedule's actions cost 1/v of that.\n")
    for name, spec in REGISTRY.items():
        v = spec.default_chunks
        try:
            schedule = build_schedule(name, p, m, v)
        except ScheduleError as exc:
            if p <= m:
                raise  # at the defaults every schedule builds: a failure is a bug, exit 2
            skipped.append(f"{name}: {' '.join(str(exc).split())}")
            continue
        v = schedule.chunks  # zb-auto's: the layout it chose
        timeline = simulate(schedule, CostModel(), validate=False)
        text = render_ascii(timeline)
        if v > 1:
            text += "\n" + peak_line(timeline)
        print(text + "\n")
        rows.append((name, f"{100 * timeline.bubble_fraction:.2f}%",
                     format_counts(activations_in_v1_units(timeline.peak_activations, v))))
    print(_table(("schedule", "bubble", "peak activations per rank (v=1 units)"), rows))
    print(f"({ACTIVATION_UNIT})")
    for line in skipped:
        print(f"not shown: {line}")
    print(f"\nstep times side by side, for your costs: python -m megatron_pp_ext compare "
          f"-p {p} -m {m} [--costs out/train/summary.json]")
    return 0


def _table(header, rows) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    line = lambda cells: "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths)) + " |"
    rule = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(header), rule, *map(line, rows)])
