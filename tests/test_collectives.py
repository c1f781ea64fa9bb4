"""The collectives an action issues inside its compute (an MoE layer's all-to-alls on the
expert group), recorded in the lowered program, and the check that the ranks of an expert
group issue them in one order (``analysis.collectives``; issue 26, item 2). Pure: no torch.
The runtime's check over a real expert group is in tests/test_moe.py."""

import pytest

from megatron_pp_ext.analysis.collectives import (
    check_same_sequence,
    issued,
    moe_collectives,
    with_collectives,
)
from megatron_pp_ext.analysis.lowering import lower
from megatron_pp_ext.program import Collective, Compute
from megatron_pp_ext.schedules import build_schedule

A2A = "all_to_all"


def test_an_moe_layer_issues_three_all_to_alls_each_way_and_none_in_w():
    table = moe_collectives({0: 2, 1: 0})
    forward = [c.what for c in table[0, "F"]]
    assert forward == ["MoE layer 0 dispatch tokens", "MoE layer 0 dispatch probs",
                       "MoE layer 0 combine", "MoE layer 1 dispatch tokens",
                       "MoE layer 1 dispatch probs", "MoE layer 1 combine"]
    # the backward runs the layers in reverse, each layer's combine first
    backward = [c.what for c in table[0, "I"]]
    assert backward == ["MoE layer 1 combine (gradient)", "MoE layer 1 dispatch (gradient)",
                        "MoE layer 1 dispatch (gradient)", "MoE layer 0 combine (gradient)",
                        "MoE layer 0 dispatch (gradient)", "MoE layer 0 dispatch (gradient)"]
    assert table[0, "B"] == table[0, "I"] and table[0, "W"] == ()
    assert {c.group for c in table[0, "F"]} == {"expert"} and {c.op for c in table[0, "F"]} == {A2A}
    assert (1, "F") not in table  # a dense stage issues nothing


def test_the_lowered_program_records_each_actions_collectives():
    """zb-h1 at p=2, m=4, two MoE layers per stage: each F and I carries 6 all-to-alls, each W
    none; a rank issues 48 in a step, in its action order; the steps and batches are the
    program's own."""
    schedule = build_schedule("zb-h1", 2, 4)
    program = lower(schedule)
    recorded = with_collectives(program, moe_collectives({0: 2, 1: 2}))
    for rank in (0, 1):
        assert len(recorded.steps[rank]) == len(program.steps[rank])
        for plain, step in zip(program.steps[rank], recorded.steps[rank]):
            if isinstance(step, Compute):
                assert len(step.collectives) == (0 if step.action[1] == "W" else 6), step
            else:
                assert step is plain
        sequence = issued(recorded, rank)
        assert len(sequence) == 4 * (6 + 6)
        actions = list(dict.fromkeys(action for action, _ in sequence))
        assert actions == [str(a) for a in schedule.actions[rank] if a.kind != "W"]
    assert "1F0 {6 all_to_all on the expert group}" in recorded.text(1).splitlines()
    assert issued(program, 0) == []  # the dense program issues none


def _issued(name, p, m, layers, rank=0):
    """What ``rank`` of schedule ``name`` issues on the expert group, from its program."""
    per_action = moe_collectives({s: layers for s in range(p)})
    return issued(with_collectives(lower(build_schedule(name, p, m)), per_action), rank)


def _expert_group(schedules, p=2, m=4, layers=4):
    """{replica: what stage 0's rank of that replica issues on the expert group}."""
    return {replica: _issued(name, p, m, layers) for replica, name in enumerate(schedules)}


def test_replicas_running_1f1b_and_zb_h1_issue_the_same_all_to_alls():
    """zb-h1 puts an I where 1F1B puts a B and adds W's, which issue nothing: the order on
    the expert group is the same, so such replicas are accepted (and would run)."""
    check_same_sequence(_expert_group(["1f1b", "zb-h1"]))


def test_replicas_running_1f1b_and_gpipe_are_refused_at_the_first_difference():
    with pytest.raises(ValueError) as refused:
        check_same_sequence(_expert_group(["1f1b", "gpipe"]))
    assert str(refused.value).startswith(
        "the ranks of one expert group would issue its collectives in different orders: at "
        "collective #25 on that group, rank 0 issues all_to_all on the expert group (MoE layer 3 "
        "combine (gradient)) in action 0B0 and rank 1 issues all_to_all on the expert group "
        "(MoE layer 0 dispatch tokens) in action 0F2 (96 and 96 in a step).")


def test_a_replica_with_fewer_microbatches_is_refused_where_it_stops():
    sequences = {0: _issued("1f1b", 2, 4, 1), 1: _issued("1f1b", 2, 3, 1)}
    with pytest.raises(ValueError, match=r"at collective #16 on that group, rank 0 issues "
                       r"all_to_all on the expert group \(MoE layer 0 dispatch tokens\) in "
                       r"action 0F3 and rank 1 issues all_to_all on the expert group \(MoE "
                       r"layer 0 combine \(gradient\)\) in action 0B2 \(24 and 18 in a step\)"):
        check_same_sequence(sequences)


def test_a_collective_prints_what_it_is():
    assert str(Collective("expert", A2A, "MoE layer 1 combine")) == (
        "all_to_all on the expert group (MoE layer 1 combine)")
