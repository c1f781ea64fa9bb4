"""Schedule selection: ranking by predicted step time under a per-rank memory budget."""

import json
from pathlib import Path

import pytest

from support.cli_run import cli_in_process

from megatron_pp_ext.analysis.costs import assume_split
from megatron_pp_ext.analysis.select import MiB, select_schedules
from megatron_pp_ext.analysis.simulate import CostModel, simulate
from megatron_pp_ext.schedules import build_schedule

ROOT = Path(__file__).resolve().parents[1]
EQUAL = CostModel(t_f=1, t_i=1, t_w=1)
#: the schedules with a published makespan formula (``expected_makespans``); zb-auto, v-half
#: and v-min have none: tests/test_synthesis.py holds their figures
FORMULA_SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2", "zb-v", "dualpipev")


def names(entries):
    return [(e.name, e.chunks) for e in entries]


def expected_makespans(p, m, t_f, t_i, t_w):
    """Single-step makespans from the published formulas, for per-rank costs and t_comm = 0:
    the oracle the selector's figures are checked against (nothing here calls the simulator).

    Every rank does m (t_F + t_B) of work (t_B = t_I + t_W) whatever the schedule; the
    makespan is that plus one rank's bubble:
      gpipe, 1f1b     (p-1)(t_F + t_B)               GPipe; PipeDream-Flush (1F1B)
      interleaved v   (p-1)(t_F + t_B) / v           Megatron-LM (Narayanan et al. 2021),
                                                     m a multiple of p
      zb-h1           (p-1)(t_F + t_B - 2 t_W)       ZB1P (Qi et al. 2024; DualPipe's table)
      zb-h2           (p-1) t_F                      the least any schedule can have: rank p-1
                                                     starts after p-1 forwards
      zb-v            (p-1) t_F / 2                  the same bound for the V layout, whose
                                                     chunk forwards cost t_F / 2 (equal costs)
      dualpipev       (p-1)(t_F + t_B - 2 t_W) / 2   ZB1P's bubble on half-size chunks when a
                                                     pair runs F then B, t_F = t_I (see
                                                     test_zero_bubble_builders)
    """
    t_b = t_i + t_w
    work = m * (t_f + t_b)
    spans = {
        ("gpipe", 1): work + (p - 1) * (t_f + t_b),
        ("1f1b", 1): work + (p - 1) * (t_f + t_b),
        ("zb-h1", 1): work + (p - 1) * (t_f + t_b - 2 * t_w),
        ("zb-h2", 1): work + (p - 1) * t_f,
    }
    for v in (2, 3, 4):
        spans[("interleaved", v)] = work + (p - 1) * (t_f + t_b) / v
    if t_f == t_i >= t_w:
        spans[("dualpipev", 2)] = work + (p - 1) * (t_f + t_b - 2 * t_w) / 2
    if t_f == t_i == t_w:
        spans[("zb-v", 2)] = work + (p - 1) * t_f / 2
    return spans


def test_tight_budget_excludes_gpipe_and_zb_h2_with_their_numbers():
    selection = select_schedules(4, 8, EQUAL, activation_bytes=64 * MiB,
                                 memory_budget_bytes=256 * MiB)
    reasons = {(e.name, e.chunks): e.reason for e in selection.excluded}
    assert reasons[("gpipe", 1)] == (
        "peak 8 x 64 MiB = 512 MiB on rank 0 exceeds the 256 MiB budget")
    assert reasons[("zb-h2", 1)] == (
        "peak 7 x 64 MiB = 448 MiB on rank 0 exceeds the 256 MiB budget")
    assert reasons[("interleaved", 2)] == (
        "peak 11 x 32 MiB chunk-activations (1/2 of 64 MiB) = 352 MiB on rank 0 exceeds the "
        "256 MiB budget")
    # 1F1B holds p - r = 4 activations on rank 0: exactly the budget, which fits. zb-auto,
    # built for these costs and this budget, finds zb-v's makespan (the least there is): the
    # tie goes to the fixed schedule; v-half holds 3 (v=1 units) for one t more than zb-v, and
    # takes less time than zb-h1; v-min holds 2 for more time.
    assert names(selection.ranked) == [("zb-v", 2), ("zb-auto", 2), ("v-half", 2),
                                       ("zb-h1", 1), ("v-min", 2), ("1f1b", 1)]
    assert [r.peak_bytes / MiB for r in selection.ranked] == [256, 256, 192, 256, 128, 256]
    assert [r.makespan for r in selection.ranked] == [25.5, 25.5, 26.5, 27, 29.5, 33]


def test_loose_budget_equal_costs_every_figure_from_the_formulas():
    selection = select_schedules(4, 8, EQUAL, activation_bytes=1 * MiB,
                                 memory_budget_bytes=1024 * MiB, candidates=FORMULA_SCHEDULES)
    assert selection.excluded == []
    want = expected_makespans(4, 8, 1, 1, 1)
    assert want[("1f1b", 1)] == 3 * (8 + 4 - 1)  # (m + p - 1)(t_F + t_B)
    got = {(r.name, r.chunks): r for r in selection.ranked}
    assert set(got) == set(want)
    for key, makespan in want.items():
        assert got[key].makespan == pytest.approx(makespan, abs=1e-9), key
        # each rank computes m (t_F + t_B) = 24 of the makespan; the bubble is the rest
        assert got[key].bubble == pytest.approx(1 - 24 / makespan, abs=1e-12), key
    # By makespan, ties to the smaller peak (activation_bytes / v per chunk-activation):
    # zb-v's 2p = 8 half-size activations before dualpipev's 2p + 1; at 27, zb-h1's p = 4
    # before interleaved v=3's 15 thirds and zb-h2's 2p - 1 = 7; gpipe's m = 8 after 1f1b's p.
    assert names(selection.ranked) == [
        ("zb-v", 2), ("dualpipev", 2), ("interleaved", 4), ("zb-h1", 1), ("interleaved", 3),
        ("zb-h2", 1), ("interleaved", 2), ("1f1b", 1), ("gpipe", 1)]
    assert [r.peak_bytes / MiB for r in selection.ranked] == [
        4, 4.5, 19 / 4, 4, 5, 7, 11 / 2, 4, 8]


def test_ranking_with_distinct_costs_follows_the_formulas():
    """t_F = 2, t_B = 3, t_W = 1 (t_I = 2): every figure from its formula, none from simulate."""
    costs = CostModel(t_f=2, t_i=2, t_w=1, t_comm=0)
    selection = select_schedules(4, 8, costs, activation_bytes=MiB, memory_budget_bytes=1e12,
                                 candidates=["gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2",
                                             "dualpipev"])
    want = expected_makespans(4, 8, 2, 2, 1)
    assert want == {("gpipe", 1): 55, ("1f1b", 1): 55, ("zb-h1", 1): 49, ("zb-h2", 1): 46,
                    ("dualpipev", 2): 44.5, ("interleaved", 2): 47.5, ("interleaved", 3): 45,
                    ("interleaved", 4): 43.75}
    got = {(r.name, r.chunks): r for r in selection.ranked}
    assert set(got) == set(want)
    for key, makespan in want.items():
        assert got[key].makespan == pytest.approx(makespan, abs=1e-9), key
        assert got[key].bubble == pytest.approx(1 - 40 / makespan, abs=1e-12), key
    assert names(selection.ranked) == [
        ("interleaved", 4), ("dualpipev", 2), ("interleaved", 3), ("zb-h2", 1),
        ("interleaved", 2), ("zb-h1", 1), ("1f1b", 1), ("gpipe", 1)]
    # a v-chunk candidate's actions cost 1/v of the rank's share; t_comm and t_overhead as
    # given: the selector's figure is simulate's with the same CostModel, nothing rescaled
    shares = CostModel(t_f=2, t_i=[1.5, 3], t_w=1, t_comm=0.1, t_overhead=0.2)
    per_stage = shares.per_stage(build_schedule("zb-v", 2, 4))  # stages 0, 3 on rank 0
    assert per_stage["t_i"] == [0.75, 1.5, 1.5, 0.75] and per_stage["t_f"] == [1.0] * 4
    assert per_stage["t_comm"] == [0.1] * 4 and per_stage["t_overhead"] == [0.2] * 4
    picked = select_schedules(2, 4, shares, MiB, 1e12, candidates=[("zb-v", 2)])
    assert picked.best.makespan == simulate(build_schedule("zb-v", 2, 4), shares).makespan


def test_interleaved_needs_m_at_least_p_and_says_so():
    selection = select_schedules(4, 2, EQUAL, activation_bytes=MiB,
                                 memory_budget_bytes=1e12, chunks_options=(2, 4))
    reasons = {(e.name, e.chunks): e.reason for e in selection.excluded}
    assert set(reasons) == {("interleaved", 2), ("interleaved", 4)}
    assert "use m >= p microbatches" in reasons[("interleaved", 2)]
    assert ("interleaved", 2) not in names(selection.ranked)
    assert ("1f1b", 1) in names(selection.ranked)


def test_candidates_and_per_rank_costs():
    scalar = select_schedules(4, 8, EQUAL, MiB, 1e12, candidates=["1f1b", ("zb-v", 2)])
    listed = select_schedules(4, 8, CostModel(t_f=[1] * 4, t_i=[1] * 4, t_w=[1] * 4), MiB,
                              1e12, candidates=["1f1b", ("zb-v", 2)])
    assert names(scalar.ranked) == [("zb-v", 2), ("1f1b", 1)]
    assert [r.makespan for r in listed.ranked] == [r.makespan for r in scalar.ranked]
    assert [r.makespan for r in scalar.ranked] == [25.5, 33]
    slow_last = select_schedules(4, 8, CostModel(t_f=[1, 1, 1, 2], t_i=1, t_w=1), MiB, 1e12,
                                 candidates=["1f1b"])
    # 1F1B with one slow stage: the first forward reaches it after 3 x 1, it then works
    # m (2 + 2) = 32 without a gap, and its last gradient goes back through 3 x 2
    assert slow_last.best.makespan == 3 + 32 + 6
    # idle: ranks 0-2 compute 8 x 3 = 24 of the 41, rank 3 32 of them
    assert slow_last.best.bubble == pytest.approx((3 * 17 + 9) / (4 * 41), abs=1e-12)
    with pytest.raises(ValueError, match="one number >= 0 per rank"):
        select_schedules(4, 8, CostModel(t_f=[1, 2]), MiB, 1e12)
    with pytest.raises(ValueError, match="unknown schedule 'zb-h3'"):
        select_schedules(4, 8, EQUAL, MiB, 1e12, candidates=["zb-h3"])


def test_nothing_fits():
    selection = select_schedules(4, 8, EQUAL, activation_bytes=64 * MiB,
                                 memory_budget_bytes=32 * MiB)
    assert selection.ranked == [] and selection.best is None
    assert len(selection.excluded) == 13  # 10 schedules + interleaved at v = 2, 3, 4


def run_cli(*args):
    """``select`` in this process (support.cli_run)."""
    return cli_in_process("select", *args, cwd=ROOT)


def test_cli_json_and_text():
    args = ["--ranks", "4", "--microbatches", "8", "--t-f", "20", "--t-i", "20", "--t-w", "20",
            "--t-comm", "0", "--activation-mb", "64", "--memory-budget-mb", "256"]
    done = run_cli(*args, "--format", "json")
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert [(r["name"], r["chunks"]) for r in data["ranked"]] == [
        ("zb-v", 2), ("zb-auto", 2), ("v-half", 2), ("zb-h1", 1), ("v-min", 2), ("1f1b", 1)]
    assert data["ranked"][5]["peak_activations"] == [4, 3, 2, 1]
    # peaks in one unit, v=1 activations; zb-v's chunk-activations are half a rank's each
    assert data["ranked"][0]["peak_activations"] == [4, 4, 4, 4]
    assert data["ranked"][0]["peak_chunk_activations"] == [8, 8, 8, 8]
    assert data["unit"] == "t"
    want = expected_makespans(4, 8, 20, 20, 20)
    by_name = {r["name"]: r["makespan"] for r in data["ranked"]}
    assert [by_name["zb-v"], by_name["zb-h1"], by_name["1f1b"]] == [
        want[("zb-v", 2)], want[("zb-h1", 1)], want[("1f1b", 1)]] == [510, 540, 660]
    assert by_name["zb-auto"] == 510  # zb-v's order: the least there is at these costs
    excluded = {(e["name"], e["chunks"]): e["reason"] for e in data["excluded"]}
    assert excluded[("zb-h2", 1)].startswith("peak 7 x 64 MiB = 448 MiB on rank 0")

    text = run_cli(*args)
    assert text.returncode == 0, text.stderr
    lines = text.stdout.splitlines()
    assert lines[0].endswith("step time in t (the unit of the costs)")
    assert lines[2].split() == ["#", "schedule", "v", "step", "time", "vs", "best", "bubble",
                                "peak", "memory", "peak", "activations", "per", "rank",
                                "(v=1", "units)"]
    assert lines[3].split() == ["1", "zb-v", "2", "510", "t", "1.000", "5.9%", "256", "MiB",
                                "[4,", "4,", "4,", "4]"]
    assert lines[8].split()[-4:] == ["[4,", "3,", "2,", "1]"]  # 1f1b
    assert "  gpipe (v=1): peak 8 x 64 MiB = 512 MiB on rank 0 exceeds the 256 MiB budget" \
        in lines


def test_cli_bad_input_is_one_line_and_exit_2():
    done = run_cli("-p", "4", "-m", "8", "--t-f", "1,2", "--activation-mb", "1",
                   "--memory-budget-mb", "10")
    assert done.returncode == 2
    assert done.stderr.startswith("error: t_f=[1.0, 2.0]") and done.stderr.count("\n") == 1


def test_whole_backward_costs_exclude_split_schedules_with_the_reason():
    """What a 1F1B run measures (t_f, t_b; the issue's numbers): the split schedules are left
    out with the reason, never predicted with a made-up t_i = t_w = 1."""
    measured = CostModel(t_f=[0.00249, 0.0025, 0.0025, 0.0026],
                         t_b=[0.00284, 0.0029, 0.0029, 0.003])
    selection = select_schedules(4, 8, measured, MiB, 1e12)
    assert names(selection.ranked) == [
        ("interleaved", 4), ("interleaved", 3), ("interleaved", 2), ("1f1b", 1), ("gpipe", 1)]
    reasons = {(e.name, e.chunks): e.reason for e in selection.excluded}
    assert set(reasons) == {("zb-h1", 1), ("zb-h2", 1), ("zb-v", 2), ("dualpipev", 2),
                            ("dualpipe", 2), ("v-half", 2), ("v-min", 2), ("zb-auto", None)}
    assert all("only whole backwards (t_b)" in r and "--assume-split" in r
               for r in reasons.values())
    assert max(r.makespan for r in selection.ranked) < 0.1  # seconds, all of them
    # an assumption, stated: the split schedules come back, with I = W = B / 2
    half = select_schedules(4, 8, assume_split(measured, 0.5), MiB, 1e12)
    assert selection.excluded and not half.excluded
    explicit = CostModel(t_f=measured.t_f, t_i=[b / 2 for b in measured.t_b],
                         t_w=[b / 2 for b in measured.t_b])
    want = {(r.name, r.chunks): r.makespan
            for r in select_schedules(4, 8, explicit, MiB, 1e12).ranked}
    assert {(r.name, r.chunks): r.makespan for r in half.ranked} == pytest.approx(want)
    # no step is shorter than the busiest rank's work, m (t_F + t_B), under any schedule
    busiest = 8 * max(f + b for f, b in zip(measured.t_f, measured.t_b))
    assert min(r.makespan for r in half.ranked) >= busiest - 1e-12


def test_per_stage_costs_are_refused():
    with pytest.raises(ValueError, match="give costs as a rank's share"):
        select_schedules(4, 8, CostModel.for_stages(t_f=1), MiB, 1e12)


def test_cli_hint_when_p_exceeds_m():
    done = run_cli("-p", "8", "-m", "4", "--activation-mb", "1", "--memory-budget-mb", "100")
    assert done.returncode == 0
    assert done.stderr == ("hint: p=8 > m=4: most ranks idle most of the step; use m >= p "
                           "(Megatron needs m >= p for interleaved)\n")
    assert "  interleaved (v=2): interleaved: microbatch_group_size_per_vp_stage=8" in done.stdout
