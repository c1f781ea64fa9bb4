"""Reject a schedule that cannot run, before any rank sends a byte.

``validate_schedule`` checks, in this order, and raises ``ScheduleError`` at the first problem
with a message naming the rank and the action:

1. counts and placement: every (stage, microbatch) has one F and either one B or one I and
   one W (or no backward at all, for a forward-only schedule), each on the rank that owns
   the stage;
2. local order on each rank: B/I after its F, W after its I, and a dependency that lives on
   the same rank (V layouts, p=1) before the action that needs it;
3. message order, on request: the executor receives from each peer in the order that peer
   sends (every rank knows every action list), so any order is safe for it (``"sender"``,
   the default); ``"pair"`` / ``"kind"`` check the stricter rule of executors that receive
   in their own action order (NCCL matches messages in order, it has no tags);
4. deadlock freedom: ranks running their lists in order, each action waiting for its input,
   all finish.

Communication is derived from the action lists exactly as the runtime executor does
(``peer_messages``), and ``activation_trace`` is the one rule for activations held, shared
with the simulator and the runtime.

Everything is O(total actions): p=64, m=512, v=2 validates in a fraction of a second.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Callable, Sequence

from ..ir import (
    BACKWARD,
    BACKWARD_INPUT,
    BACKWARD_WEIGHT,
    FORWARD,
    Action,
    Schedule,
    ScheduleError,
)

# Completion keys: what a cross-stage dependency waits for. B and I share "G" (the input
# gradient is ready), so a split and a full backward feed the next stage the same way.
_GRAD = "G"


#: How messages between two ranks are matched: "sender" = the receiver follows the sender's
#: order (our executor: no order to agree on); "pair" = one in-order channel per ordered rank
#: pair, whatever the message kind, both sides in their own action order (NCCL without tags);
#: "kind" = the same per rank pair and kind (activations apart from gradients), for a
#: transport that keeps them apart. PyTorch's ZB1P test schedule passes "kind", not "pair".
CHANNELS = ("sender", "pair", "kind")


def validate_schedule(schedule: Schedule, channels: str = "sender") -> None:
    """Raise ``ScheduleError`` naming the rank and the action if ``schedule`` cannot run."""
    check_counts(schedule)
    check_local_order(schedule)
    check_message_order(schedule, channels)
    check_deadlock(schedule)


# ---------------------------------------------------------------- 1. counts and placement
def check_counts(schedule: Schedule) -> None:
    num_stages, m, p = schedule.num_stages, schedule.num_microbatches, schedule.num_ranks
    owner = schedule.stage_to_rank
    for stage, rank in enumerate(owner):
        if not 0 <= rank < p:
            raise ScheduleError(
                f"stage {stage} is placed on rank {rank}, but the schedule has ranks 0..{p - 1}"
            )
    empty = sorted(set(range(p)) - set(owner))
    if empty and num_stages:
        raise ScheduleError(f"rank {empty[0]} holds no stage: every rank must hold at least one")

    seen: set[tuple[str, int, int]] = set()
    for rank, row in enumerate(schedule.actions):
        for action in row:
            stage, mb = action.stage, action.microbatch
            if stage >= num_stages:
                raise ScheduleError(
                    f"rank {rank} runs {action}: stage {stage} does not exist "
                    f"(stages are 0..{num_stages - 1})"
                )
            if mb >= m:
                raise ScheduleError(
                    f"rank {rank} runs {action}: microbatch {mb} does not exist "
                    f"(microbatches are 0..{m - 1})"
                )
            if owner[stage] != rank:
                raise ScheduleError(
                    f"rank {rank} runs {action}, but stage {stage} lives on rank {owner[stage]}"
                )
            key = (action.kind, stage, mb)
            if key in seen:
                raise ScheduleError(f"rank {rank} runs {action} twice")
            seen.add(key)

    forward_only = not any(kind != FORWARD for kind, _, _ in seen)
    split_stages = {stage for kind, stage, _ in seen if kind == BACKWARD_INPUT}
    paths = [schedule.path(mb) for mb in range(m)]
    off_path = [key for key in seen if key[1] not in paths[key[2]]]
    if off_path:
        kind, stage, mb = min(off_path)
        path = paths[mb]
        raise ScheduleError(
            f"rank {owner[stage]} runs {stage}{kind}{mb}, but microbatch {mb} crosses "
            f"stages {path.start}..{path.stop - 1} only (DualPipe's two directions)")
    for stage in range(num_stages):
        rank = owner[stage]
        for mb in (mb for mb in range(m) if stage in paths[mb]):
            if (FORWARD, stage, mb) not in seen:
                raise ScheduleError(f"rank {rank} is missing {stage}F{mb}")
            if forward_only:
                continue
            has_b = (BACKWARD, stage, mb) in seen
            has_i = (BACKWARD_INPUT, stage, mb) in seen
            has_w = (BACKWARD_WEIGHT, stage, mb) in seen
            if has_b and (has_i or has_w):
                other = f"{stage}I{mb}" if has_i else f"{stage}W{mb}"
                raise ScheduleError(
                    f"rank {rank} runs both {stage}B{mb} and {other}: a backward is either "
                    "one B, or one I and one W"
                )
            if has_i != has_w:
                missing = f"{stage}W{mb}" if has_i else f"{stage}I{mb}"
                raise ScheduleError(f"rank {rank} is missing {missing}")
            if not (has_b or has_i):
                missing = (
                    f"{stage}I{mb} and {stage}W{mb}" if stage in split_stages else f"{stage}B{mb}"
                )
                raise ScheduleError(f"rank {rank} is missing {missing}")


# ---------------------------------------------------------------- 2. local order
def check_local_order(schedule: Schedule) -> None:
    owner = schedule.stage_to_rank
    for rank, row in enumerate(schedule.actions):
        done: set[tuple[str, int, int]] = set()
        for action in row:
            kind, stage, mb = action.kind, action.stage, action.microbatch
            if kind in (BACKWARD, BACKWARD_INPUT) and (FORWARD, stage, mb) not in done:
                raise ScheduleError(f"rank {rank} runs {action} before {stage}F{mb}")
            if kind == BACKWARD_WEIGHT and (BACKWARD_INPUT, stage, mb) not in done:
                raise ScheduleError(f"rank {rank} runs {action} before {stage}I{mb}")
            # A dependency on this same rank must already have run: nobody else will run it.
            before, after = schedule.upstream(stage), schedule.downstream(stage)
            if kind == FORWARD and before is not None and owner[before] == rank:
                if (FORWARD, before, mb) not in done:
                    raise ScheduleError(
                        f"rank {rank} runs {action} before {before}F{mb}, whose output it "
                        f"needs (both stages live on rank {rank})"
                    )
            if kind in (BACKWARD, BACKWARD_INPUT) and after is not None and owner[after] == rank:
                if (_GRAD, after, mb) not in done:
                    raise ScheduleError(
                        f"rank {rank} runs {action} before the backward of stage {after}, "
                        f"microbatch {mb}, whose input gradient it needs (both stages live on "
                        f"rank {rank})"
                    )
            done.add((kind, stage, mb))
            if kind in (BACKWARD, BACKWARD_INPUT):
                done.add((_GRAD, stage, mb))


# ---------------------------------------------------------------- 3. message order
def peer_messages(schedule: Schedule) -> tuple[dict, dict]:
    """The point-to-point messages the action lists imply, as the executor derives them.

    Returns ``(sends, receives)``: each maps ``(src_rank, dst_rank)`` to the list of messages
    in the order the owning rank (src for sends, dst for receives) posts them. A message is
    ``("act" | "grad", from_stage, to_stage, microbatch)``. An F receives its input activation
    from stage s-1 and sends its output to stage s+1; a B or I receives the output gradient
    from stage s+1 and sends the input gradient to stage s-1; W communicates nothing.
    Neighbouring stages on the same rank hand over locally: no message.
    """
    owner = schedule.stage_to_rank
    sends: dict[tuple[int, int], list] = defaultdict(list)
    receives: dict[tuple[int, int], list] = defaultdict(list)
    for rank, row in enumerate(schedule.actions):
        for action in row:
            kind, stage, mb = action.kind, action.stage, action.microbatch
            before, after = schedule.upstream(stage), schedule.downstream(stage)
            if kind == FORWARD:
                if before is not None and owner[before] != rank:
                    receives[(owner[before], rank)].append(("act", before, stage, mb))
                if after is not None and owner[after] != rank:
                    sends[(rank, owner[after])].append(("act", stage, after, mb))
            elif kind in (BACKWARD, BACKWARD_INPUT):
                if after is not None and owner[after] != rank:
                    receives[(owner[after], rank)].append(("grad", after, stage, mb))
                if before is not None and owner[before] != rank:
                    sends[(rank, owner[before])].append(("grad", stage, before, mb))
    return sends, receives


def format_message(message: tuple) -> str:
    kind, src, dst, mb = message
    return f"{kind} {src}->{dst} mb{mb}"


def check_message_order(schedule: Schedule, channels: str = "pair") -> None:
    if channels not in CHANNELS:
        raise ValueError(f"channels={channels!r} must be one of {', '.join(CHANNELS)}")
    if channels == "sender":
        return
    sends, receives = peer_messages(schedule)
    kinds = (None,) if channels == "pair" else ("act", "grad")  # None: every kind together
    for src, dst in sorted(set(sends) | set(receives)):
        for kind in kinds:
            sent = [msg for msg in sends.get((src, dst), []) if kind in (None, msg[0])]
            received = [msg for msg in receives.get((src, dst), []) if kind in (None, msg[0])]
            if sent == received:
                continue
            first = next(
                (i for i, (a, b) in enumerate(zip(sent, received)) if a != b),
                min(len(sent), len(received)),
            )
            channel = "their messages" if kind is None else f"their {kind} messages"
            raise ScheduleError(
                f"ranks {src} and {dst} disagree on the order of {channel} (matched in order: "
                f"NCCL has no tags); first difference at message #{first}: rank {src} sends to "
                f"rank {dst} {_window(sent, first)} but rank {dst} receives from rank {src} "
                f"{_window(received, first)}; reorder one of the two action lists"
            )


def _window(messages: list, index: int, before: int = 2, after: int = 3) -> str:
    lo, hi = max(0, index - before), min(len(messages), index + after)
    items = [format_message(m) for m in messages[lo:hi]]
    head, tail = ("..., " if lo else ""), (", ..." if hi < len(messages) else "")
    return "[" + head + ", ".join(items) + tail + "]"


# ---------------------------------------------------------------- 4. deadlock
def dependencies(schedule: Schedule) -> Callable:
    """``dependency_of`` for one schedule, each stage's neighbours looked up once (for passes
    over every action)."""
    neighbours = schedule.neighbours()

    def dependency(action: Action) -> tuple[str, int, int] | None:
        kind = action.kind
        if kind == FORWARD:
            before = neighbours[action.stage][0]
            return None if before is None else (FORWARD, before, action.microbatch)
        if kind in (BACKWARD, BACKWARD_INPUT):
            after = neighbours[action.stage][1]
            return None if after is None else (_GRAD, after, action.microbatch)
        return None

    return dependency


def dependency_of(action: Action, schedule: Schedule) -> tuple[str, int, int] | None:
    """The completion key of the cross-stage input ``action`` waits for, or None.

    An F of (s, mb) needs the F of its upstream stage (s-1), a B or I the backward (B or I)
    of its downstream stage (s+1); the first and last stage of a microbatch's path need
    nothing. Its own F (for B/I) and I (for W) ran earlier on the same rank.
    """
    return dependencies(schedule)(action)


def completion_key(action: Action) -> tuple[str, int, int]:
    kind = _GRAD if action.kind in (BACKWARD, BACKWARD_INPUT) else action.kind
    return (kind, action.stage, action.microbatch)


def execute_in_order(schedule: Schedule, run: Callable | None = None) -> list[int]:
    """Run every rank's list in order, each action once its cross-stage input is done.

    ``run(rank, action, dependency_key, dependency_value)`` is called once per action in a
    dependency-respecting order and returns a value recorded for the action (the simulator
    returns its end time). Returns how far each rank got; a rank short of its list length is
    blocked. O(total actions): a blocked rank is woken only when what it waits for completes.
    """
    rows = schedule.actions
    dependency = dependencies(schedule)
    done: dict[tuple[str, int, int], object] = {}
    waiting: dict[tuple[str, int, int], list[int]] = {}  # completion key -> ranks blocked on it
    position = [0] * len(rows)
    ready = list(range(len(rows)))
    while ready:
        rank = ready.pop()
        row = rows[rank]
        while position[rank] < len(row):
            action = row[position[rank]]
            dep = dependency(action)
            if dep is not None and dep not in done:
                waiting.setdefault(dep, []).append(rank)
                break
            value = run(rank, action, dep, done.get(dep)) if run else True
            key = completion_key(action)
            done[key] = value
            position[rank] += 1
            ready.extend(waiting.pop(key, ()))
    return position


def check_deadlock(schedule: Schedule) -> None:
    position = execute_in_order(schedule)
    explain_blocked(schedule, position)


def explain_blocked(schedule: Schedule, position: list[int]) -> None:
    """Raise naming the cycle of waiting ranks (or the action that never exists), if any."""
    rows = schedule.actions
    blocked = [r for r in range(len(rows)) if position[r] < len(rows[r])]
    if not blocked:
        return
    existing = {completion_key(a): (a, r) for r, row in enumerate(rows) for a in row}
    waits_for: dict[int, tuple[Action, Action, int]] = {}  # rank -> (blocked, needed, its rank)
    for rank in blocked:
        action = rows[rank][position[rank]]
        dep = dependency_of(action, schedule)
        if dep is None or dep not in existing:
            needed = _describe_key(dep) if dep else "nothing"
            raise ScheduleError(
                f"rank {rank} waits in {action} for {needed}, which no rank runs"
            )
        waits_for[rank] = (action, *existing[dep])
    # Each blocked rank waits for exactly one other blocked rank: follow the arrows to a cycle.
    rank, visited = blocked[0], []
    while rank not in visited:
        visited.append(rank)
        rank = waits_for[rank][2]
    cycle = visited[visited.index(rank):]
    if len(cycle) == 1:
        action, needed, _ = waits_for[rank]
        raise ScheduleError(
            f"deadlock: rank {rank} waits in {action} for {needed}, which rank {rank} itself "
            "runs later"
        )
    steps = "; ".join(
        f"rank {r} waits in {waits_for[r][0]} for {waits_for[r][1]} on rank {waits_for[r][2]}"
        for r in cycle
    )
    others = [r for r in blocked if r not in cycle]
    tail = f" (also blocked behind them: ranks {others})" if others else ""
    raise ScheduleError(
        f"deadlock between ranks {' -> '.join(map(str, cycle + cycle[:1]))}: {steps}; none of "
        f"them can progress{tail}"
    )


def _describe_key(key: tuple[str, int, int]) -> str:
    kind, stage, mb = key
    return f"{stage}B{mb} (or {stage}I{mb})" if kind == _GRAD else f"{stage}{kind}{mb}"


# ---------------------------------------------------------------- activations held
def activation_trace(actions: Sequence[Action]) -> tuple[int, list[int]]:
    """The one rule for activations held on a rank: ``(peak, held after each action)``.

    An activation is held from the end of its F to the end of the action that frees it: the B
    (full backward) or the W (split backward: the weight gradient still needs the saved
    inputs, so the I does not free it). An F whose (stage, microbatch) has no B or W in the
    list (a forward-only schedule) holds nothing afterwards, so forward-only peaks are 0.
    """
    freed_later = {
        (a.stage, a.microbatch) for a in actions if a.kind in (BACKWARD, BACKWARD_WEIGHT)
    }
    held, peak, counts = 0, 0, []
    for action in actions:
        if action.kind == FORWARD and (action.stage, action.microbatch) in freed_later:
            held += 1
        elif action.kind in (BACKWARD, BACKWARD_WEIGHT):
            held -= 1
        peak = max(peak, held)
        counts.append(held)
    return peak, counts


def peak_activations(schedule: Schedule) -> list[int]:
    return [activation_trace(row)[0] for row in schedule.actions]
