"""v-half and v-min against the authors' own figures, and zb-auto under their budgets (pure:
no torch).

The figures (``bench.controllable_memory.AUTHORS``, where they come from) are those of the
authors' scheduler (sail-sg/zero-bubble-pipeline-parallelism, ``zbv_greedy.py``) at p = 4..16,
m = 4p, equal chunk costs and messages of 0, 1/1000 (their runtime's) and 0.2 of a chunk
action: our t_comm 0, 0.0005 and 0.1 at a rank's share of 1 per kind. Their bubble is ours
(``Timeline.bubble_fraction``) on their orders; peaks are the busiest rank's, in
chunk-activations (half a v=1 unit each).
"""

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # `bench`

from bench.controllable_memory import AUTHORS, MESSAGES  # noqa: E402
from megatron_pp_ext.analysis.simulate import CostModel, simulate  # noqa: E402
from megatron_pp_ext.schedules import build_schedule  # noqa: E402


@pytest.mark.parametrize("name", ["v-half", "v-min"])
def test_v_half_and_v_min_at_the_authors_bubble_or_below_at_their_peak(name):
    assert sorted(AUTHORS[name]) == list(range(4, 17))
    for p, (peak, bubbles) in AUTHORS[name].items():
        schedule = build_schedule(name, p, 4 * p)
        timelines = [simulate(schedule, CostModel(t_comm=c)) for c in MESSAGES]
        assert max(timelines[0].peak_activations) == peak, (name, p)
        for c, timeline, theirs in zip(MESSAGES, timelines, bubbles):
            assert round(timeline.bubble_fraction, 6) <= theirs, (name, p, c)


#: the authors' bubble at free messages for a short m (m = 1..p+2), p = 5 and 8
SHORT = {
    ("v-half", 5): [0.727273, 0.538462, 0.419355, 0.368421, 0.318182, 0.234043, 0.207547],
    ("v-half", 8): [0.823529, 0.684211, 0.581395, 0.500000, 0.433962, 0.400000, 0.288136,
                    0.261538, 0.239437, 0.220779],
    ("v-min", 5): [0.714286, 0.538462, 0.454545, 0.384615, 0.333333, 0.294118, 0.263158],
    ("v-min", 8): [0.818182, 0.684211, 0.590909, 0.529412, 0.473684, 0.428571, 0.391304,
                   0.360000, 0.333333, 0.310345],
}


@pytest.mark.parametrize("name, p", sorted(SHORT))
def test_a_short_m_at_the_authors_bubble_or_below_at_their_peak(name, p):
    """Where rank 0's last forward comes before its first turn (no steady phase), the
    authors' squeeze moves nothing after that turn; ours keeps the faster of that and moving
    everything. The busiest rank's peak is the block's, at most the long m's."""
    long_peak = max(simulate(build_schedule(name, p, 4 * p)).peak_activations)
    for m, theirs in enumerate(SHORT[(name, p)], start=1):
        timeline = simulate(build_schedule(name, p, m))
        assert round(timeline.bubble_fraction, 6) <= theirs, (name, p, m)
        assert max(timeline.peak_activations) <= long_peak, (name, p, m)


def test_the_figures_at_p4_and_p8_as_the_issue_quotes_them():
    """The issue's figures (the authors' runtime setting: messages of 1/1000 of an action),
    and those at free messages, to four places."""
    def bubble(name, p, c):
        return round(simulate(build_schedule(name, p, 4 * p), CostModel(t_comm=c))
                     .bubble_fraction, 4)

    assert [bubble(n, p, 0.0005) for n in ("v-half", "v-min") for p in (4, 8)] == [
        0.0497, 0.0816, 0.1034, 0.1240]
    assert [bubble(n, p, 0.0) for n in ("v-half", "v-min") for p in (4, 8)] == [
        0.0495, 0.0813, 0.1028, 0.1233]


@pytest.mark.parametrize("p", range(4, 17))
def test_zb_auto_is_never_above_the_best_fixed_v_schedule_under_its_budget(p):
    """Under the peak of v-min, of v-half and of zb-v (v=1 units, per rank) as the budget,
    free messages and messages of 0.1: zb-auto on the V layout is at or below the best of
    v-half, v-min and zb-v that fits. ``effort=0``: no refinement (which only lowers
    zb-auto's makespan), so the bound is the search's own."""
    m = 4 * p
    fixed = {name: build_schedule(name, p, m) for name in ("v-min", "v-half", "zb-v")}
    peaks = {name: max(simulate(s).peak_activations) / 2 for name, s in fixed.items()}
    for t_comm in (0.0, 0.1):
        costs = CostModel(t_comm=t_comm)
        bubbles = {name: simulate(s, costs).bubble_fraction for name, s in fixed.items()}
        for budget in peaks.values():
            best = min(bubbles[name] for name in fixed if peaks[name] <= budget)
            auto = build_schedule("zb-auto", p, m, chunks=2, t_comm=t_comm,
                                  memory_budget=budget, effort=0)
            timeline = simulate(auto, costs)
            assert max(timeline.peak_activations) / 2 <= budget, (p, t_comm, budget)
            assert timeline.bubble_fraction <= best + 1e-9, (p, t_comm, budget)
