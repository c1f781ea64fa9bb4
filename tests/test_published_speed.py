"""``plan``'s tokens/s per GPU against every H100 and B200 row of NVIDIA's published runs whose
model it expresses (``support.published_recipes.SPEED_RUNS``): one constant per GPU kind (the
GEMMs' share of the peak, ``step_terms.CALIBRATION``) fitted on one named row, every other row
out of sample. The figures are ``docs/planning.md``'s table; the rows inside the issue's bounds
(dense +-10%, MoE +-20%) are named here, so a model change that moves a row in or out fails
until the docs say so."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from support.published_recipes import (CALIBRATION_ROWS, SPEED_RUNS, calibration_key,
                                       predicted, speed_error)

DOCS = Path(__file__).resolve().parents[1] / "docs" / "planning.md"
#: The rows docs/planning.md lists as within the bound (dense 10%, MoE 20%)
DENSE_WITHIN = {"R04", "R17", "R27", "R35", "R44", "R45", "R51", "R56", "R57", "R62"}
MOE_WITHIN = {"R02", "R10", "R12", "R22", "R23", "R32", "R33", "R43", "R55"}


def _row(rid: str):
    return next(run for run in SPEED_RUNS if run.name.split()[0] == rid)


def _is_moe(run) -> bool:
    return "--num-experts" in run.args


def test_each_gpu_kind_is_fitted_on_the_row_the_code_names():
    """At CALIBRATION's share each kind's row is predicted at its published tokens/s (the
    prediction grows with the share, so that share is the one fitted there), and the text
    beside the constant names that row."""
    from megatron_pp_ext.planner.step_terms import CALIBRATION

    assert sorted(CALIBRATION) == sorted(CALIBRATION_ROWS) == ["B200", "H100"]
    for kind, rid in CALIBRATION_ROWS.items():
        run = _row(rid)
        assert calibration_key(run) == kind
        assert abs(speed_error(run)) < 1e-3, (rid, speed_error(run))
        model = run.name.split(" ", 1)[1]
        _, fitted_on = CALIBRATION[kind]
        assert fitted_on.startswith(f"{model}, {run.world_size} {run.gpu}")
        assert f"({run.tokens_per_s_per_gpu:g} tokens/s/GPU)" in fitted_on


def _documented_speeds() -> dict[str, float]:
    """docs/planning.md's speed table: row id -> plan's tokens/s per GPU."""
    found = {}
    for line in DOCS.read_text().splitlines():
        match = re.match(r"\| (R\d\d) .*?\| [\d.]+ \| (\d+) \| [+-][\d.]+% \|", line)
        if match:
            found[match.group(1)] = float(match.group(2))
    return found


def test_every_row_is_predicted_as_the_docs_table_says():
    documented = _documented_speeds()
    assert sorted(documented) == sorted(run.name.split()[0] for run in SPEED_RUNS)
    for run in SPEED_RUNS:
        speed, _ = predicted(run)
        assert speed == pytest.approx(documented[run.name.split()[0]], rel=5e-3), run.name


def test_the_rows_within_the_bounds_are_the_documented_ones():
    within = {run.name.split()[0] for run in SPEED_RUNS
              if abs(speed_error(run)) <= (0.2 if _is_moe(run) else 0.1)}
    assert within == DENSE_WITHIN | MOE_WITHIN
    assert {rid for rid in within if not _is_moe(_row(rid))} == DENSE_WITHIN
    text = DOCS.read_text()
    for rid in sorted(within):
        assert f"{rid}," in text or f"{rid} " in text  # named in the docs' lists


def test_the_step_is_priced_on_the_named_machine(capsys):
    """``--machine``: a preset or the user's node; a slower NIC lengthens the pipeline's
    messages between nodes and nothing inside a node; a bad spec or a GPU that disagrees is a
    usage error before anything runs."""
    from megatron_pp_ext.cli import main

    run = _row("R17")
    base = ["plan", "--schedule", run.schedule, "--world-size", str(run.world_size)]
    steps = {}
    for machine in ("DGX-H100", "H100:8:450:25"):
        assert main([*base, "--machine", machine, "--", *run.args]) == 0
        out = capsys.readouterr().out
        terms = re.search(r"step on rank (\d+) \(the busiest\), ms: (.*)", out)
        steps[machine] = dict(re.findall(r"([a-zA-Z -]+?) ([\d.e+]+)(?:, |$)", terms.group(2)))
        assert f"on {machine}, GEMMs at 0.552 of the fp8 peak" in out
    fast, slow = steps["DGX-H100"], steps["H100:8:450:25"]
    assert float(slow["bubble and pipeline messages"]) > float(
        fast["bubble and pipeline messages"])
    assert {k: v for k, v in slow.items() if k != "bubble and pipeline messages"} == {
        k: v for k, v in fast.items() if k != "bubble and pipeline messages"}
    assert main([*base, "--machine", "H100:8:450", "--", *run.args]) == 2
    assert "GPU:GPUS_PER_NODE:NVLINK_GBPS:NETWORK_GBPS" in capsys.readouterr().err
    assert main([*base, "--gpu", "B200", "--machine", "DGX-H100", "--", *run.args]) == 2
    assert "--gpu B200 and --machine DGX-H100 (H100) disagree" in capsys.readouterr().err
