"""Zero-bubble family builders: zb-h1, zb-h2, zb-v, dualpipev.

Every schedule goes through two independent checks: a small checker of our own (counts, local
order, per-peer message order, deadlock freedom by running the lists) and the project's
``schedules.validate.validate_schedule`` with ``channels="pair"``: messages between two ranks,
activations and gradients mixed, matched in each side's own action order (the strictest rule;
the executor's default, receiving in the sender's order, accepts every such schedule). The
cost-model facts are measured by our own eager run and cross-checked against
``analysis.simulate.simulate`` with t_F = t_I = t_W = 1, t_B = 2, t_comm = 0. DualPipeV's
figures are also checked against DualPipe's published table with distinct costs, by a second
eager run of our own (``eager_run``) that can run DualPipe's overlapped F&B pairs as one unit.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass

import pytest

from megatron_pp_ext.analysis.simulate import CostModel, simulate
from megatron_pp_ext.schedules.validate import validate_schedule
from megatron_pp_ext.ir import Schedule, ScheduleError
from megatron_pp_ext.schedules import REGISTRY, build_schedule
from megatron_pp_ext.schedules._common import loop_placement, v_placement
from megatron_pp_ext.schedules.dualpipev import build_dualpipev
from megatron_pp_ext.schedules.one_f_one_b import build_1f1b
from megatron_pp_ext.schedules.zb_v import build_zb_v
from megatron_pp_ext.schedules.zero_bubble import (
    StuckError,
    build_zb_h1,
    build_zb_h2,
    kind_first,
    merge_streams,
)

BUILDERS = {
    "zb-h1": build_zb_h1,
    "zb-h2": build_zb_h2,
    "zb-v": build_zb_v,
    "dualpipev": build_dualpipev,
}
COSTS = {"F": 1, "I": 1, "W": 1, "B": 2}
EQUAL = CostModel.for_stages(t_f=1, t_i=1, t_w=1, t_b=2, t_comm=0)  # per action of a stage


# ---------------------------------------------------------------- our own checker + eager run
@dataclass
class Run:
    """What running every rank's list eagerly did (times in cost-model units)."""

    first_start: list
    last_end: list
    busy: list
    peak_held: list  # microbatch-stages held from the end of F to the end of W (or B)
    peak_full: list  # ... from the end of F to the end of I (or B): full activations
    peak_pending_w: list  # I's whose W has not run

    @property
    def makespan(self) -> float:
        return max(self.last_end) - min(self.first_start)

    @property
    def idle(self) -> list:
        return [self.makespan - b for b in self.busy]

    @property
    def bubble_fraction(self) -> float:
        return sum(self.idle) / (len(self.busy) * self.makespan)

    @property
    def window_idle(self) -> list:
        """Idle time inside each rank's own first-start .. last-end window."""
        return [e - s - b for s, e, b in zip(self.first_start, self.last_end, self.busy)]


def _messages(action, schedule: Schedule):
    """(rank received from, rank sent to, message received, message sent); None where local."""
    s, kind, mb = action.stage, action.kind, action.microbatch
    rank, last = schedule.rank_of(s), schedule.num_stages - 1
    if kind == "F":
        src = schedule.rank_of(s - 1) if s > 0 else None
        dst = schedule.rank_of(s + 1) if s < last else None
        recv, send = ("act", s - 1, mb), ("act", s, mb)
    elif kind in ("I", "B"):
        src = schedule.rank_of(s + 1) if s < last else None
        dst = schedule.rank_of(s - 1) if s > 0 else None
        recv, send = ("grad", s + 1, mb), ("grad", s, mb)
    else:
        return None, None, None, None
    return (src if src != rank else None), (dst if dst != rank else None), recv, send


def check_schedule(schedule: Schedule, forward_only: bool = False) -> Run:
    """Enforce every rule the validator does, run the lists eagerly, measure; then validate."""
    p, m, num_stages = schedule.num_ranks, schedule.num_microbatches, schedule.num_stages
    for rank, row in enumerate(schedule.actions):
        for a in row:
            assert schedule.rank_of(a.stage) == rank, f"{a} listed on rank {rank}"
    counts = Counter((a.stage, a.kind, a.microbatch) for row in schedule.actions for a in row)
    assert max(counts.values()) == 1, [k for k, v in counts.items() if v > 1]
    expected = 0
    for s in range(num_stages):
        for mb in range(m):
            assert counts[(s, "F", mb)] == 1, f"{s}F{mb} missing"
            if forward_only:
                expected += 1
                continue
            backward = (counts[(s, "B", mb)], counts[(s, "I", mb)], counts[(s, "W", mb)])
            assert backward in ((1, 0, 0), (0, 1, 1)), f"stage {s} mb {mb}: B/I/W {backward}"
            expected += 2 + backward[1]
    assert sum(counts.values()) == expected, "actions outside stages 0..S-1 / mbs 0..m-1"
    for rank, row in enumerate(schedule.actions):  # local order
        position = {(a.stage, a.kind, a.microbatch): i for i, a in enumerate(row)}
        for (s, kind, mb), i in position.items():
            if kind in ("I", "B"):
                assert position[(s, "F", mb)] < i, f"rank {rank}: {s}{kind}{mb} before its F"
            if kind == "W":
                assert position[(s, "I", mb)] < i, f"rank {rank}: {s}W{mb} before its I"
    sent, received = defaultdict(list), defaultdict(list)  # per-peer message order
    for rank, row in enumerate(schedule.actions):
        for a in row:
            src, dst, recv, send = _messages(a, schedule)
            if src is not None:
                received[(src, rank)].append(recv)
            if dst is not None:
                sent[(rank, dst)].append(send)
    for pair in set(sent) | set(received):
        assert sent[pair] == received[pair], f"message order differs on channel {pair}"

    done_at: dict = {}  # eager run: an action starts when its rank is free and its input exists
    pointer, clock, busy = [0] * p, [0.0] * p, [0.0] * p
    first: list = [None] * p
    held, full, pending = [0] * p, [0] * p, [0] * p
    peak_held, peak_full, peak_pending = [0] * p, [0] * p, [0] * p
    remaining = sum(len(row) for row in schedule.actions)
    while remaining:
        progressed = False
        for rank, row in enumerate(schedule.actions):
            while pointer[rank] < len(row):
                a = row[pointer[rank]]
                s, kind, mb = a.stage, a.kind, a.microbatch
                if kind == "F":
                    needs = [(s - 1, "F", mb)] if s > 0 else []
                elif kind in ("I", "B"):
                    needs = [(s, "F", mb)]
                    if s < num_stages - 1:
                        needs.append((s + 1, "I" if counts[(s + 1, "I", mb)] else "B", mb))
                else:
                    needs = [(s, "I", mb)]
                missing = [n for n in needs if n not in done_at]
                if missing:
                    assert all(schedule.rank_of(n[0]) != rank for n in missing), (
                        f"rank {rank}: {a} waits for {missing}, later in its own list"
                    )
                    break
                start = max([clock[rank]] + [done_at[n] for n in needs])
                done_at[(s, kind, mb)] = clock[rank] = start + COSTS[kind]
                busy[rank] += COSTS[kind]
                first[rank] = start if first[rank] is None else first[rank]
                if not forward_only:
                    held[rank] += {"F": 1, "B": -1, "W": -1}.get(kind, 0)
                    full[rank] += {"F": 1, "B": -1, "I": -1}.get(kind, 0)
                    pending[rank] += {"I": 1, "W": -1}.get(kind, 0)
                peak_held[rank] = max(peak_held[rank], held[rank])
                peak_full[rank] = max(peak_full[rank], full[rank])
                peak_pending[rank] = max(peak_pending[rank], pending[rank])
                pointer[rank] += 1
                remaining -= 1
                progressed = True
        assert progressed, f"deadlock: ranks stopped at positions {pointer}"
    validate_schedule(schedule, channels="pair")  # the strictest rule: NCCL without tags
    return Run([f or 0.0 for f in first], clock, busy, peak_held, peak_full, peak_pending)


def measure(schedule: Schedule) -> Run:
    """Our eager run, cross-checked against the project's simulator."""
    run = check_schedule(schedule)
    timeline = simulate(schedule, EQUAL, channels="pair")
    assert timeline.makespan == run.makespan
    assert timeline.bubble_fraction == pytest.approx(run.bubble_fraction)
    assert timeline.peak_activations == run.peak_held
    return run


def text(schedule: Schedule) -> list[str]:
    return [" ".join(map(str, row)) for row in schedule.actions]


# ---------------------------------------------------------------- validity everywhere
@pytest.mark.parametrize("name", BUILDERS)
def test_valid_for_every_size(name):
    builder = BUILDERS[name]
    for p in range(1, 9):
        for m in range(1, 33):
            schedule = builder(p, m)
            assert (schedule.num_ranks, schedule.num_microbatches) == (p, m)
            layout = v_placement(p) if name in ("zb-v", "dualpipev") else loop_placement(p, 1)
            assert schedule.stage_to_rank == layout
            check_schedule(schedule)


@pytest.mark.parametrize("name", BUILDERS)
def test_forward_only_is_just_the_forwards(name):
    for p in range(1, 9):
        for m in (1, 2, 5, 16):
            schedule = BUILDERS[name](p, m, forward_only=True)
            assert {a.kind for row in schedule.actions for a in row} == {"F"}
            assert schedule.options["forward_only"] is True
            check_schedule(schedule, forward_only=True)


@pytest.mark.parametrize("name", BUILDERS)
def test_registry_builds_and_validates(name):
    spec = REGISTRY[name]
    assert spec.split_backward and "any p >= 1, m >= 1" in spec.constraints
    schedule = build_schedule(name, 3, 7)
    assert schedule.name == name and schedule.uses_split_backward()


# ---------------------------------------------------------------- exact small orders
EXACT_P2_M4 = {
    "zb-h1": [
        "0F0 0F1 0I0 0W0 0F2 0I1 0W1 0F3 0I2 0W2 0I3 0W3",
        "1F0 1I0 1F1 1I1 1W0 1F2 1I2 1W1 1F3 1I3 1W2 1W3",
    ],
    "zb-h2": [
        "0F0 0F1 0F2 0I0 0W0 0F3 0I1 0I2 0W1 0W2 0I3 0W3",
        "1F0 1I0 1F1 1I1 1F2 1I2 1W0 1F3 1I3 1W1 1W2 1W3",
    ],
    "zb-v": [
        "0F0 0F1 3F0 3I0 3F1 3W0 0I0 0F2 3I1 0W0 0F3 3W1 3F2 3I2 0I1 3W2 0W1 3F3 3I3 0I2 3W3 "
        "0I3 0W2 0W3",
        "1F0 2F0 1F1 2F1 2I0 1I0 2W0 1W0 1F2 2I1 2F2 1I1 2W1 1F3 2I2 1W1 2F3 1I2 2W2 2I3 1I3 "
        "1W2 2W3 1W3",
    ],
    "dualpipev": [
        "0F0 0F1 3F0 0F2 3I0 3W0 3F1 0F3 3B1 3F2 0B0 3B2 3F3 0B1 3B3 0I2 0W2 0I3 0W3",
        "1F0 2F0 1F1 2F1 1F2 2B0 2F2 1B0 1F3 2B1 2F3 1B1 2B2 1B2 2I3 1I3 2W3 1W3",
    ],
}


@pytest.mark.parametrize("name", BUILDERS)
def test_exact_order_p2_m4(name):
    assert text(BUILDERS[name](2, 4)) == EXACT_P2_M4[name]


def test_exact_order_dualpipev_p3_m6():
    # derived by hand from the step list in dualpipev's docstring; rank 0 (a=0, b=5):
    # 1: 0F0 0F1 | 2: 0F2 5F0 | 3: [0F3 5I0] 5W0 5F1 [0F4 5I1] 5W1 5F2 |
    # 4: [0F5 5B2] [5F3 0B0] | 5: 5B3 [5F4 0B1] 5B4 [5F5 0B2] | 6: 5B5 0I3 |
    # 7: 0W3 0I4 0W4 0I5 | 8: 0W5
    assert text(build_dualpipev(3, 6)) == [
        "0F0 0F1 0F2 5F0 0F3 5I0 5W0 5F1 0F4 5I1 5W1 5F2 0F5 5B2 5F3 0B0 5B3 5F4 0B1 5B4 5F5 "
        "0B2 5B5 0I3 0W3 0I4 0W4 0I5 0W5",
        "1F0 1F1 4F0 1F2 4F1 1F3 4I0 4W0 4F2 1F4 4B1 4F3 1B0 1F5 4B2 4F4 1B1 4B3 4F5 1B2 4B4 "
        "1B3 4I5 1I4 4W5 1I5 1W4 1W5",
        "2F0 3F0 2F1 3F1 2F2 3F2 2F3 3B0 3F3 2B0 2F4 3B1 3F4 2B1 2F5 3B2 3F5 2B2 3B3 2B3 3B4 "
        "2I4 3I5 2I5 2W4 3W5 2W5",
    ]


# ---------------------------------------------------------------- cost-model facts
def test_zb_h1_third_of_1f1b_bubble_at_1f1b_memory():
    for p, m, makespan, ofob_makespan in ((4, 8, 27, 33), (4, 16, 51, 57)):
        zb, ofob = measure(build_zb_h1(p, m)), measure(build_1f1b(p, m))
        assert (zb.makespan, ofob.makespan) == (makespan, ofob_makespan)
        assert zb.idle == [3] * 4 and ofob.idle == [9] * 4  # a third
        assert zb.peak_full == ofob.peak_held == [4, 3, 2, 1]  # 1F1B's full activations
        assert zb.peak_held == [4, 4, 4, 4]  # p in flight until W on every rank (the paper)
        assert zb.peak_pending_w == [1, 2, 3, 4]  # rank r's W's trail by r
    assert measure(build_zb_h1(4, 8)).bubble_fraction == pytest.approx(3 / 27)  # 0.111
    assert measure(build_1f1b(4, 8)).bubble_fraction == pytest.approx(9 / 33)  # 0.273
    assert measure(build_zb_h1(4, 16)).bubble_fraction == pytest.approx(3 / 51)  # 0.059
    assert measure(build_1f1b(4, 16)).bubble_fraction == pytest.approx(9 / 57)  # 0.158
    for p in range(2, 9):
        for m in (p, 2 * p, 3 * p + 1):
            zb, ofob = check_schedule(build_zb_h1(p, m)), check_schedule(build_1f1b(p, m))
            assert zb.makespan == 3 * m + p - 1
            assert zb.idle == [p - 1] * p and ofob.idle == [3 * (p - 1)] * p
            assert zb.peak_full == ofob.peak_held == [p - r for r in range(p)]
            assert zb.peak_held == [p] * p


def test_zb_h2_no_bubble_inside_any_rank():
    for m, makespan in ((8, 27), (16, 51)):
        run = measure(build_zb_h2(4, m))
        assert run.makespan == makespan and run.idle == [3] * 4  # rank 3 starts at slot 3
        assert run.window_idle == [0, 0, 0, 0]  # the parallelogram
        assert run.peak_full == [7, 5, 3, 1] and run.peak_held == [7, 7, 7, 7]
        assert run.bubble_fraction == pytest.approx(3 / makespan)  # 0.111, 0.059
    for p in range(1, 9):
        for m in (2 * p - 1, 2 * p, 3 * p + 2):
            run = check_schedule(build_zb_h2(p, m))
            assert run.makespan == 3 * m + p - 1  # the least any schedule can have
            assert run.window_idle == [0] * p
            assert run.peak_full == [2 * (p - r) - 1 for r in range(p)]
            assert max(run.peak_held) == run.peak_held[0] == 2 * p - 1


def test_zb_v_least_makespan_at_1f1b_memory():
    for m, makespan in ((8, 51), (16, 99)):
        run = measure(build_zb_v(4, m))
        assert run.makespan == makespan and run.idle == [3] * 4
        assert run.window_idle == [3, 2, 1, 0]
        assert run.peak_held == [8, 8, 8, 8]  # 2p chunk activations = p whole-rank microbatches
        assert run.bubble_fraction == pytest.approx(3 / makespan)  # 0.059, 0.030
    for p in range(1, 9):
        for m in (p, 2 * p, 3 * p + 1):
            run = check_schedule(build_zb_v(p, m))
            assert run.makespan == 6 * m + p - 1  # rank p-1 starts at p-1 and has 6m of work
            assert max(run.peak_held) <= 2 * p


def eager_run(schedule: Schedule, cost: dict, pair_cost: float | None = None):
    """(makespan, busy per rank) of running every rank's list eagerly under ``cost`` (a time
    per kind F/I/W/B), written apart from ``analysis.simulate``.

    With ``pair_cost`` (DualPipe's F&B), each of DualPipe's overlapped pairs runs as ONE unit
    that costs ``pair_cost`` and starts once the inputs of both its actions are there, as
    ``DualPipeV.step``'s ``_forward_backward_chunk`` does (it receives both, then computes
    both): a forward of one chunk right before a full backward B of the other chunk, except
    the first such pair on rank p-1, which DualPipe does not overlap."""
    p, num_stages = schedule.num_ranks, schedule.num_stages
    split = {(a.stage, a.microbatch) for row in schedule.actions for a in row if a.kind == "I"}
    rows = []
    for rank, row in enumerate(schedule.actions):
        units, i, first_seen = [], 0, rank != p - 1
        while i < len(row):
            x, y = row[i], row[i + 1] if i + 1 < len(row) else None
            if (pair_cost is not None and y is not None and x.kind == "F" and y.kind == "B"
                    and x.stage != y.stage):
                if first_seen:
                    units.append((x, y))
                    i += 2
                    continue
                first_seen = True
            units.append((x,))
            i += 1
        rows.append(units)

    def needs(a):
        s, mb = a.stage, a.microbatch
        if a.kind == "F":
            return [(s - 1, "F", mb)] if s > 0 else []
        if a.kind == "W":
            return [(s, "I", mb)]
        later = [(s + 1, "I" if (s + 1, mb) in split else "B", mb)] if s < num_stages - 1 else []
        return [(s, "F", mb)] + later

    done, pointer, clock, busy = {}, [0] * p, [0.0] * p, [0.0] * p
    remaining = sum(map(len, rows))
    while remaining:
        progressed = False
        for rank, units in enumerate(rows):
            while pointer[rank] < len(units):
                unit = units[pointer[rank]]
                own = {(a.stage, a.kind, a.microbatch) for a in unit}
                inputs = [n for a in unit for n in needs(a) if n not in own]
                if any(n not in done for n in inputs):
                    break
                took = pair_cost if len(unit) == 2 else cost[unit[0].kind]
                end = max([clock[rank]] + [done[n] for n in inputs]) + took
                done.update(dict.fromkeys(own, end))
                clock[rank], pointer[rank] = end, pointer[rank] + 1
                busy[rank] += took
                remaining -= 1
                progressed = True
        assert progressed, f"deadlock at {pointer}"
    return max(clock), busy


def test_dualpipev_bubble_and_memory_match_dualpipe_table():
    """DualPipe's table (DeepSeek-V3 report, Table 2; deepseek-ai/DualPipe's README), for
    DualPipeV with PP = S = 2p stages on p ranks: bubble (PP/2 - 1)(F&B + B - 3W) per rank,
    activations PP + 1 chunk-activations per rank. Costs t_F = 3, t_B = 4, t_W = 1 (all
    distinct; t_I = t_B - t_W = 3 = t_F, the equal forward / input-gradient cost under which
    the table's formula is exact; with t_I != t_F it is not, even for DualPipe's own order).

    The table counts an overlapped F&B pair as one unit that waits for both inputs (DualPipe's
    ``_forward_backward_chunk``); our runtime runs the pair's F and B one after the other, so
    the F does not wait for the B's gradient. ``analysis.simulate`` predicts our runtime, and
    it idles less than the table: (p-1)(F + B - 2W), by (p-1) t_I."""
    t_f, t_i, t_w = 3, 3, 1
    t_b = t_i + t_w
    cost = {"F": t_f, "I": t_i, "W": t_w, "B": t_b}
    model = CostModel.for_stages(t_f=t_f, t_i=t_i, t_w=t_w, t_b=t_b, t_comm=0)
    for p in range(1, 9):
        stages = 2 * p  # DualPipe's PP
        for m in (2 * p, 2 * p + 1, 3 * p + 4):
            busy = 2 * m * (t_f + t_b)  # every rank: m microbatches of two chunks
            theirs = build_dualpipev(p, m, match_dualpipe=True)
            # the table's bubble: DualPipe's own order, pairs as one unit of F&B
            for f_and_b in (t_f + t_b, 5):  # pairs run back to back; pairs overlapped
                makespan, busy_per_rank = eager_run(theirs, cost, pair_cost=f_and_b)
                idle = [makespan - b for b in busy_per_rank]
                table = (stages // 2 - 1) * (f_and_b + t_b - 3 * t_w)
                assert max(idle) == table, (p, m, f_and_b, idle)
                if f_and_b == t_f + t_b:  # every rank does the same work: the same idle
                    assert idle == [table] * p == [8 * (p - 1)] * p
            # the simulator (our runtime: a pair's F, then its B) on both orders
            for schedule in (theirs, build_dualpipev(p, m)):
                timeline = simulate(schedule, model)
                assert timeline.peak_activations == [stages + 1] * p  # the table's PP + 1
                idle = [timeline.idle(r) for r in range(p)]
                assert idle == [(p - 1) * (t_f + t_b - 2 * t_w)] * p == [5 * (p - 1)] * p
                assert timeline.makespan == busy + 5 * (p - 1)
                # the eager run without pairs is the simulator's model: the same figures
                assert eager_run(schedule, cost) == (timeline.makespan, [busy] * p)
    # t_F = t_I = t_W = 1, t_B = 2: the simulator's makespan, bubble and memory cross-checked
    # against our own checker's eager run (measure)
    for m, makespan in ((8, 51), (16, 99)):
        run = measure(build_dualpipev(4, m))
        assert run.makespan == makespan and run.idle == [3] * 4
        assert run.peak_held == [9, 9, 9, 9]  # S + 1 with S = 8 stages
        assert run.bubble_fraction == pytest.approx(3 / makespan)  # 0.059, 0.030
    for p in range(1, 9):
        for m in (2 * p, 2 * p + 1, 3 * p + 4):
            run = check_schedule(build_dualpipev(p, m))
            assert run.idle == [p - 1] * p
            assert run.makespan == 6 * m + p - 1
            assert run.peak_held == [2 * p + 1] * p


def test_dualpipev_overlapped_pairs_and_phases():
    p, m = 4, 12
    schedule = build_dualpipev(p, m)
    for rank, row in enumerate(schedule.actions):
        a = rank  # the chunk-0 stage; the other is 2p-1-rank
        pairs = [
            (x, y) for x, y in zip(row, row[1:])
            if x.kind == "F" and y.kind in ("B", "I") and x.stage != y.stage
        ]
        # steps 3, 4 and 5: p-r-1 + 2(m-2p+r+1) + p-r-1 = 2(m-p) pairs, F first
        assert len(pairs) == 2 * (m - p)
        assert row[: p - rank - 1] == [x for x in row if x.stage == a][: p - rank - 1]
        assert row[-1].kind == "W"
        assert len([x for x in row if x.kind == "W"]) == (p - rank - 1) + p


def test_dualpipev_match_dualpipe_is_dualpipes_own_order():
    schedule = build_dualpipev(3, 6, match_dualpipe=True)
    assert text(schedule)[0] == (  # DualPipeV.step on rank 0: 2(p-1) warm-up forwards
        "0F0 0F1 0F2 0F3 0F4 5F0 5I0 5W0 5F1 5I1 5W1 5F2 0F5 5B2 5F3 0B0 5B3 5F4 0B1 5B4 5F5 "
        "0B2 5B5 0I3 0W3 0I4 0W4 0I5 0W5"
    )
    validate_schedule(schedule)  # the executor receives in the sender's order: it runs
    with pytest.raises(ScheduleError):  # in-order matching on both sides does not
        validate_schedule(schedule, channels="pair")
    ours = simulate(build_dualpipev(4, 8), EQUAL)
    theirs = simulate(build_dualpipev(4, 8, match_dualpipe=True), EQUAL)
    assert (theirs.makespan, theirs.peak_activations) == (ours.makespan, ours.peak_activations)
    assert theirs.bubble_fraction == ours.bubble_fraction


def test_dualpipev_fewer_than_2p_microbatches_is_cut_from_2p():
    schedule = build_dualpipev(4, 3)
    assert schedule.options["built_for_microbatches"] == 8
    full = build_dualpipev(4, 8)
    assert schedule.actions == [[x for x in row if x.microbatch < 3] for row in full.actions]
    assert "built_for_microbatches" not in full.options


# ---------------------------------------------------------------- options and rejections
@pytest.mark.parametrize("name", ["zb-h1", "zb-h2"])
def test_max_pending_backward_is_respected(name):
    for p in (1, 2, 4, 5):
        for m in (1, 4, 9, 16):
            for limit in range(1, 2 * p + 1):
                schedule = BUILDERS[name](p, m, max_pending_backward=limit)
                assert schedule.options["max_pending_backward"] == limit
                run = check_schedule(schedule)
                assert max(run.peak_pending_w) <= limit
    assert BUILDERS[name](4, 8).options["max_pending_backward"] == (4 if name == "zb-h1" else 7)
    # the default binds nowhere; the smallest value costs bubble
    assert check_schedule(BUILDERS[name](4, 8, max_pending_backward=1)).makespan == 30


@pytest.mark.parametrize("name", ["zb-h1", "zb-h2"])
@pytest.mark.parametrize("bad", [0, -2, 1.5, True, "3"])
def test_bad_max_pending_backward_is_rejected(name, bad):
    with pytest.raises(ScheduleError, match=r"max_pending_backward=.* must be an integer >= 1"):
        BUILDERS[name](4, 8, max_pending_backward=bad)


@pytest.mark.parametrize("name,bad_chunks", [("zb-h1", 2), ("zb-h2", 2), ("zb-v", 1),
                                             ("zb-v", 3), ("dualpipev", 4)])
def test_wrong_chunks_are_rejected(name, bad_chunks):
    with pytest.raises(ScheduleError, match=f"chunks v={bad_chunks}"):
        BUILDERS[name](4, 8, chunks=bad_chunks)


@pytest.mark.parametrize("name", BUILDERS)
def test_bad_sizes_are_rejected(name):
    with pytest.raises(ScheduleError, match="p=0"):
        BUILDERS[name](0, 8)
    with pytest.raises(ScheduleError, match="m=0"):
        BUILDERS[name](4, 0)


def test_list_scheduler_reports_when_stuck():
    with pytest.raises(StuckError, match="stuck at slot 0"):
        merge_streams((0, 1), 2, [[[(0, "F")] * 2, [(0, "I")] * 2], [[(1, "F")] * 2,
                                                                      [(1, "I")] * 2]],
                      kind_first("FIW"), live_cap=[0, 1])


# ------------------------------------------------------------------ zb-v's warm-up forwards
def _back_to_back_periods(schedule, k=6):
    """The step-to-step periods of ``k`` steps run back to back (each rank starts step j+1 when
    its own part of step j is done), simulated with t_F = t_I = t_W = 1 per rank."""
    from bench.emulated_device import concatenated, step_ends

    unit = CostModel(t_f=1, t_i=1, t_w=1, t_b=2, t_comm=0)
    ends = step_ends(simulate(concatenated(schedule, k), unit), schedule.num_microbatches, k)
    return [b - a for a, b in zip(ends, ends[1:])]


def test_zb_v_warmup_forwards_trade_memory_for_overlapping_steps():
    """p=4, m=8: every warm-up length w from p to 2p-1 keeps the least single-step makespan
    (6m + p - 1 chunk-slots of 1/2: 25.5) and runs w chunk-0 forwards on every rank before its
    first chunk-1 input gradient; each forward more takes one chunk-slot off the back-to-back
    step, down to 6m slots (24.0: no bubble, zb-h2's figure) at 2p-1, and holds 2 more
    microbatch-chunks at the peak (14 = zb-h2's 2p-1 microbatches)."""
    unit = CostModel(t_f=1, t_i=1, t_w=1, t_b=2, t_comm=0)
    periods, peaks = {}, {}
    for w in range(4, 8):
        schedule = build_schedule("zb-v", 4, 8, 2, warmup_forwards=w)
        validate_schedule(schedule, channels="pair")
        timeline = simulate(schedule, unit)
        assert timeline.makespan == 25.5
        for rank, row in enumerate(schedule.actions):
            down = [a for a in row if a.stage == rank and a.kind == "F"
                    or a.stage == 7 - rank and a.kind == "I"]
            assert [a.kind for a in down[:w + 1]] == ["F"] * w + ["I"], (w, rank)
        periods[w] = set(_back_to_back_periods(schedule))
        peaks[w] = timeline.peak_activations
    assert periods == {4: {25.5}, 5: {25.0}, 6: {24.5}, 7: {24.0}}
    assert peaks == {4: [8, 8, 8, 8], 5: [10, 10, 10, 10], 6: [12, 12, 12, 12],
                     7: [12, 14, 14, 14]}
    assert set(_back_to_back_periods(build_schedule("zb-h2", 4, 8))) == {24.0}
    assert max(peaks[7]) == 2 * (2 * 4 - 1)  # zb-h2's peak: 2p-1 microbatches


@pytest.mark.parametrize("w", [3, 8, 4.5])
def test_zb_v_warmup_forwards_out_of_range_is_refused(w):
    with pytest.raises(ScheduleError, match=r"warmup_forwards=.* p to 2p-1 .*\(p=4: 4 to 7\)"):
        build_schedule("zb-v", 4, 8, 2, warmup_forwards=w)


@pytest.mark.parametrize("name, v, option, value", [
    ("zb-v", 2, "max_pending_backward", 3), ("dualpipev", 2, "max_pending_backward", 3),
    ("1f1b", 1, "max_pending_backward", 3), ("zb-h2", 1, "warmup_forwards", 7),
    ("zb-h1", 1, "microbatch_group_size_per_vp_stage", 4), ("zb-v", 2, "match_dualpipe", True)])
def test_a_shaping_option_is_refused_by_a_schedule_that_would_ignore_it(name, v, option, value):
    """Builders take **options, so without this check zb-v would silently run as if
    max_pending_backward were unset."""
    with pytest.raises(ScheduleError, match=rf"{option}={value} shapes .* only, and {name} would "
                                            "ignore it"):
        build_schedule(name, 4, 8, v, **{option: value})
    assert build_schedule(name, 4, 8, v, **{option: None}).name == name


def test_max_pending_backward_is_refused_where_ignored_before_any_communication():
    import argparse

    import megatron_pp_ext
    from megatron_pp_ext.integration import megatron_args
    from megatron_pp_ext.integration.options import PipelineOptions

    with pytest.raises(ValueError, match="max_pending_backward=3 shapes zb-h1 and zb-h2 only, "
                                         "and zb-v would ignore it"):
        megatron_pp_ext.install(schedule="zb-v", max_pending_backward=3)
    with pytest.raises(ValueError, match="and auto would ignore it"):
        PipelineOptions(schedule="auto", max_pending_backward=3)
    with pytest.raises(ValueError, match="microbatch_group_size_per_vp_stage=4 shapes "
                                         "interleaved only, and zb-h2 would ignore it"):
        PipelineOptions(schedule="zb-h2", microbatch_group_size_per_vp_stage=4)
    assert PipelineOptions(schedule="zb-h1", max_pending_backward=3).builder_options() == {
        "max_pending_backward": 3}
    parser = megatron_args.add_pipeline_schedule_args(argparse.ArgumentParser())
    args = parser.parse_args(["--pipeline-schedule", "zb-v", "--pp-max-pending-backward", "3"])
    args.pipeline_model_parallel_size, args.virtual_pipeline_model_parallel_size = 4, 2
    args.untie_embeddings_and_output_weights = True
    with pytest.raises(ValueError, match="--pp-max-pending-backward 3 shapes zb-h1 and zb-h2 "
                                         "only, and zb-v would ignore it"):
        megatron_args.schedule_options_from_args(args)
    # Megatron's own flag reaches interleaved only, as in Megatron (a shared launch script may
    # set it for every schedule)
    args = parser.parse_args(["--pipeline-schedule", "zb-v"])
    args.pipeline_model_parallel_size, args.virtual_pipeline_model_parallel_size = 4, 2
    args.untie_embeddings_and_output_weights = True
    args.microbatch_group_size_per_vp_stage = 4
    assert megatron_args.schedule_options_from_args(args)[
        "microbatch_group_size_per_vp_stage"] is None
