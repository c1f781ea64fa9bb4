"""Bench (e): every schedule on an emulated device over the in-memory NCCL-rules fabric.

Each rank is a thread of one process running the real ``Executor`` as it runs on NCCL (Megatron's
fused calls, receives posted ahead where proven, or the lockstep program: whatever
``analysis.lowering`` picks) over ``tests/support/nccl_fabric.NcclRulesFabric``: rendezvous
sends, one Work per batch, a rank's batches in order, data visible only after the wait. The
stages sleep a rank's share of ``t`` per F, I and W (``t / v`` per chunk), standing in for GPU
kernels; the in-memory copy takes no measurable time.

Predicted by ``simulate(..., communication="nccl")``, the lowered program timed under the same
rules, and, beside it, by the buffered model (``communication="buffered"``), which does not
know NCCL's rules. One number is taken from the machine, from a separate calibration run of
1F1B alone, then held fixed for the judged rounds, in two ways: ``t_overhead`` (host time per
F, I and B, as in part (a)), or ``t_comm`` (a latency per rendezvous: the fabric's thread
hand-offs, which a receive posted a round ahead hides and a fused call exposes). Step = the last compute's end minus the first one's start.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for _path in (str(ROOT / "tests"), str(ROOT)):  # the toy stages live with the tests' support
    if _path not in sys.path:
        sys.path.insert(0, _path)

from megatron_pp_ext.analysis.simulate import CostModel, simulate  # noqa: E402
from megatron_pp_ext.schedules import build_schedule  # noqa: E402
from support.emulated import EmulatedCosts  # noqa: E402
from support.inmemory import run_inmemory  # noqa: E402

SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1), ("zb-h2", 1),
             ("zb-v", 2), ("dualpipev", 2)]


def step_time(schedule, v: int, t: float) -> float:
    """One step over the fabric, seconds (first compute start to last compute end)."""
    results = run_inmemory(schedule, costs=EmulatedCosts(t_f=t / v, t_i=t / v, t_w=t / v),
                           nccl_rules=True, trace=True, timeout_s=120.0)
    events = [e for result, _ in results for e in result.events]
    return max(e.end for e in events) - min(e.start for e in events)


def calibrate(p: int, m: int, t: float, reps: int) -> dict:
    """From 1F1B's steps alone, two one-number models of what the fabric adds:
    ``t_overhead`` = (1F1B's step - its prediction without it) / its 2(m + p - 1) actions on
    the critical path (host time per F, I and B), and ``t_comm``: the message time that makes
    the NCCL model's 1F1B step equal the measured one (a latency per rendezvous, charged only
    where a message is on the critical path). Medians over ``reps`` rounds."""
    schedule = build_schedule("1f1b", p, m)
    base = simulate(schedule, CostModel(t_f=t, t_i=t, t_w=t), communication="nccl").makespan
    steps = [step_time(schedule, 1, t) for _ in range(reps)]
    per_round = [(s - base) / (2 * (m + p - 1)) for s in steps]
    return {"p": p, "m": m, "steps": steps, "t_overhead_rounds": per_round,
            "t_overhead": statistics.median(per_round),
            "t_comm": _message_time(schedule, t, statistics.median(steps))}


def _message_time(schedule, t: float, step: float) -> float:
    """The t_comm at which the NCCL model predicts ``step`` (bisection: monotone in t_comm)."""
    low, high = 0.0, 0.05
    for _ in range(40):
        mid = (low + high) / 2
        costs = CostModel(t_f=t, t_i=t, t_w=t, t_comm=mid)
        if simulate(schedule, costs, communication="nccl").makespan < step:
            low = mid
        else:
            high = mid
    return low


def run(p: int, ms: tuple, t: float, reps: int, cal: dict) -> list[dict]:
    """Every schedule at every m, ``reps`` rounds in rotating order; predictions with the
    calibration's ``t_overhead`` unchanged."""
    rows = []
    for m in ms:
        built = [(name, v, build_schedule(name, p, m, v)) for name, v in SCHEDULES
                 if _allowed(name, p, m)]
        steps = {name: [] for name, _, _ in built}
        for r in range(reps):
            for name, v, schedule in built[r % len(built):] + built[:r % len(built)]:
                steps[name].append(step_time(schedule, v, t))
        costs = CostModel(t_f=t, t_i=t, t_w=t, t_overhead=cal["t_overhead"])
        latency = CostModel(t_f=t, t_i=t, t_w=t, t_comm=cal["t_comm"])
        for name, v, schedule in built:
            rows.append({
                "p": p, "m": m, "schedule": name, "v": v, "steps": steps[name],
                "nccl": simulate(schedule, costs, communication="nccl").makespan,
                "buffered": simulate(schedule, costs).makespan,
                "nccl_latency": simulate(schedule, latency, communication="nccl").makespan,
                "held_out": not (name == "1f1b" and m == cal["m"]),
            })
    return rows


def _allowed(name: str, p: int, m: int) -> bool:
    try:
        build_schedule(name, p, m, 2 if name in ("interleaved", "zb-v", "dualpipev") else 1)
        return True
    except ValueError:
        return False


__all__ = ["SCHEDULES", "calibrate", "run", "step_time"]
