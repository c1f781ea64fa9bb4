"""select in bytes: sizes with units, per-rank activation bytes, the measured bytes from a
train summary.json (analysis.costs), and the old MiB flags."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from support.cli_run import cli_in_process

from megatron_pp_ext.analysis.costs import activation_bytes_per_rank, load_costs
from megatron_pp_ext.analysis.select import MiB, parse_size, select_schedules
from megatron_pp_ext.analysis.simulate import CostModel

REPO = Path(__file__).resolve().parents[1]


def _select(*args):
    """``select`` in this process (support.cli_run)."""
    return cli_in_process("select", *args, cwd=REPO)


def test_sizes_with_units():
    assert parse_size("2GiB") == 2 * 1024 ** 3
    assert parse_size("512 MiB") == 512 * MiB
    assert parse_size("1.5GB") == 1.5e9
    assert parse_size("3000000") == 3_000_000
    assert parse_size("64K") == 64 * 1024  # K/M/G alone: binary
    assert parse_size("7B") == 7
    for bad in ("2 parsecs", "", "GiB", "-1MiB"):
        with pytest.raises(ValueError, match="is not a size"):
            parse_size(bad)


def test_per_rank_activation_bytes_weigh_each_rank():
    """1F1B at p=2, m=4 holds [2, 1]: with rank 1 four times heavier per microbatch, rank 1
    decides (1 x 400 > 2 x 100)."""
    selection = select_schedules(2, 4, CostModel(t_f=1, t_i=1, t_w=1), activation_bytes=[100, 400],
                                 memory_budget_bytes=450, candidates=["1f1b", "zb-h1"])
    assert [r.name for r in selection.ranked] == ["1f1b"]
    assert selection.peak_bytes_per_rank("1f1b", 1) == [200, 400]
    (excluded,) = selection.excluded
    assert excluded.name == "zb-h1" and "on rank 1" in excluded.reason  # [2, 2] x [100, 400]
    with pytest.raises(ValueError, match="one number >= 0 per rank"):
        select_schedules(2, 4, CostModel(), activation_bytes=[1, 2, 3], memory_budget_bytes=1)


def test_a_ranks_stages_summed_by_layout():
    per_stage = [1, 10, 100, 1000]  # p=2, v=2
    assert activation_bytes_per_rank(per_stage, 2, 2, "loop") == [1 + 100, 10 + 1000]
    assert activation_bytes_per_rank(per_stage, 2, 2, "v") == [1 + 1000, 10 + 100]
    assert activation_bytes_per_rank([5, 7], 2, 1) == [5, 7]
    with pytest.raises(ValueError, match="p x v"):
        activation_bytes_per_rank([1, 2, 3], 2, 2)


def test_select_takes_the_measured_bytes_from_a_summary(tmp_path):
    summary = {"schedule": "zb-v", "pp": 2, "microbatches": 4, "chunks": 2, "layout": "v",
               "measured_costs_per_rank_s": {"t_f": [0.01, 0.01], "t_i": [0.01, 0.01],
                                             "t_w": [0.01, 0.01]},
               "activation_bytes_per_stage": [3 * MiB, 1 * MiB, 1 * MiB, 5 * MiB],
               "peak_activation_bytes": [9 * MiB, 4 * MiB]}
    path = tmp_path / "summary.json"
    path.write_text(json.dumps(summary))
    costs = load_costs(str(path))
    assert costs.activation_bytes == [8 * MiB, 2 * MiB]  # V: stages 0 + 3, 1 + 2
    assert costs.peak_activation_bytes == [9 * MiB, 4 * MiB]
    done = _select("--costs", str(path), "--memory-budget", "20MiB", "--format", "json",
                   "--schedules", "zb-v,1f1b,gpipe")
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert data["activation_bytes"] == [8 * MiB, 2 * MiB]
    assert data["memory_budget_bytes"] == 20 * MiB
    # gpipe holds all 4 on rank 0: 32 MiB > 20 MiB; 1f1b [2, 1] x [8, 2] MiB = 16 MiB fits
    assert {e["name"] for e in data["excluded"]} == {"gpipe"}
    one = next(r for r in data["ranked"] if r["name"] == "1f1b")
    assert one["peak_bytes_per_rank"] == [16 * MiB, 2 * MiB]
    text = _select("--costs", str(path), "--memory-budget", "20MiB").stdout
    assert "activation [8 MiB, 2 MiB] (per rank) per microbatch per rank, measured" in text
    # a size of your own overrides the measurement; the old MiB flags still work
    own = json.loads(_select("--costs", str(path), "--activation", "1MiB", "--memory-budget-mb",
                             "20", "--format", "json", "--schedules", "gpipe").stdout)
    assert own["activation_bytes"] == MiB and own["activation_bytes_from"] == "given"
    assert [r["name"] for r in own["ranked"]] == ["gpipe"]


def test_select_needs_a_budget_and_an_activation():
    done = _select("-p", "2", "-m", "4", "--activation", "1MiB")
    assert done.returncode != 0 and "needs a memory budget" in done.stderr
    done = _select("-p", "2", "-m", "4", "--memory-budget", "1GiB")
    assert done.returncode != 0 and "activation bytes" in done.stderr
    done = _select("-p", "2", "-m", "4", "--activation", "1MiB", "--memory-budget", "lots")
    assert done.returncode != 0 and "is not a size" in done.stderr
    both = _select("-p", "2", "-m", "4", "--activation", "1MiB", "--memory-budget", "1GiB",
                   "--memory-budget-mb", "3")
    assert both.returncode != 0 and "not allowed with" in both.stderr
