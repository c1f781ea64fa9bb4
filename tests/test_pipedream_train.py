"""``train --schedule pipedream|pipedream-2bw``: the tiny Megatron-Core GPT over gloo processes
through the asynchronous path, and the checks made before any process starts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_pp_ext.train.settings import TrainSettings
from support.train_cli import run_train_all

REPO = Path(__file__).resolve().parents[1]



def test_2bw_and_pipedream_train_the_tiny_gpt(tmp_path):
    """2BW's first batch runs on the initial weights on every stage, exactly as 1F1B's first
    step: the same loss. PipeDream stashes p - r versions on rank r; 2BW 2."""
    runs = {}
    commands = (("1f1b", ["--steps", "1", "--no-trace"]),
                ("pipedream-2bw", ["--steps", "3"]),
                ("pipedream", ["--steps", "3"]),
                ("pipedream-vs", ["--steps", "3", "--vertical-sync", "--no-trace"]))
    procs = run_train_all(*[["--schedule", name.replace("-vs", ""), "-p", "2", "-m", "2",
                             "--out", str(tmp_path / name), *extra]
                            for name, extra in commands])  # side by side
    for (name, _), proc in zip(commands, procs):
        out = tmp_path / name
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        for words in ("UserWarning", "FutureWarning", "Apex is not installed", "deprecated"):
            assert words not in proc.stdout + proc.stderr, words
        runs[name] = (proc, json.loads((out / "summary.json").read_text()))
    first = runs["1f1b"][1]["losses"][0]
    for name in ("pipedream-2bw", "pipedream", "pipedream-vs"):
        proc, summary = runs[name]
        assert summary["schedule"] == name.replace("-vs", "") and summary["steps"] == 3
        assert len(summary["losses"]) == 3 and len(summary["losses_per_microbatch"]) == 6
        lines = [l for l in proc.stdout.splitlines() if l.startswith("[") and "loss" in l]
        assert len(lines) == 3, proc.stdout
        assert "staleness:" in proc.stdout
        assert all(b > 0 for b in summary["stashed_weight_bytes_per_rank"])
    two = runs["pipedream-2bw"][1]
    page = (tmp_path / "pipedream-2bw" / "timeline.html").read_text()  # --trace: the default
    assert "1B5" in page and "<svg" in page
    assert 0 <= two["bubble_measured"] < 1 and 0 <= two["bubble_predicted"] < 1
    assert two["losses"][0] == pytest.approx(first, rel=1e-6)
    # and every batch's loss equals the 2BW rule's on one process (pp = 1, same weights)
    from megatron_pp_ext.train.processes import spawn
    from support.pipedream_gpt import reference_2bw_losses

    (want,) = spawn(1, reference_2bw_losses, 3, 2, timeout_s=120)
    assert two["losses"] == pytest.approx(want, rel=1e-5)
    assert two["versions_held_per_rank"] == [2, 2]
    assert two["updates_per_stage"] == 3
    pd = runs["pipedream"][1]
    # the same 1F1B order holds the same activations: the executor's measured saved-tensor
    # bytes (the weight versions are not activations) are 1F1B's
    assert pd["peak_activation_bytes"] == pytest.approx(
        runs["1f1b"][1]["peak_activation_bytes"], rel=1e-3)
    assert pd["versions_held_per_rank"] == [2, 1]
    assert pd["updates_per_stage"] == 6
    vs = runs["pipedream-vs"][1]
    assert vs["vertical_sync"] is True and vs["versions_held_per_rank"] == [2, 2]
    assert "vertical sync" in runs["pipedream-vs"][0].stdout
    # with vertical sync microbatches 0 and 1 (p = 2) run on the initial weights: 2BW's batch 0
    assert vs["losses"][0] == pytest.approx(two["losses"][0], rel=1e-6)
    # microbatch 0 runs on the initial weights everywhere: 1F1B's first microbatch's loss
    assert pd["losses_per_microbatch"][0] == pytest.approx(
        two["losses_per_microbatch"][0], rel=1e-6)


@pytest.mark.parametrize("kwargs,match", [
    (dict(schedule="pipedream-2bw", pp=4, microbatches=2), r"m=2 .* >= p=4"),
    (dict(schedule="pipedream-2bw", vertical_sync=True), "PipeDream's option"),
    (dict(schedule="pipedream", chunks=2), "one model chunk per rank"),
])
def test_settings_refuse_before_any_process(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TrainSettings(**kwargs).check()


def test_settings_accept_the_async_names_in_any_case():
    settings = TrainSettings(schedule="PipeDream", pp=4, microbatches=4, steps=3,
                             vertical_sync=True)
    settings.check()
    assert settings.schedule == "pipedream" and settings.is_async and settings.v == 1
    schedule = settings.first_step_schedule()
    assert schedule.num_microbatches == 12
    assert schedule.options["weight_update"]["vertical_sync"] is True
