"""dualpipe, DeepSeek's bidirectional DualPipe: its order against DeepSeek's own, the two
directions in the IR, its cost-model figures, the runtime under NCCL's rules, and the data
each chunk reads.

DeepSeek's order: ``tests/data/dualpipe_reference_orders.json`` holds what DeepSeek's
``DualPipe.step`` (deepseek-ai/DualPipe, dualpipe/dualpipe.py) computes on every rank at
p = 2, 4, 6, 8 and four m each, recorded by ``scripts/dualpipe_reference_order.py`` from their
checkout (their step runs unchanged; only its compute and communication calls are recorders).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megatron_pp_ext.analysis.lowering import runtime_program
from megatron_pp_ext.analysis.simulate import CostModel, simulate
from megatron_pp_ext.integration.direction_data import (
    direction_iterators,
    finish_step,
    select_microbatch,
)
from megatron_pp_ext.ir import Action, Schedule, ScheduleError
from megatron_pp_ext.schedules import build_schedule, schedule_layout
from megatron_pp_ext.schedules.validate import peak_activations, validate_schedule
from support.inmemory import assert_equals_pp1, reference_gradients, run_inmemory

REFERENCE = json.loads(
    (Path(__file__).parent / "data" / "dualpipe_reference_orders.json").read_text())
EQUAL = CostModel.for_stages(t_f=1, t_i=1, t_w=1, t_b=2, t_comm=0)


def _as_reference(schedule: Schedule, rank: int) -> list[str]:
    """Our rank's actions in the reference's words: kind, direction, index in the direction."""
    split = schedule.second_direction_from
    out = []
    for action in schedule.actions[rank]:
        direction = int(action.microbatch >= split)
        out.append(f"{action.kind} {direction} {action.microbatch - direction * split}")
    return out


@pytest.mark.parametrize("case", sorted(REFERENCE["orders"]))
def test_order_is_deepseeks(case):
    p, m = (int(x[1:]) for x in case.split("_"))
    schedule = build_schedule("dualpipe", p, m)
    for rank, want in enumerate(REFERENCE["orders"][case]):
        assert _as_reference(schedule, rank) == want, (case, rank)


def test_the_reference_covers_the_sizes():
    assert len(REFERENCE["orders"]) == 15
    assert "DualPipe.step" in REFERENCE["source"]


def test_two_directions_in_the_ir():
    schedule = build_schedule("dualpipe", 4, 8)
    assert schedule_layout(schedule) == "dual"
    assert schedule.stage_to_rank == (0, 1, 2, 3, 3, 2, 1, 0)
    assert (schedule.model_stages, schedule.path_chunks, schedule.chunks) == (4, 1, 2)
    assert [schedule.path(mb) for mb in (0, 3, 4, 7)] == [range(0, 4)] * 2 + [range(4, 8)] * 2
    # stage 4 + k is part k again: entered at rank 3, left at rank 0
    assert [schedule.model_stage(s) for s in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert [s for s in range(8) if schedule.is_entry(s)] == [0, 4]
    assert schedule.exit_stages() == [3, 7]
    assert (schedule.upstream(4), schedule.downstream(3), schedule.downstream(4)) == (None,
                                                                                     None, 5)
    again = Schedule.from_json(schedule.to_json())
    assert again.path(5) == range(4, 8)
    validate_schedule(again, channels="pair")


def test_validator_holds_each_microbatch_to_its_direction():
    schedule = build_schedule("dualpipe", 2, 4)
    rows = [list(row) for row in schedule.actions]
    # rank 0's second-direction forward of microbatch 2 moved to its first-direction stage
    rows[0] = [Action(0, "F", 2) if a == Action(3, "F", 2) else a for a in rows[0]]
    bad = Schedule("dualpipe", 4, schedule.stage_to_rank, rows, dict(schedule.options))
    with pytest.raises(ScheduleError, match="runs 0F2, but microbatch 2 crosses stages 2..3 "
                                            "only"):
        validate_schedule(bad)


@pytest.mark.parametrize("p,m,words", [
    (3, 6, "p=3 pipeline ranks: DualPipe pairs rank r with rank p-1-r"),
])
def test_sizes_it_cannot_build_are_refused(p, m, words):
    with pytest.raises(ScheduleError, match=words):
        build_schedule("dualpipe", p, m)


@pytest.mark.parametrize("forward_only", [False, True])
def test_one_microbatch_runs_in_the_first_direction_alone(forward_only):
    """m = 1 (a --step-batch-size-schedule's first steps, an evaluation's default batch under
    one): the first direction carries it, the second is empty; each rank runs its part once,
    as Megatron's 1F1B runs it (pretrain_gpt.py's loop: tests/test_pretrain_gpt_script.py)."""
    schedule = build_schedule("dualpipe", 4, 1, forward_only=forward_only)
    validate_schedule(schedule)
    assert schedule.options["second_direction_from"] == 1
    kinds = {rank: ("F" if forward_only else "FB") for rank in range(4)}
    if not forward_only:  # DualPipe's order splits the last part's backward into I and W
        kinds[3] = "FIW"
    assert [[(a.stage, a.kind, a.microbatch) for a in row] for row in schedule.actions] == [
        [(rank, kind, 0) for kind in kinds[rank]] for rank in range(4)]


@pytest.mark.parametrize("p", [2, 4, 6, 8])
@pytest.mark.parametrize("factor", [2, 3, 4])
def test_cost_model_figures(p, factor):
    """t_F = t_I = t_W = 1, t_B = 2, no message time, pairs one after the other: every rank
    works 3m and idles p/2 - 1 (DualPipeV, whose chunks are half parts, idles (p - 1)/2 at the
    same p), within DeepSeek's bubble (PP/2 - 1)(F&B + B - 3W) = (p/2 - 1) x 2; each
    rank holds p + 1 whole-part activations (DeepSeek's table: PP + 1), as many as 1F1B's
    first rank plus one; every channel matches in order."""
    m = factor * p
    schedule = build_schedule("dualpipe", p, m)
    validate_schedule(schedule, channels="kind")
    timeline = simulate(schedule, EQUAL)
    assert timeline.makespan == 3 * m + p // 2 - 1
    assert timeline.makespan - 3 * m <= (p // 2 - 1) * 2
    assert peak_activations(schedule) == [p + 1] * p
    dualpipev = simulate(build_schedule("dualpipev", p, m), CostModel(t_f=1, t_i=1, t_w=1,
                                                                         t_comm=0))
    assert dualpipev.makespan == 3 * m + (p - 1) / 2


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 5), (4, 3), (4, 1), (6, 12)])
def test_programs_pass_nccl_rules_and_compute_pp1_gradients(p, m):
    """Lowered for NCCL (both postings: one action at a time, and DualPipe's lockstep rounds
    with its F&B pairs), checked against NCCL's rules, and run on the fabric that enforces
    them: the gradient of each part (its two copies summed) and every loss equal the pp = 1
    run's. m < 2p and an odd m: each direction built for max(ceil(m/2), p), cut (m = 1: the
    second direction empty)."""
    schedule = build_schedule("dualpipe", p, m)
    for pairs in (False, True):
        runtime_program(schedule, batched=True, prefetch=False, overlapped_pairs=pairs,
                        variable_shapes=False)
    assert_equals_pp1(run_inmemory(schedule, nccl_rules=True), schedule, f"p={p} m={m}")
    results = run_inmemory(schedule, nccl_rules=True, pairs=True)
    assert_equals_pp1(results, schedule, f"p={p} m={m} pairs")
    if m >= 2 * p:
        assert all(work.pairs for _, work in results)


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (6, 12)])
def test_the_pair_exchange_gives_both_copies_the_summed_gradient_under_nccls_rules(p, m):
    """The drop-in's pair exchange (``stage_copies.sum_stage_copies``: rank r and p-1-r, one
    batch each, both parts' gradients in part order), run after the step over the fabric that
    enforces NCCL's rules: every copy of part k holds the pp = 1 gradient of part k, and the
    two copies hold the same bits (a + b on one rank, b + a on the other)."""
    schedule = build_schedule("dualpipe", p, m)
    results = run_inmemory(schedule, nccl_rules=True, sum_copies=True)
    want, _ = reference_gradients(schedule.model_stages, m)
    copies = {}
    for _, work in results:
        for stage, grad in work.gradients().items():
            copies.setdefault(schedule.model_stage(stage), []).append(grad)
    assert sorted(copies) == list(range(p))
    for part, (first, second) in sorted(copies.items()):
        assert torch.equal(first, second), f"part {part}: its copies differ"
        torch.testing.assert_close(first, want[part], rtol=1e-12, atol=1e-12)
    # without the exchange a copy holds one direction's share: not the whole gradient
    alone = run_inmemory(schedule, nccl_rules=True)
    half = next(work for _, work in alone).gradients()[0]
    assert not torch.allclose(half, want[0], rtol=1e-6, atol=1e-9)


def test_each_chunk_reads_its_directions_batches():
    """Rank 0 of p = 2, m = 4: chunk 0 (stage 0) takes microbatches 0, 1, chunk 1 (stage 3)
    microbatches 2, 3; with one iterator per chunk each is read up to the step's 4 batches,
    with one shared iterator it is read 4 times in all."""
    schedule = build_schedule("dualpipe", 2, 4)
    separate = [iter(range(100)), iter(range(100))]
    iterators, readers = direction_iterators(schedule, 0, separate)
    for stage, mb in ((0, 0), (3, 2), (0, 1), (3, 3)):
        chunk = schedule.stages_of(0).index(stage)
        select_microbatch(iterators[chunk], mb)
        assert next(iterators[chunk]) == mb
    finish_step(readers)
    assert [next(it) for it in separate] == [4, 4]  # the next step starts at batch 4
    shared = iter(range(100))
    iterators, readers = direction_iterators(schedule, 0, [shared, shared])
    select_microbatch(iterators[1], 2)
    assert next(iterators[1]) == 2
    select_microbatch(iterators[0], 0)
    assert next(iterators[0]) == 0
    finish_step(readers)
    assert next(shared) == 4
    untouched = [iter(range(100)), None]  # a middle stage that reads nothing
    _, readers = direction_iterators(schedule, 1, untouched)
    finish_step(readers)
    assert next(untouched[0]) == 0
