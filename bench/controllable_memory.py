"""v-half and v-min against the authors' figures: bubble and peak at p = 4..16, m = 4p.

The authors' figures come from their scheduler (sail-sg/zero-bubble-pipeline-parallelism,
``megatron/core/pipeline_parallel/zerobubble/scheduler/zbv_greedy.py``: ``PipelineGraph(p, 4p,
"half" | "min", 1, 1, 1, c)``, the bubble ``create_schedule`` prints), run once at equal chunk
costs F = B = W = 1 with a message time c of 0, 0.001 (their runtime's own: costs of 1000, a
message of 1) and 0.2 of a chunk action; their peak is their order's busiest rank. Their
bubble, (span - 6m) / span over the longest rank's span, is ``Timeline.bubble_fraction`` on
their orders (every rank computes 6m chunk actions, rank 0 starts first and ends last).
Ours: ``simulate`` at a rank's share t_f = t_i = t_w = 1 (two chunk actions of 0.5), so
their c of 0.001 and 0.2 is our ``--t-comm`` 0.0005 and 0.1.

    .venv/bin/python -m bench.controllable_memory            # p = 4, 6, 8, 12, 16
    .venv/bin/python -m bench.controllable_memory --ps 4 5 6 7 8 --t-comm 0 0.3

Writes ``bench/results/controllable_memory.md``. Not a test (tests/test_controllable_memory.py
holds the same figures): the figures only. Pure: no torch, a few seconds.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from megatron_pp_ext.analysis.simulate import CostModel, simulate
from megatron_pp_ext.schedules import build_schedule

#: t_comm (ours, a rank's share of 1 per kind) of each of the authors' columns below
MESSAGES = (0.0, 0.0005, 0.1)
#: name -> p -> (the authors' peak in chunk-activations, their bubble at each of MESSAGES);
#: m = 4p
AUTHORS = {
    "v-half": {
        4: (6, (0.049505, 0.049712, 0.089184)),
        5: (6, (0.083969, 0.084165, 0.121523)),
        6: (8, (0.070968, 0.071171, 0.110012)),
        7: (8, (0.091892, 0.092098, 0.131334)),
        8: (10, (0.081340, 0.081551, 0.121683)),
        9: (10, (0.096234, 0.096438, 0.135308)),
        10: (12, (0.087452, 0.087668, 0.128540)),
        11: (12, (0.098976, 0.099185, 0.138943)),
        12: (14, (0.091483, 0.091695, 0.132007)),
        13: (14, (0.100865, 0.101077, 0.141442)),
        14: (16, (0.094340, 0.094554, 0.135358)),
        15: (16, (0.102244, 0.102455, 0.142449)),
        16: (18, (0.096471, 0.096687, 0.137854)),
    },
    "v-min": {
        4: (4, (0.102804, 0.103407, 0.209226)),
        5: (6, (0.111111, 0.111795, 0.229782)),
        6: (6, (0.105590, 0.106323, 0.231590)),
        7: (6, (0.120419, 0.121146, 0.245283)),
        8: (8, (0.123288, 0.124040, 0.251754)),
        9: (8, (0.118367, 0.119144, 0.250520)),
        10: (8, (0.127273, 0.128046, 0.258802)),
        11: (10, (0.128713, 0.129494, 0.261332)),
        12: (10, (0.124620, 0.125418, 0.259640)),
        13: (10, (0.130919, 0.131713, 0.265191)),
        14: (12, (0.131783, 0.132581, 0.266696)),
        15: (12, (0.128329, 0.129139, 0.265006)),
        16: (12, (0.133183, 0.133988, 0.269128)),
    },
}


def authors_bubble(name: str, p: int, t_comm: float) -> float | None:
    """The authors' bubble at m = 4p and this message time, or None where not run."""
    for c, bubble in zip(MESSAGES, AUTHORS[name].get(p, (None, ()))[1]):
        if abs(c - t_comm) < 1e-12:
            return bubble
    return None


def measure(name: str, p: int, t_comms) -> dict:
    m = 4 * p
    start = time.perf_counter()
    schedule = build_schedule(name, p, m)
    build_s = time.perf_counter() - start
    peaks = simulate(schedule).peak_activations
    return {"schedule": name, "p": p, "m": m, "build_s": build_s,
            "peak_v1": max(peaks) / 2, "peaks": peaks,
            "authors_peak_v1": AUTHORS[name][p][0] / 2 if p in AUTHORS[name] else None,
            "bubbles": {c: simulate(schedule, CostModel(t_comm=c)).bubble_fraction
                        for c in t_comms},
            "authors": {c: authors_bubble(name, p, c) for c in t_comms}}


def _fraction(x: float | None) -> str:
    return "-" if x is None else f"{x:.4f}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ps", type=int, nargs="+", default=[4, 6, 8, 12, 16])
    parser.add_argument("--t-comm", type=float, nargs="+", default=list(MESSAGES),
                        help="message times (a rank's share of F, I, W is 1 each)")
    parser.add_argument("--out", default="bench/results/controllable_memory.md")
    args = parser.parse_args(argv)
    rows = [measure(name, p, args.t_comm) for name in AUTHORS for p in args.ps]
    head = ["schedule", "p", "m", "peak (v=1 units): ours", "the authors'"]
    for c in args.t_comm:
        head += [f"bubble, t_comm {c:g}: ours", "the authors'"]
    head.append("build")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["schedule"], str(r["p"]), str(r["m"]), f"{r['peak_v1']:g}",
                 "-" if r["authors_peak_v1"] is None else f"{r['authors_peak_v1']:g}"]
        for c in args.t_comm:
            cells += [_fraction(r["bubbles"][c]), _fraction(r["authors"][c])]
        cells.append(f"{r['build_s']:.3f} s")
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Bubble: idle over ranks x makespan (`simulate`, bubble_fraction), a rank's "
              "share of F, I and W 1 each (chunk actions of 0.5), a message t_comm; peak: the "
              "busiest rank's activations in v=1 units (a chunk-activation is 1/2). The "
              "authors': their `zbv_greedy.py` at equal chunk costs 1 and a message of "
              "2 t_comm (their unit is a chunk action), their bubble (the same definition on "
              "their orders). Build: one `build_schedule` (validated), wall seconds. "
              "`.venv/bin/python -m bench.controllable_memory` writes this file."]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
