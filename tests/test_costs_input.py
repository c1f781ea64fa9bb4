"""Measured costs in: ``select``/``simulate``/``compare --costs FILE`` read what a run wrote
(train's summary.json and trace.json, a measured timeline) as a rank's share per microbatch, in
seconds; a run that measured only whole backwards never predicts the split schedules unless an
assumption is stated.

The runs here are made with the producers ``train`` itself uses (``train.measure.costs_per_rank``
and ``train.report.write_outputs``) on a measured timeline with known per-stage costs, so every
figure read back is known in advance.
"""

import json
from pathlib import Path

import pytest

from support.cli_run import cli_in_process

from megatron_pp_ext.analysis.costs import load_costs
from megatron_pp_ext.analysis.render import render_chrome_trace
from megatron_pp_ext.analysis.simulate import CostModel, simulate
from megatron_pp_ext.schedules import build_schedule

T_COMM = 0.0005
# 1f1b at p=4: stage = rank
F = [0.004, 0.005, 0.006, 0.007]
B = [0.008, 0.009, 0.010, 0.011]
# zb-v at p=4: rank r holds stages r and 7 - r; both chunks of a rank cost the same here
V_F = [0.002, 0.0025, 0.003, 0.0035]
V_I = [0.0015, 0.002, 0.0025, 0.003]
V_W = [0.001, 0.001, 0.0015, 0.0015]


def per_stage_v(values):
    return [values[min(s, 7 - s)] for s in range(8)]


def fake_run(folder: Path, name: str) -> tuple[Path, object]:
    """Write what ``train --schedule NAME --pp 4 --microbatches 8`` writes, for a step that
    took exactly the known costs (and T_COMM per message)."""
    from megatron_pp_ext.train.measure import costs_per_rank
    from megatron_pp_ext.train.report import write_outputs

    schedule = build_schedule(name, 4, 8)
    if name == "1f1b":
        costs = CostModel.for_stages(t_f=F, t_b=B, t_comm=T_COMM)
    else:
        costs = CostModel.for_stages(t_f=per_stage_v(V_F), t_i=per_stage_v(V_I),
                                     t_w=per_stage_v(V_W), t_comm=T_COMM)
    measured = simulate(schedule, costs)
    measured.source, measured.unit = "measured", "s"
    summary = {"schedule": name, "auto_choice": None, "pp": 4, "microbatches": 8,
               "chunks": schedule.chunks, "steps": 3,
               "measured_costs_per_rank_s": costs_per_rank(schedule, measured)}
    write_outputs(str(folder), summary, None, measured)
    return folder / "summary.json", measured


def cli(*args):
    """The command in this process (support.cli_run: what it prints and returns)."""
    return cli_in_process(*args)


def one_line_error(done, fragment):
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert done.stdout == "" and done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith("error: ") and fragment in done.stderr, done.stderr


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("runs")
    return {name: fake_run(base / name, name) for name in ("1f1b", "zb-v")}


# ---------------------------------------------------------------- reading the files
def test_summary_trace_and_timeline_give_the_same_per_rank_seconds(runs, tmp_path):
    summary, measured = runs["1f1b"]
    timeline_file = tmp_path / "timeline.json"
    timeline_file.write_text(json.dumps(measured.to_dict()))
    for path in (summary, summary.with_name("trace.json"), timeline_file):
        costs = load_costs(str(path))
        assert costs.num_ranks == 4 and costs.num_microbatches == 8, path
        assert costs.t_f == pytest.approx(F, abs=1e-9) and costs.t_b == pytest.approx(B, abs=1e-9)
        assert (costs.t_i, costs.t_w, costs.split) == (None, None, False)
        assert costs.t_comm == pytest.approx(T_COMM, abs=1e-9), path  # from the waits
    assert load_costs(str(summary)).t_comm_from == str(summary.with_name("trace.json"))
    assert load_costs(str(summary)).schedule == "1f1b"


def test_a_split_run_gives_i_and_w_summed_over_the_ranks_chunks(runs):
    summary, _ = runs["zb-v"]
    for path in (summary, summary.with_name("trace.json")):
        costs = load_costs(str(path))
        assert costs.split and costs.t_b is None and costs.chunks == 2
        # a rank's share: its two chunks' means added
        assert costs.t_f == pytest.approx([2 * x for x in V_F], abs=1e-9)
        assert costs.t_i == pytest.approx([2 * x for x in V_I], abs=1e-9)
        assert costs.t_w == pytest.approx([2 * x for x in V_W], abs=1e-9)


def test_whole_backwards_only_refuses_the_split_unless_assumed(runs):
    costs = load_costs(str(runs["1f1b"][0]))
    model = costs.cost_model()
    assert not model.split_known
    with pytest.raises(ValueError, match="zb-h1 splits the backward"):
        simulate(build_schedule("zb-h1", 4, 8), model)
    assumed = costs.cost_model(assume=0.25)
    assert assumed.t_i == pytest.approx([0.25 * b for b in B])
    assert assumed.t_w == pytest.approx([0.75 * b for b in B])
    with pytest.raises(ValueError, match="applies only to a run that measured whole backwards"):
        load_costs(str(runs["zb-v"][0])).cost_model(assume=0.5)
    text = costs.describe()
    assert "only whole backwards (B) were measured" in text and "4.000 ms" in text
    assert "I and W are NOT measured: assumed I = 0.25 B" in costs.describe(0.25)


def test_files_that_cannot_give_costs_are_refused_with_the_reason(runs, tmp_path):
    summary = json.loads(runs["1f1b"][0].read_text())
    summary["measured_costs_per_rank_s"] = None  # train --no-trace
    untraced = tmp_path / "summary.json"
    untraced.write_text(json.dumps(summary))
    with pytest.raises(ValueError, match="not traced; run train without --no-trace"):
        load_costs(str(untraced))
    predicted = tmp_path / "predicted.json"
    predicted.write_text(json.dumps(render_chrome_trace(simulate(build_schedule("1f1b", 2, 2)))))
    with pytest.raises(ValueError, match="predicted trace in cost units"):
        load_costs(str(predicted))
    garbage = tmp_path / "garbage.json"
    garbage.write_text("F=1 B=2")
    with pytest.raises(ValueError, match="is not JSON"):
        load_costs(str(garbage))
    with pytest.raises(OSError, match="cannot read costs file"):
        load_costs(str(tmp_path / "missing.json"))


# ---------------------------------------------------------------- the commands
def test_select_costs_from_a_1f1b_run(runs):
    summary = str(runs["1f1b"][0])
    done = cli("select", "--costs", summary, "--activation-mb", "1", "--memory-budget-mb",
               "1000", "--format", "json")
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert (data["ranks"], data["microbatches"], data["unit"]) == (4, 8, "s")
    excluded = {e["name"]: e["reason"] for e in data["excluded"]}
    assert set(excluded) == {"zb-h1", "zb-h2", "zb-v", "dualpipev", "dualpipe", "v-half",
                             "v-min", "zb-auto"}
    assert all("only whole backwards" in reason for reason in excluded.values())
    want = simulate(build_schedule("1f1b", 4, 8), CostModel(t_f=F, t_b=B, t_comm=T_COMM))
    got = {r["name"]: r["makespan"] for r in data["ranked"] if r["chunks"] == 1}
    assert got["1f1b"] == pytest.approx(want.makespan, abs=1e-9)

    text = cli("select", "--costs", summary, "--activation-mb", "1", "--memory-budget-mb",
               "1000")
    assert text.returncode == 0, text.stderr
    out = text.stdout
    assert "  rank         F          B" in out
    assert "     0  4.000 ms   8.000 ms" in out
    assert "message latency t_comm = 0.500 ms (measured in" in out
    assert f"1f1b         1  {want.makespan * 1e3:.3f} ms" in out
    assert "step time in ms (from measured seconds)" in out

    assumed = cli("select", "--costs", summary, "--assume-split", "0.5", "--activation-mb", "1",
                  "--memory-budget-mb", "1000", "--format", "json")
    assert assumed.returncode == 0, assumed.stderr
    data = json.loads(assumed.stdout)
    assert data["excluded"] == [] and data["assume_split"] == 0.5
    zb_h1 = simulate(build_schedule("zb-h1", 4, 8), CostModel(
        t_f=F, t_i=[b / 2 for b in B], t_w=[b / 2 for b in B], t_comm=T_COMM))
    got = {r["name"]: r["makespan"] for r in data["ranked"]}
    assert got["zb-h1"] == pytest.approx(zb_h1.makespan, abs=1e-9)


def test_simulate_costs_round_trip_and_refusals(runs):
    summary, measured = runs["zb-v"]
    # the same schedule under its own measured costs: the measured step again
    done = cli("simulate", "--costs", str(summary), "--schedule", "zb-v", "--format", "json")
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert (data["ranks"], data["microbatches"], data["unit"]) == (4, 8, "s")
    assert data["makespan"] == pytest.approx(measured.makespan, abs=1e-9)
    ascii_ = cli("simulate", "--costs", str(summary), "--schedule", "1f1b", "-m", "4")
    assert ascii_.returncode == 0, ascii_.stderr
    assert ascii_.stdout.startswith("measured costs of a zb-v run (p=4, m=8, v=2), from ")
    assert "1f1b p=4 m=4 v=1 (predicted)" in ascii_.stdout

    one_f_one_b = str(runs["1f1b"][0])
    one_line_error(cli("simulate", "--costs", one_f_one_b, "--schedule", "zb-v"),
                   "zb-v splits the backward into I (input gradient) and W")
    one_line_error(cli("simulate", "--costs", one_f_one_b, "--schedule", "1f1b", "-p", "8"),
                   "has costs of 4 pipeline ranks, not -p 8")
    one_line_error(cli("simulate", "--costs", one_f_one_b, "--schedule", "1f1b", "--t-f", "1"),
                   "give --costs FILE or --t-f, not both")
    one_line_error(cli("select", "--costs", str(summary), "--assume-split", "0.5",
                       "--activation-mb", "1", "--memory-budget-mb", "10"),
                   "--assume-split applies only to a run that measured whole backwards")
    one_line_error(cli("select", "--costs", one_f_one_b, "--assume-split", "2",
                       "--activation-mb", "1", "--memory-budget-mb", "10"),
                   "give the fraction of B that is I, between 0 and 1")
