"""bench/time_breakdown.py: the messages each rank posts per step, and where a traced round's
time goes (synthetic timeline with known events, so every figure is exact)."""

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # `bench`

from bench.time_breakdown import breakdown, messages_per_step  # noqa: E402
from megatron_pp_ext.schedules import build_schedule  # noqa: E402
from megatron_pp_ext.timeline import COMM_WAIT, COMPUTE, Event, Timeline  # noqa: E402


@pytest.mark.parametrize("name, v, options, expected", [
    ("1f1b", 1, {}, [16, 32, 32, 16]),
    ("zb-h2", 1, {}, [16, 32, 32, 16]),  # a W moves nothing
    ("zb-v", 2, {}, [32, 64, 64, 32]),  # the V: through a middle rank twice each way
    ("zb-v", 2, {"warmup_forwards": 7}, [32, 64, 64, 32]),
])
def test_messages_per_step(name, v, options, expected):
    assert messages_per_step(build_schedule(name, 4, 8, v, **options)) == expected


def test_breakdown_splits_each_step_into_busy_waiting_and_host():
    events = []
    t = 0.0
    for j in range(4):  # per step: a 2 s action, a 0.5 s wait, 0.25 s of host, a 1 s optimizer
        events.append(Event(0, f"0F{j}", t, t + 2.0, COMPUTE))
        events.append(Event(0, f"step {j}: wait 0F{j}<-rank 1", t + 2.0, t + 2.5, COMM_WAIT))
        events.append(Event(0, f"opt{j}", t + 2.75, t + 3.75, COMPUTE))
        t += 3.75
    timeline = Timeline("x", 1, 4, 1, events, source="measured", unit="s")
    (row,) = breakdown(timeline, 4)
    assert row == {"rank": 0, "busy": 3.0, "waiting": 0.5, "host": 0.25, "step": 3.75,
                   "actions": 1.0}
