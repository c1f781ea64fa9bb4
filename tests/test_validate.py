"""The validator: every builder's output passes; hand-broken schedules fail with messages that
name the rank and the action; the shared activation rule."""

import sys
from pathlib import Path

import pytest

import megatron_pp_ext
from megatron_pp_ext.schedules.validate import (
    activation_trace,
    check_deadlock,
    execute_in_order,
    explain_blocked,
    peak_activations,
    peer_messages,
    validate_schedule,
)
from megatron_pp_ext.ir import Action, Schedule, ScheduleError
from megatron_pp_ext.schedules import REGISTRY, build_schedule


def make(rows, stage_to_rank=None, m=None, name="hand"):
    """A schedule from rows of text actions; loop placement (stage s on rank s % p) by default."""
    actions = [[Action.parse(t) for t in row.split()] for row in rows]
    p = len(rows)
    if stage_to_rank is None:
        stages = 1 + max(a.stage for row in actions for a in row)
        stage_to_rank = [s % p for s in range(stages)]
    if m is None:
        m = 1 + max(a.microbatch for row in actions for a in row)
    return Schedule(name, m, stage_to_rank, actions)


def edited(schedule, rank, edit):
    """A copy of ``schedule`` whose row ``rank`` (as text) is replaced by ``edit(row)``."""
    rows = [" ".join(row) for row in schedule.text()]
    rows[rank] = " ".join(edit(rows[rank].split()))
    return make(rows, schedule.stage_to_rank, schedule.num_microbatches)


def split_1f1b(p, m):
    """1F1B with every B written as I then W: a valid split-backward schedule."""
    rows = []
    for row in build_schedule("1f1b", p, m).text():
        out = []
        for t in row:
            out += [t.replace("B", "I"), t.replace("B", "W")] if "B" in t else [t]
        rows.append(" ".join(out))
    return make(rows)


def rejects(schedule, *fragments):
    with pytest.raises(ScheduleError) as info:
        validate_schedule(schedule)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, message
    return message


# ---------------------------------------------------------------- every builder passes
@pytest.mark.parametrize("name", list(REGISTRY))
def test_every_builder_validates(name):
    spec = REGISTRY[name]
    built = rejected = 0
    # zb-auto searches (each build plays its candidates): p 1..6 x m 1..12 at both layouts,
    # with the message time where its own orders win, and no refinement (refine keeps a
    # schedule that plays, so it cannot break one)
    synthesized = name == "zb-auto"
    options = {"t_comm": 0.3, "effort": 0} if synthesized else {}
    for p in range(1, 7 if synthesized else 9):
        for m in range(1, 13 if synthesized else 33):
            for v in (1, 2, 3):
                if not spec.allowed_chunks(v):
                    continue
                try:
                    schedule = spec.builder(p, m, chunks=v, **options)
                except ScheduleError as exc:
                    # a combination the builder does not allow: the message says which values
                    message = str(exc)
                    assert name in message, message
                    named = (f"p={p}", f"m={m}", f"v={v}")
                    assert any(value in message for value in named), message
                    rejected += 1
                    continue
                assert schedule.num_ranks == p and schedule.num_microbatches == m
                validate_schedule(schedule)
                built += 1
    # interleaved (v = 2, 3; default group p) needs m to be a multiple of p: sum over p = 1..8
    # of 32 // p = 85 sizes, twice; dualpipe needs an even p (m = 1: the first direction
    # alone): 4 x 32 built, the 4 x 32 odd-p sizes rejected; every other builder takes all
    # 8 x 32 sizes at its one v
    want = {"interleaved": (170, 342), "zb-auto": (144, 0),
            "dualpipe": (128, 128)}.get(name, (256, 0))
    assert (built, rejected) == want


def test_registry_rejects_disallowed_chunks_naming_v():
    with pytest.raises(ScheduleError, match=r"interleaved: chunks v=1 is not allowed"):
        build_schedule("interleaved", 4, 8, 1)
    with pytest.raises(ScheduleError, match=r"1f1b: chunks v=2 is not allowed"):
        build_schedule("1f1b", 4, 8, 2)


def test_interleaved_disallowed_sizes_name_the_values():
    with pytest.raises(ScheduleError, match=r"m=3"):
        build_schedule("interleaved", 4, 3, 2)
    with pytest.raises(ScheduleError, match=r"m=9 mod .* p=4"):
        build_schedule("interleaved", 4, 9, 2)


def test_forward_only_is_valid_and_holds_nothing():
    schedule = build_schedule("1f1b", 4, 8, forward_only=True)
    validate_schedule(schedule)
    assert peak_activations(schedule) == [0, 0, 0, 0]


# ---------------------------------------------------------------- counts and placement
BASE = build_schedule("1f1b", 4, 8)


def test_missing_action_is_named():
    rejects(edited(BASE, 2, lambda r: [t for t in r if t != "2B5"]), "rank 2 is missing 2B5")


def test_missing_forward_is_named():
    rejects(edited(BASE, 1, lambda r: [t for t in r if t != "1F7"]), "rank 1 is missing 1F7")


def test_duplicate_is_named():
    rejects(edited(BASE, 0, lambda r: r[:4] + ["0F3"] + r[4:]), "rank 0 runs 0F3 twice")


def test_action_on_the_wrong_rank():
    rejects(edited(BASE, 0, lambda r: r + ["1F0"]), "rank 0 runs 1F0, but stage 1 lives on rank 1")


def test_microbatch_and_stage_out_of_range():
    rejects(edited(BASE, 0, lambda r: r + ["0F8"]), "rank 0 runs 0F8: microbatch 8 does not exist",
            "0..7")
    rejects(edited(BASE, 3, lambda r: r + ["4F0"]), "rank 3 runs 4F0: stage 4 does not exist")


def test_split_backward_missing_w_and_mixed_b():
    split = split_1f1b(2, 2)
    validate_schedule(split)
    rejects(edited(split, 1, lambda r: [t for t in r if t != "1W1"]), "rank 1 is missing 1W1")
    rejects(edited(split, 0, lambda r: [t for t in r if t not in ("0I1", "0W1")]),
            "rank 0 is missing 0I1 and 0W1")
    rejects(edited(split, 0, lambda r: r + ["0B1"]), "rank 0 runs both 0B1 and 0I1")


# ---------------------------------------------------------------- local order
def test_backward_before_its_forward():
    # the last rank alternates 3F0 3B0 ...: swap the first pair
    broken = edited(BASE, 3, lambda r: [r[1], r[0]] + r[2:])
    rejects(broken, "rank 3 runs 3B0 before 3F0")


def test_w_before_i():
    split = split_1f1b(2, 3)
    rejects(edited(split, 1, lambda r: _swap(r, "1I2", "1W2")), "rank 1 runs 1W2 before 1I2")


def _swap(row, a, b):
    i, j = row.index(a), row.index(b)
    row = list(row)
    row[i], row[j] = row[j], row[i]
    return row


def test_forward_before_the_forward_it_needs_on_the_same_rank():
    # interleaved with p=1: stages 0 and 1 both on rank 0; 1F0 placed before 0F0 can have run
    schedule = build_schedule("interleaved", 1, 2, 2)
    broken = edited(schedule, 0, lambda r: _swap(r, "0F0", "1F0"))
    rejects(broken, "rank 0 runs 1F0 before 0F0, whose output it needs")


def test_backward_before_the_backward_it_needs_on_the_same_rank():
    schedule = build_schedule("interleaved", 1, 2, 2)
    assert schedule.text()[0] == ["0F0", "1F0", "1B0", "0F1", "0B0", "1F1", "1B1", "0B1"]
    broken = edited(schedule, 0, lambda r: _swap(r, "1B0", "0B0"))
    rejects(broken, "rank 0 runs 0B0 before the backward of stage 1, microbatch 0")


# ---------------------------------------------------------------- message order
def test_peer_order_mismatch_names_both_ranks_and_orders():
    schedule = make(["0F0 0F1 0B0 0B1", "1F1 1B1 1F0 1B0"])
    validate_schedule(schedule)  # our executor receives in the sender's order
    message = rejects_pair(
        schedule, "ranks 0 and 1 disagree", "rank 0 sends to rank 1 [act 0->1 mb0, act 0->1 mb1]",
        "rank 1 receives from rank 0 [act 0->1 mb1, act 0->1 mb0]",
    )
    assert "first difference at message #0" in message


def test_peer_order_checks_both_kinds_on_one_channel():
    # p=2 interleaved: rank 1 sends activations (stage 1->2) and gradients (1->0) to rank 0
    schedule = build_schedule("interleaved", 2, 4, 2)
    sends, receives = peer_messages(schedule)
    kinds = {msg[0] for msg in sends[(1, 0)]}
    assert kinds == {"act", "grad"}
    assert sends == receives


def rejects_pair(schedule, *fragments):
    with pytest.raises(ScheduleError) as info:
        validate_schedule(schedule, channels="pair")
    for fragment in fragments:
        assert fragment in str(info.value)
    return str(info.value)


def test_peer_csv_validates_but_needs_separate_channels_per_kind_under_pair_matching():
    from pathlib import Path

    csv = (Path(__file__).parent / "data" / "torch_zb1p_2rank_2stagep_compute.csv").read_text()
    schedule = Schedule.from_csv(csv)
    validate_schedule(schedule)
    rejects_pair(schedule, "ranks 0 and 1 disagree on the order of their messages",
            "message #4", "grad 2->1 mb0, act 0->1 mb2", "act 0->1 mb2, grad 2->1 mb0")
    validate_schedule(schedule, channels="kind")
    with pytest.raises(ValueError, match="channels='tags' must be one of sender, pair, kind"):
        validate_schedule(schedule, channels="tags")


# ---------------------------------------------------------------- deadlock
DEADLOCK_2 = ["0F0 0B0 0F1 0B1", "1F0 1F1 1B0 1B1"]  # messages agree, yet each waits on the other


def test_two_ranks_waiting_on_each_other():
    schedule = make(DEADLOCK_2)
    assert peer_messages(schedule)[0] == peer_messages(schedule)[1]  # passes the message check
    message = rejects(
        schedule, "deadlock between ranks 0 -> 1 -> 0",
        "rank 0 waits in 0B0 for 1B0 on rank 1", "rank 1 waits in 1F1 for 0F1 on rank 0",
    )
    assert "also blocked" not in message


def test_deadlock_cycle_excludes_ranks_merely_blocked_behind_it():
    schedule = make(DEADLOCK_2 + ["2F0 2B0 2F1 2B1"], stage_to_rank=[0, 1, 2])
    message = rejects(schedule, "deadlock between ranks 0 -> 1 -> 0",
                      "also blocked behind them: ranks [2]")
    assert "rank 2 waits" not in message


def test_three_rank_cycle():
    # forward-only, interleaved layout p=3 v=2 (stage 2 on rank 2 feeds stage 3 on rank 0);
    # every pair agrees on its message order, yet 0 waits for 2, 2 for 1 and 1 for 0.
    schedule = make(
        ["3F0 0F0 0F1 3F1", "4F0 1F0 1F1 4F1", "5F0 2F0 2F1 5F1"],
        stage_to_rank=[0, 1, 2, 0, 1, 2],
    )
    sends, receives = peer_messages(schedule)
    assert sends == receives
    rejects(schedule, "deadlock between ranks 0 -> 2 -> 1 -> 0",
            "rank 0 waits in 3F0 for 2F0 on rank 2; rank 2 waits in 5F0 for 4F0 on rank 1; "
            "rank 1 waits in 4F0 for 3F0 on rank 0")


def test_waiting_for_an_action_that_never_exists():
    # check_deadlock on its own (validate_schedule reports the missing action first)
    schedule = make(["0F1 0B1", "1F0 1B0 1F1 1B1"], m=2)
    with pytest.raises(ScheduleError, match=r"rank 1 waits in 1F0 for 0F0, which no rank runs"):
        check_deadlock(schedule)
    rejects(schedule, "rank 0 is missing 0F0")


def test_explain_blocked_reports_a_self_wait():
    schedule = make(["1F0 0F0 1B0 0B0"], stage_to_rank=[0, 0])
    position = execute_in_order(schedule)
    assert position == [0]
    with pytest.raises(ScheduleError, match="rank 0 waits in 1F0 for 0F0, which rank 0 itself"):
        explain_blocked(schedule, position)


def test_check_order_counts_before_local_before_messages():
    # missing and out of order: the missing action is reported
    broken = edited(BASE, 3, lambda r: [r[1], r[0]] + [t for t in r[2:] if t != "3B7"])
    rejects(broken, "rank 3 is missing 3B7")


# ---------------------------------------------------------------- activations held
def test_activation_trace_1f1b_rank0():
    peak, counts = activation_trace(BASE.actions[0])
    assert peak == 4
    assert counts == [1, 2, 3, 4, 3, 4, 3, 4, 3, 4, 3, 4, 3, 2, 1, 0]
    assert peak_activations(BASE) == [4, 3, 2, 1]


def test_activation_trace_split_backward_frees_at_w():
    actions = [Action.parse(t) for t in "0F0 0F1 0I0 0I1 0W0 0W1".split()]
    assert activation_trace(actions) == (2, [1, 2, 2, 2, 1, 0])


def test_gpipe_holds_every_microbatch():
    assert peak_activations(build_schedule("gpipe", 4, 8)) == [8, 8, 8, 8]


def _lines_executed_in_the_package(call) -> int:
    """Python lines run inside megatron_pp_ext during ``call()``: a measure of work that does
    not depend on the machine's speed (sys.settrace counts every line event)."""
    package = str(Path(megatron_pp_ext.__file__).parent)
    count = 0

    def local(frame, event, arg):
        nonlocal count
        count += event == "line"
        return local

    before = sys.gettrace()
    sys.settrace(lambda frame, event, arg:
                 local if frame.f_code.co_filename.startswith(package) else None)
    try:
        call()
    finally:
        sys.settrace(before)
    return count


@pytest.mark.parametrize("channels", ["sender", "pair"])
def test_validation_is_linear(channels):
    """The work per action stays the same when the schedule grows 4x (in m, then in p); an
    O(n^2) step would double it at each doubling."""
    per_action = []
    for p, m in ((16, 64), (16, 128), (32, 128)):
        schedule = build_schedule("interleaved", p, m, 2, validate=False)
        actions = sum(len(row) for row in schedule.actions)
        lines = _lines_executed_in_the_package(lambda: validate_schedule(schedule, channels))
        per_action.append(lines / actions)
    assert max(per_action) / min(per_action) < 1.05, per_action
