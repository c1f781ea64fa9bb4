"""Where each rank's time goes in a traced round of steps back to back (bench (a)'s cross-step
timelines): the emulated device busy (actions and the optimizer step), waiting for a peer
(a receive, a send, the previous step's validation), and the host's own work between them
(posting sends and receives over gloo, the executor's bookkeeping), per step.

The emulated device starts an action when the host does, so host work between actions is on
the device's timeline; on a GPU the host posts while the device computes. The messages a rank
posts per step (one gloo op each: a send or a receive to or from another rank) say how much
host work a schedule asks for: zb-v's V sends every microbatch through a middle rank twice
each way, so there a rank posts twice what it posts under zb-h2."""

from __future__ import annotations

from megatron_pp_ext.ir import BACKWARD, BACKWARD_INPUT, FORWARD, Schedule
from megatron_pp_ext.timeline import COMPUTE, Timeline


def messages_per_step(schedule: Schedule) -> list[int]:
    """Per rank: sends plus receives to or from another rank in one step."""
    owner, last = schedule.stage_to_rank, schedule.num_stages - 1
    counts = []
    for rank, row in enumerate(schedule.actions):
        n = 0
        for action in row:
            if action.kind not in (FORWARD, BACKWARD, BACKWARD_INPUT):
                continue  # a W moves nothing
            before = action.stage > 0 and owner[action.stage - 1] != rank
            after = action.stage < last and owner[action.stage + 1] != rank
            n += int(before) + int(after)  # F: receive before, send after; I/B: the reverse
        counts.append(n)
    return counts


def breakdown(timeline: Timeline, k: int) -> list[dict]:
    """Per rank, seconds per step over steps 2..k-1 (from the end of the rank's optimizer step
    1 to the end of its step k-1: the ramp into the steady state left out)."""
    rows = []
    for rank in range(timeline.num_ranks):
        events = sorted((e for e in timeline.events if e.rank == rank), key=lambda e: e.start)
        opt_end = {e.label: e.end for e in events if e.label.startswith("opt")}
        start, end = opt_end["opt1"], opt_end[f"opt{k - 1}"]
        inside = [e for e in events if e.start >= start and e.end <= end]
        busy = sum(e.end - e.start for e in inside if e.category == COMPUTE)
        waiting = sum(e.end - e.start for e in inside if e.category != COMPUTE)
        actions = sum(1 for e in inside if e.category == COMPUTE and e.label[0].isdigit())
        steps = k - 2
        rows.append({"rank": rank, "busy": busy / steps, "waiting": waiting / steps,
                     "host": (end - start - busy - waiting) / steps,
                     "step": (end - start) / steps, "actions": actions / steps})
    return rows


def breakdown_table(traced: list[tuple[str, str, Timeline, Schedule]], k: int) -> list[str]:
    """Markdown: one row per (schedule, mode, rank). A step replayed after a rolled-back one
    runs inside the window: its actions count in *device busy* and its messages in the
    messages posted (scaled by the actions run per step)."""
    out = ["| schedule | mode | rank | messages posted per step (count) | device busy (ms/step) | "
           "waiting (ms/step) | host between actions (ms/step) | host per message (ms) |",
           "|---|---|---|---|---|---|---|---|"]
    for label, mode, timeline, schedule in traced:
        messages = messages_per_step(schedule)
        for row in breakdown(timeline, k):
            # a replayed step's actions are in the window too: scale by the actions run
            runs = row["actions"] / len(schedule.actions[row["rank"]])
            n = messages[row["rank"]] * runs
            out.append(f"| {label} | {mode} | {row['rank']} | {n:.1f} | {row['busy'] * 1e3:.1f} | "
                       f"{row['waiting'] * 1e3:.1f} | {row['host'] * 1e3:.1f} | "
                       f"{row['host'] * 1e3 / n:.2f} |")
    return out
