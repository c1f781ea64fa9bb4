"""The schedule IR: action text, CSV / JSON forms, PyTorch's CSV files, and 1F1B's order."""

from pathlib import Path

import pytest

from megatron_pp_ext.schedules.validate import validate_schedule
from megatron_pp_ext.ir import Action, Schedule, ScheduleError, parse_cell
from megatron_pp_ext.schedules import REGISTRY, build_schedule

DATA = Path(__file__).parent / "data"
PEER_CSV = DATA / "torch_zb1p_2rank_2stagep_compute.csv"


def built_schedules():
    """(name, p, m, v) of every registered builder over a few sizes it allows (interleaved,
    with its default group of p microbatches, needs m to be a multiple of p; test_validate
    checks the rejections)."""
    cases = []
    for name, spec in REGISTRY.items():
        for p in (1, 2, 4):
            for m in (1, 3, 8):
                for v in (1, 2, 3):
                    if not spec.allowed_chunks(v):
                        continue
                    if name == "interleaved" and m % p:
                        continue
                    if name == "dualpipe" and (p % 2 or m < 2):  # even p, both directions
                        continue
                    cases.append((name, p, m, v))
    return cases


def test_the_round_trip_covers_every_builder():
    counts = {name: sum(1 for case in built_schedules() if case[0] == name) for name in REGISTRY}
    # 9 sizes at one v; interleaved: (1,1) (1,3) (1,8) (2,8) (4,8) at v = 2 and 3; zb-auto
    # at v = 1 and 2; dualpipe: p = 2, 4 at m = 3, 8
    assert counts == {"gpipe": 9, "1f1b": 9, "interleaved": 10, "zb-h1": 9, "zb-h2": 9,
                      "zb-v": 9, "dualpipev": 9, "dualpipe": 4, "v-half": 9, "v-min": 9,
                      "zb-auto": 18}


def test_action_text_both_ways():
    assert Action.parse("0F3") == Action(0, "F", 3)
    assert Action.parse(" 12 W 7 ") == Action(12, "W", 7)
    assert str(Action(5, "I", 2)) == "5I2"
    for text in ("0F3", "5I2", "5W2", "63B511"):
        assert str(Action.parse(text)) == text


@pytest.mark.parametrize("bad", ["0X3", "F3", "0F", "-1F2", "0F3x", ""])
def test_action_parse_rejects(bad):
    with pytest.raises(ScheduleError, match="cannot parse action"):
        Action.parse(bad)


def test_action_rejects_bad_kind():
    with pytest.raises(ScheduleError, match="kind 'X' is not one of F, B, I, W"):
        Action(0, "X", 1)


def test_cells():
    assert parse_cell("") == []
    assert parse_cell("  ") == []
    assert parse_cell("2W5") == [Action(2, "W", 5)]
    assert parse_cell("(0F7;7B3)OVERLAP_F_B") == [Action(0, "F", 7), Action(7, "B", 3)]
    with pytest.raises(ScheduleError, match="communication is derived"):
        parse_cell("0SEND_F1")


@pytest.mark.parametrize("name,p,m,v", built_schedules())
def test_csv_and_json_round_trip_exact(name, p, m, v):
    schedule = build_schedule(name, p, m, v)
    text = schedule.to_csv()
    loaded = Schedule.from_csv(text)
    assert loaded.to_csv() == text
    assert loaded.actions == schedule.actions
    assert loaded.stage_to_rank == schedule.stage_to_rank
    assert loaded.num_microbatches == m
    again = Schedule.from_json(schedule.to_json())
    assert again.to_dict() == schedule.to_dict()


def test_peer_csv_loads_with_legacy_b_as_i():
    schedule = Schedule.from_csv(PEER_CSV.read_text())
    assert schedule.num_ranks == 2 and schedule.num_microbatches == 8
    assert schedule.stage_to_rank == (0, 1, 0, 1)
    assert schedule.chunks == 2
    # every (stage, mb) has F, I and W: 2 stages x 8 microbatches x 3 per rank
    assert [len(row) for row in schedule.actions] == [48, 48]
    assert not any(a.kind == "B" for row in schedule.actions for a in row)
    assert schedule.actions[0][:6] == [Action.parse(t) for t in "0F0 0F1 2F0 2F1 2I0 2W0".split()]
    assert schedule.actions[1][:4] == [Action.parse(t) for t in "1F0 1F1 3F0 3I0".split()]


def test_composite_cells_expand_in_order_and_validate():
    # V layout p=2: rank 0 holds stages 0 and 3, rank 1 holds 1 and 2.
    text = (
        "0F0,0F1,3F0,(3F1;3B0)OVERLAP_F_B,3B1,0B0,0B1\n"
        "1F0,1F1,2F0,2F1,2B0,2B1,1B0,1B1\n"
    )
    schedule = Schedule.from_csv(text)
    assert schedule.stage_to_rank == (0, 1, 1, 0)
    assert [str(a) for a in schedule.actions[0]] == [
        "0F0", "0F1", "3F0", "3F1", "3B0", "3B1", "0B0", "0B1"
    ]
    validate_schedule(schedule)


def test_csv_rejects_a_stage_on_two_ranks():
    with pytest.raises(ScheduleError, match="stage 0 appears on rank 0 and on rank 1"):
        Schedule.from_csv("0F0,0B0\n0F1,0B1\n")


def test_1f1b_rank0_order_p4_m8():
    schedule = build_schedule("1f1b", 4, 8)
    assert " ".join(map(str, schedule.actions[0])) == (
        "0F0 0F1 0F2 0F3 0B0 0F4 0B1 0F5 0B2 0F6 0B3 0F7 0B4 0B5 0B6 0B7"
    )


def test_1f1b_last_rank_alternates_from_its_first_action():
    schedule = build_schedule("1f1b", 4, 8)
    last = schedule.actions[3]
    assert [a.kind for a in last] == ["F", "B"] * 8
    assert [a.microbatch for a in last] == [mb for mb in range(8) for _ in (0, 1)]


@pytest.mark.parametrize("p,m", [(4, 2), (8, 3), (3, 1), (5, 4)])
def test_1f1b_fewer_microbatches_than_ranks(p, m):
    schedule = build_schedule("1f1b", p, m)
    for rank, row in enumerate(schedule.actions):
        warmup = min(p - 1 - rank, m)
        kinds = "".join(a.kind for a in row)
        steady = m - warmup
        assert kinds == "F" * warmup + "FB" * steady + "B" * warmup, (rank, kinds)


def test_1f1b_p4_m2_exact():
    schedule = build_schedule("1f1b", 4, 2)
    assert schedule.text() == [
        ["0F0", "0F1", "0B0", "0B1"],
        ["1F0", "1F1", "1B0", "1B1"],
        ["2F0", "2F1", "2B0", "2B1"],
        ["3F0", "3B0", "3F1", "3B1"],
    ]
