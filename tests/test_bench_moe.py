"""bench/moe_overlap.py's device model: an F&B pair's span on two streams, and the share of
the all-to-alls an order's pairs hide on the device alone (the figure bench (h) prints next
to each run, and its docstring quotes)."""

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # `bench`

from bench.moe_overlap import (  # noqa: E402
    MoECosts,
    _schedule,
    device_only_step,
    hidden_on_the_device_alone,
    pair_layer_span,
    paired_actions,
)
from megatron_pp_ext.analysis.lowering import COMMIT  # noqa: E402


@pytest.mark.parametrize("a, b_kind, span", [
    (1.2, "B", 12.0),  # every all-to-all behind compute: F's 4 + B's 8
    (1.2, "I", 8.0),
    (0.0, "B", 12.0),
    (3.0, "B", 14.0),  # a > c/2: combine(b) and dispatch(f) outlast attention(f), experts(f)
])
def test_a_pair_lasts_its_two_streams_span(a, b_kind, span):
    assert pair_layer_span(MoECosts(c=4.0, a=a, layers=1), b_kind) == pytest.approx(span)


def test_dualpipev_pairs_hide_63_percent_at_p4_m16_on_the_device_alone():
    """c = 4, a = 1.2 (30 %): the floor, the all-to-alls alone and DualPipe's commit pairs
    (24 a rank), every message free: (564 - 458.4) / (564 - 396)."""
    schedule = _schedule("dualpipev", 4, 16)
    none = [frozenset()] * 4
    paired = paired_actions(schedule, COMMIT)
    assert [len(mine) for mine in paired] == [24, 24, 24, 24]
    steps = [device_only_step(schedule, MoECosts(4.0, a, 1), pairs)
             for a, pairs in ((0.0, none), (1.2, none), (1.2, paired))]
    assert steps == pytest.approx([396.0, 564.0, 458.4])
    assert hidden_on_the_device_alone("dualpipev", 4, 16, 4.0, 0.3, 1) == pytest.approx(
        105.6 / 168)
    assert hidden_on_the_device_alone("dualpipev", 4, 32, 4.0, 0.3, 1) > 0.8  # longer steady
