"""``plan`` against NVIDIA's published Megatron-Core runs (``support.published_recipes``): each
ran on its GPUs, so every rank of its plan fits (the model's bytes and the reserve in the
GPU's memory), and the plan's FLOPs per token are the summary's TFLOP/s over its tokens/s
within 3% (both count Megatron's model FLOPs: 6 per weight per token, the causal half of the
core attention, the output layer over the padded vocabulary). A configuration that cannot fit
still says so; ``select`` keeps NVIDIA's own choice for the 70B run among those that fit."""

from __future__ import annotations

import dataclasses
import shlex

import pytest

from support.published_recipes import RUNS, planned


@pytest.mark.parametrize("run", RUNS, ids=[f"{r.name} {r.world_size}x{r.gpu}" for r in RUNS])
def test_a_published_run_fits_and_its_flops_per_token_are_the_summarys(run):
    plan, per_token = planned(run)
    over = {r: -rank.headroom for r, rank in enumerate(plan.memory) if not rank.fits}
    assert not over, f"{run.name} on {run.gpu} ran, but the plan puts ranks over by {over} B"
    assert per_token == pytest.approx(run.flops_per_token, rel=0.03)


def test_the_70b_run_at_tp_2_does_not_fit():
    """The same recipe with half the tensor parallelism: twice the activations and weights per
    rank, over 80 GB on every rank (rank 0, the embedding's, by the most)."""
    run = RUNS[0]
    at_tp2 = dataclasses.replace(run, argv=run.argv.replace("--tensor-model-parallel-size 4",
                                                            "--tensor-model-parallel-size 2"))
    plan, _ = planned(at_tp2)
    assert plan.tp == 2 and not any(rank.fits for rank in plan.memory)
    assert -plan.memory[0].headroom > 40 * 2**30


def test_select_keeps_nvidias_choice_for_the_70b_run_among_those_that_fit():
    from megatron_pp_ext.planner.pretrain_select import select_pretrain

    run = RUNS[0]
    selection = select_pretrain(run.args, gpu=run.gpu, world_size=run.world_size,
                                candidates=["interleaved", "1f1b", "zb-h2"])
    fits = {plan.name: plan.v for plan in selection.ranked}
    assert fits == {"interleaved": 5, "1f1b": 1}  # zb-h2 holds too many microbatches
    assert [plan.name for plan in selection.too_big] == ["zb-h2"]
    assert selection.best.name == "interleaved"


@pytest.mark.parametrize("schedule", ["zb-v", "dualpipev"])
def test_the_405b_run_under_a_v_schedule_keeps_its_split_on_the_first_and_last_stage(schedule):
    """The 405B recipe's --account-for-embedding/loss-in-pipeline-split under a V schedule
    (v=2: 16 stages of 126 layers + the embedding + the loss, 8 slots each): the embedding's
    and the loss's stage hold 7 decoder layers, the others 8, and the plan names the layout
    string the drop-in builds (before issue 42 the V schedules refused the recipe)."""
    run = dataclasses.replace(
        RUNS[1], schedule=schedule,
        argv=RUNS[1].argv.replace("--num-virtual-stages-per-pipeline-rank 8",
                                  "--num-virtual-stages-per-pipeline-rank 2"))
    plan, per_token = planned(run)
    assert [stage.decoder for stage in plan.stages] == [7] + [8] * 14 + [7]
    assert plan.to_dict()["pipeline_model_parallel_layout"] == "Et*7|(t*8|)*14,t*7L"
    assert any("--account-for-embedding-in-pipeline-split --account-for-loss-in-pipeline-split,"
               " applied to the first and the last V stage" in note for note in plan.notes)
    assert plan.memory[0].static < plan.memory[1].static  # rank 0: 14 layers, the others 16
    assert per_token == pytest.approx(run.flops_per_token, rel=0.03)


def test_select_trades_recompute_for_schedule_on_the_70b_run_at_tp_2():
    """At tp 2 the 70B recipe fits under 1F1B only with full recompute of most of each
    stage's layers; v-min (about half of 1F1B's activations) fits with none, and its step is
    shorter by more than any bubble: the search puts it first and prints its flags. The
    recompute is priced from its FLOPs: block n adds n of a stage's L layers' forward to its
    backward."""
    from megatron_pp_ext.planner.pretrain_select import (flags_to_drop, flags_to_set,
                                                              select_pretrain)

    run = RUNS[0]
    argv = shlex.split(run.argv.replace("--tensor-model-parallel-size 4",
                                        "--tensor-model-parallel-size 2"))
    selection = select_pretrain(argv, gpu=run.gpu, world_size=run.world_size,
                                candidates=["1f1b", "v-min"], search_recompute=True)
    rows = {plan.name: plan for plan in selection.ranked}
    assert [plan.name for plan in selection.ranked] == ["v-min", "1f1b"]
    assert rows["v-min"].recompute_flags == []
    one_f_one_b = rows["1f1b"].recompute_flags
    assert one_f_one_b[:4] == ["--recompute-granularity", "full", "--recompute-method", "block"]
    n = int(one_f_one_b[-1])
    assert 1 <= n < 10 and rows["1f1b"].activations.recompute == "full"
    assert flags_to_set(selection, selection.best) == [
        "--pipeline-schedule", "v-min", "--num-virtual-stages-per-pipeline-rank", "2"]
    assert flags_to_drop(selection, selection.best) == []
    # 1F1B's row: its recompute set, the recipe's virtual stages (vp 5) dropped
    assert flags_to_set(selection, rows["1f1b"]) == ["--pipeline-schedule", "1f1b",
                                                     *one_f_one_b]
    assert flags_to_drop(selection, rows["1f1b"]) == ["--num-virtual-stages-per-pipeline-rank"]
    # the cheapest that fits: one layer fewer recomputed does not fit
    fewer = select_pretrain(argv[:] + one_f_one_b[:-1] + [str(n - 1)], gpu=run.gpu,
                            world_size=run.world_size, candidates=["1f1b"])
    assert fewer.too_big and not fewer.ranked
    plain = select_pretrain(argv, gpu=run.gpu, world_size=run.world_size,
                            candidates=["1f1b"]).too_big[0]
    middle = 3  # 10 decoder layers, no embedding nor loss
    added = rows["1f1b"].stage_costs["t_i"][middle] - plain.stage_costs["t_i"][middle]
    assert added == pytest.approx(n / 10 * plain.stage_costs["t_f"][middle], rel=1e-9)


def test_scale_out_plans_the_same_model_at_n_times_the_data_parallel_size():
    from megatron_pp_ext.planner.pretrain_select import select_pretrain

    run = RUNS[0]
    selection = select_pretrain(run.args, gpu=run.gpu, world_size=run.world_size,
                                candidates=["1f1b", "interleaved"], scale_out=8)
    for plan in selection.ranked + selection.too_big:
        assert (plan.world_size, plan.dp, plan.m) == (512, 16, 16)
    assert {plan.v for plan in selection.ranked if plan.name == "interleaved"} == {5}


def test_recompute_settings_go_from_none_to_every_layer():
    from megatron_pp_ext.planner.pretrain_select import recompute_label, recompute_settings

    assert [recompute_label(flags) for flags in recompute_settings(3)] == [
        "none", "selective", "full block 1", "full block 2", "full uniform 1"]


def test_a_recompute_the_search_does_not_need_is_named_to_drop():
    """The 70B recipe fits without recompute: given full recompute, the search's 1F1B row sets
    none and names the recompute flags (and the recipe's virtual stages) to drop, in the text
    line and the JSON."""
    from megatron_pp_ext.planner.pretrain_select import (
        command_line_changes, flags_to_drop, select_pretrain, selection_dict)

    run = RUNS[0]
    argv = run.args + ["--recompute-granularity", "full", "--recompute-method", "uniform",
                       "--recompute-num-layers", "1"]
    selection = select_pretrain(argv, gpu=run.gpu, world_size=run.world_size,
                                candidates=["1f1b"], search_recompute=True)
    row = selection.best
    assert row.name == "1f1b" and row.recompute_flags == []
    drop = ["--num-virtual-stages-per-pipeline-rank", "--recompute-granularity",
            "--recompute-method", "--recompute-num-layers"]
    assert flags_to_drop(selection, row) == drop
    assert command_line_changes(selection, row) == ("--pipeline-schedule 1f1b; drop "
                                                    + " ".join(drop))
    json_row = selection_dict(selection)["ranked"][0]
    assert json_row["flags_to_set"] == ["--pipeline-schedule", "1f1b"]
    assert json_row["flags_to_drop"] == drop and json_row["recompute"] == "none"
