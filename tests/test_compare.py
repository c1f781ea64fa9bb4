"""``compare``: every schedule side by side for one p, m and set of costs; the p > m hint."""

import json
import re
import sys
from pathlib import Path

import pytest

from support.cli_run import cli_in_process

from megatron_pp_ext.analysis.simulate import CostModel, simulate
from megatron_pp_ext.commands.hints import p_exceeds_m_hint
from megatron_pp_ext.schedules import REGISTRY, build_schedule

HINT = ("hint: p=8 > m=4: most ranks idle most of the step; use m >= p "
        "(Megatron needs m >= p for interleaved)")


def cli(*args):
    """The command in this process (support.cli_run: what it prints and returns)."""
    return cli_in_process(*args)


def test_every_schedule_side_by_side_with_units():
    done = cli("compare", "-p", "4", "-m", "8")
    assert done.returncode == 0 and done.stderr == "", done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("costs in t (cost units), a rank's share of one microbatch: "
                               "t_f=1 t_i=1 t_w=1 t_b=t_i+t_w")
    start = lines.index("p=4 m=8: step time in t, the unit of the costs")
    assert lines[start + 1].split() == ["schedule", "v", "step", "time", "vs", "fastest",
                                        "bubble", "peak", "activations", "per", "rank",
                                        "(v=1", "units)"]
    rows = {line.split()[0]: line for line in lines[start + 2:start + 2 + len(REGISTRY)]}
    assert list(rows) == list(REGISTRY)
    # dualpipe is the fastest here: p/2 - 1 = 1 slot of idle per rank, at p + 1 = 5 whole-part
    # activations (and every parameter twice)
    assert rows["1f1b"].split() == ["1f1b", "1", "33", "t", "1.320", "27.3%",
                                    "[4,", "3,", "2,", "1]"]
    assert rows["zb-v"].split() == ["zb-v", "2", "25.5", "t", "1.020", "5.9%",
                                    "[4,", "4,", "4,", "4]"]
    assert rows["dualpipe"].split() == ["dualpipe", "2", "25", "t", "1.000", "4.0%",
                                        "[5,", "5,", "5,", "5]"]
    assert rows["interleaved"].split()[:4] == ["interleaved", "2", "28.5", "t"]
    assert lines[start + 2 + len(REGISTRY)].startswith("(v=1 units: one microbatch's")


def test_json_figures_are_the_simulators_with_the_same_costs():
    done = cli("compare", "-p", "4", "-m", "16", "--t-f", "2", "--t-i", "2", "--t-w", "1",
               "--t-comm", "0.1", "--format", "json")
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert data["unit"] == "t" and data["not_compared"] == []
    costs = CostModel(t_f=2, t_i=2, t_w=1, t_comm=0.1)
    fastest = min(row["step_time"] for row in data["schedules"])
    for row in data["schedules"]:
        # zb-auto is built for these costs, with no budget (compare shows every peak)
        synthesized = dict(t_f=2, t_i=2, t_w=1, t_comm=0.1, activation=0,
                           memory_budget=float("inf")) if row["schedule"] == "zb-auto" else {}
        timeline = simulate(build_schedule(row["schedule"], 4, 16, row["chunks"],
                                           **synthesized), costs)
        assert row["step_time"] == pytest.approx(timeline.makespan, abs=1e-9)
        assert row["bubble"] == pytest.approx(timeline.bubble_fraction, abs=1e-12)
        assert row["peak_chunk_activations"] == timeline.peak_activations
        assert row["peak_activations"] == [n / timeline.chunks  # dualpipe: whole parts, 1
                                           for n in timeline.peak_activations]
        assert row["vs_fastest"] == pytest.approx(row["step_time"] / fastest)
    assert [row["schedule"] for row in data["schedules"]] == list(REGISTRY)


def test_out_writes_one_page_with_every_timeline(tmp_path):
    page = tmp_path / "compare.html"
    done = cli("compare", "-p", "4", "-m", "8", "--out", str(page))
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == f"wrote {page}"
    html = page.read_text()
    for name in REGISTRY:
        assert name in html, name


def test_p_above_m_hint_and_what_cannot_be_compared():
    assert p_exceeds_m_hint(8, 4) == HINT
    assert p_exceeds_m_hint(4, 4) is None and p_exceeds_m_hint(None, 4) is None
    done = cli("compare", "-p", "8", "-m", "4", "--activation-mb", "10")
    assert done.returncode == 0
    assert done.stderr == HINT + "\n"
    out = done.stdout
    assert "not compared:\n  interleaved (v=2): interleaved: microbatch_group_size" in out
    assert re.search(r"^1f1b +1 +33 t .*\[4, 4, 4, 4, 4, 3, 2, 1\] +40 MiB$", out, re.M)
    demo = cli("demo", "-p", "8", "-m", "4")
    assert demo.returncode == 0 and demo.stderr == HINT + "\n"
    assert "not shown: interleaved: " in demo.stdout


def test_measured_costs_compare_without_split_schedules(tmp_path):
    sys.path.insert(0, str(Path(__file__).parent))
    from test_costs_input import B, F, T_COMM, fake_run

    summary, _ = fake_run(tmp_path, "1f1b")
    done = cli("compare", "--costs", str(summary), "--format", "json")
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert (data["ranks"], data["microbatches"], data["unit"]) == (4, 8, "s")
    assert [row["schedule"] for row in data["schedules"]] == ["gpipe", "1f1b", "interleaved"]
    assert {e["name"] for e in data["not_compared"]} == {"zb-h1", "zb-h2", "zb-v", "dualpipev",
                                                         "dualpipe", "v-half", "v-min",
                                                         "zb-auto"}
    want = simulate(build_schedule("1f1b", 4, 8), CostModel(t_f=F, t_b=B, t_comm=T_COMM))
    assert data["schedules"][1]["step_time"] == pytest.approx(want.makespan, abs=1e-9)
    text = cli("compare", "--costs", str(summary)).stdout
    assert f"1f1b         1  {want.makespan * 1e3:.3f} ms" in text
