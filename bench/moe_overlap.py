"""Bench (h): how much of an MoE layer's all-to-all DualPipeV's F&B pairs hide, on the
emulated device, over the plugin's real Executor and gloo (issue 26, item 4, in part).

Each model chunk holds ``layers`` MoE layers. Per layer and microbatch: a forward's compute
costs ``c`` (attention ``c/2``, experts ``c/2``), an input gradient ``c`` and a weight gradient
``c`` (a full backward ``2c``); each of the two all-to-alls (dispatch, combine) costs
``a = share x c`` on the device's communication stream. Run alone, an F, I or B lasts its
compute plus ``2a`` per layer (nothing to hide behind); a W has no all-to-all. An F&B pair
runs per layer as Megatron's plan orders it (``TransformerLayerSchedulePlan.run``), on two
streams, each node starting once its stream is free and the node of the other stream it
waits for has ended (``PAIR_LAYER``, ``pair_layer_span``), as a device runs what is queued:

    comm stream:  combine(b)    dispatch(f)    dispatch(b)    combine(f)
    comp stream:  attention(f)  experts(b)     experts(f)     attention(b)

The pair then lasts that span on the device's clock, as a lone action lasts its cost. (It was
played on two threads with events between them; the span is the same, without six thread
wake-ups a layer that a device does not have: 68 % hidden with the threads, 67 % without,
in two runs minutes apart at p=4, m=16.)

Four runs of one schedule per round, rotating: the all-to-alls free (``a = 0``: the floor),
paid alone (no pairs), and paired twice (the executor runs the program's pairs through the
work's ``overlapped_forward_backward``), once with the pairs posted as DualPipe commits them
and once in lockstep rounds, a pair taking one (``lowering.COMMIT`` and ``LOCKSTEP``: the two
postings the drop-in chooses between), side by side; every run's compiled steps derived once,
before any clock starts. The all-to-all time a run exposes is its step minus the floor's; the
pairs hide ``(alone - paired) / (alone - floor)`` of what running alone exposes. Target
(issue 43): at least 70 % at p=4, m=16 (issue 26 asked 80 %), a = 30 % of a layer's compute.
Reported, never asserted.

Next to it, what the order's pairs hide by themselves (``hidden_on_the_device_alone``): the
same three steps on the device alone, with no host time and every message free
(``device_only_step``). At p=4, m=16 DualPipeV's own pairs hide 62.9 % there, torch's DualPipeV
order 65.7 %; at m=32, 80.6 %. 24 of a rank's 32 forwards are paired; what stays exposed (62.4
ms of 168) is the fill and the drain: microbatch 0's forwards and microbatch 15's input
gradients cross every stage with nothing to pair with (33.6 ms of it, an action at a time), the
other unpaired warm-up forwards and cool-down backwards the rest. The runs read a few points
above it: a pair also spends one action's host time (the executor's, gloo's) where the unpaired
runs spend two.

At the first size also torch.pipelining's DualPipeV: its per-rank order, computed by torch's
own ``ScheduleDualPipeV`` (``bench.synthesized.torch_order``), run on the plugin's executor with
the same pairing (its OVERLAP_F_B cells are F's followed by a B of the other chunk); not
torch's runtime. Not here: Megatron's own combined 1F1B (its per-layer plan needs Megatron's
layers and CUDA streams inside its own code; its interleaved order does not pair here: a
steady-state B's gradient arrives after the F it would pair with). The CUDA-stream check is
``bench/gpu_moe.py`` (part of ``bench/gpu_check.py``).

    .venv/bin/python -m bench.moe_overlap [--sizes 4x16 4x32 2x8 2x32] [--share 0.3] [--c-ms 4]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

ROWS, WIDTH = 4, 8
RESULTS = ROOT / "bench" / "results"


@dataclass(frozen=True)
class MoECosts:
    c: float  # a layer's forward compute, seconds
    a: float  # one all-to-all, seconds
    layers: int  # MoE layers per chunk

    def of(self, kind: str) -> float:
        """An action run by itself: its compute and, but for W, its two all-to-alls per layer."""
        compute = {"F": self.c, "I": self.c, "W": self.c, "B": 2 * self.c}[kind]
        return self.layers * (compute + (0.0 if kind == "W" else 2 * self.a))


#: one layer of an F&B pair as Megatron's TransformerLayerSchedulePlan.run orders its nodes:
#: (node, stream, the node it waits for on the other stream); in stream order on each stream
PAIR_LAYER = (("combine(b)", "comm", None), ("attention(f)", "comp", None),
              ("dispatch(f)", "comm", "attention(f)"), ("experts(b)", "comp", "combine(b)"),
              ("dispatch(b)", "comm", "experts(b)"), ("experts(f)", "comp", "dispatch(f)"),
              ("combine(f)", "comm", "experts(f)"), ("attention(b)", "comp", "dispatch(b)"))


def pair_layer_span(costs: MoECosts, b_kind: str) -> float:
    """How long one layer of an F&B pair lasts on two streams (PAIR_LAYER): each node starts
    once its stream is free and the node it waits for has ended, as a device runs what is
    queued on its streams."""
    half_b = (2 * costs.c if b_kind == "B" else costs.c) / 2
    cost = {"combine(b)": costs.a, "attention(f)": costs.c / 2, "dispatch(f)": costs.a,
            "experts(b)": half_b, "dispatch(b)": costs.a, "experts(f)": costs.c / 2,
            "combine(f)": costs.a, "attention(b)": half_b}
    free = {"comm": 0.0, "comp": 0.0}
    ended = {}
    for node, stream, after in PAIR_LAYER:
        ended[node] = free[stream] = max(free[stream], ended.get(after, 0.0)) + cost[node]
    return max(free.values())


def work_class(paired: bool):
    from bench.emulated_device import DeviceClock, device_work_class
    from support.emulated import EmulatedStageWork

    class MoEStageWork(device_work_class()):
        """The toy stages' arithmetic; each action lasts what an MoE chunk's would alone
        (``MoECosts.of``, through the emulated device's clock), a pair as Megatron's plan."""

        def __init__(self, schedule, rank, weights, inputs, costs: MoECosts):
            super().__init__(schedule, rank, weights, inputs, costs)
            self.pairs = 0

        def _pair(self, f_action, f_input, b_action, b_grad):
            self.pairs += 1
            start = time.perf_counter()
            out = EmulatedStageWork.forward(self, f_action, f_input)
            grad = EmulatedStageWork.backward(self, b_action, b_grad)
            # the layers one after the other, each lasting its span on the device's clock (the
            # pair's CPU work absorbed, as a lone action's is)
            span = pair_layer_span(self.device_costs, b_action.kind)
            DeviceClock.wait_until(start + self.device_costs.layers * span)
            return out, grad

    if paired:
        MoEStageWork.overlapped_forward_backward = MoEStageWork._pair
    return MoEStageWork


def _work(schedule, rank, costs: MoECosts, paired: bool):
    from support.emulated import microbatch_inputs, stage_weights

    return work_class(paired)(schedule, rank, stage_weights(schedule.num_stages, WIDTH),
                              microbatch_inputs(schedule.num_microbatches, ROWS, WIDTH), costs)


def _steps(schedule, rank, transport, costs: MoECosts, posting: str | None) -> list[tuple]:
    """The rank's compiled steps for one run, derived once, before any clock starts (as the
    drop-in derives them once per schedule): ``posting``, the pairs' (COMMIT or LOCKSTEP), or
    None for no pairs (the program the executor would derive itself)."""
    from megatron_pp_ext.analysis.lowering import lower
    from megatron_pp_ext.analysis.program_steps import compile_steps
    from megatron_pp_ext.runtime.executor import steps_for

    if posting is None:
        return steps_for(schedule, rank, transport, _work(schedule, rank, costs, False))
    return compile_steps(lower(schedule, posting, overlapped_pairs=True), rank, schedule)


def _step(schedule, rank, transport, costs: MoECosts, paired: bool, steps: list[tuple]
          ) -> tuple[float, float, int]:
    """One step of ``steps`` (``_steps``); its start, its end and the pairs it ran."""
    from megatron_pp_ext.runtime.executor import Executor

    work = _work(schedule, rank, costs, paired)
    start = time.perf_counter()
    Executor(schedule, rank, transport, work, recv_shape=(ROWS, WIDTH), dtype=torch.float64,
             device=torch.device("cpu"), timeout_s=300, steps=steps).run()
    return start, time.perf_counter(), work.pairs


TORCH_DUALPIPEV = "torch.pipelining's DualPipeV order"


def _schedule(order: str, p: int, m: int):
    from bench.synthesized import torch_order
    from megatron_pp_ext.schedules import build_schedule

    if order == TORCH_DUALPIPEV:
        schedule = torch_order("DualPipeV", p, m)
        schedule.options["overlapped_pairs"] = True  # its OVERLAP_F_B cells
        return schedule
    return build_schedule(order, p, m, chunks=2)


def paired_actions(schedule, posting: str) -> list[frozenset[int]]:
    """Per rank, the i whose action the executor computes with action i + 1: the pairs of the
    program lowered with ``posting`` (what the paired runs execute)."""
    from megatron_pp_ext.analysis.lowering import lower
    from megatron_pp_ext.analysis.program_steps import STEP_COMPUTE, compile_steps

    program = lower(schedule, posting, overlapped_pairs=True)
    return [frozenset(step[1] for step in compile_steps(program, rank, schedule)
                      if step[0] == STEP_COMPUTE and step[2])
            for rank in range(schedule.num_ranks)]


def device_only_step(schedule, costs: MoECosts, paired: list[frozenset[int]]) -> float:
    """The step on the device's clock alone: no host time and every message free; each rank
    runs its actions in order (the i in ``paired[rank]`` with action i + 1, as one, lasting
    ``pair_layer_span`` a layer), each once the actions it needs have ended. What the order
    itself allows."""
    from megatron_pp_ext.schedules.validate import completion_key, dependencies

    needs = dependencies(schedule)
    units = []  # per rank: its actions, a pair as one unit of two
    for rank, row in enumerate(schedule.actions):
        mine, i = [], 0
        while i < len(row):
            width = 2 if i in paired[rank] else 1
            mine.append(row[i:i + width])
            i += width
        units.append(mine)
    ended, position, free = {}, [0] * len(units), [0.0] * len(units)
    moved = True
    while moved:
        moved = False
        for rank, mine in enumerate(units):
            while position[rank] < len(mine):
                unit = mine[position[rank]]
                inputs = [needs(action) for action in unit]
                if any(key is not None and key not in ended for key in inputs):
                    break
                start = max([free[rank]] + [ended[key] for key in inputs if key is not None])
                lasts = (costs.layers * pair_layer_span(costs, unit[1].kind) if len(unit) == 2
                         else costs.of(unit[0].kind))
                free[rank] = start + lasts
                for action in unit:
                    ended[completion_key(action)] = free[rank]
                position[rank] += 1
                moved = True
    assert position == [len(mine) for mine in units], "the order cannot finish"
    return max(free)


def hidden_on_the_device_alone(order: str, p: int, m: int, c: float, share: float,
                               layers: int) -> float:
    """The share of the all-to-alls the order's pairs hide on the device alone
    (``device_only_step``, the pairs of DualPipe's commit)."""
    from megatron_pp_ext.analysis.lowering import COMMIT

    schedule = _schedule(order, p, m)
    none = [frozenset()] * p
    floor, alone, paired = (device_only_step(schedule, MoECosts(c, a, layers), pairs)
                            for a, pairs in ((0.0, none), (share * c, none),
                                             (share * c, paired_actions(schedule, COMMIT))))
    return (alone - paired) / (alone - floor)


def tree(rank: int, world: int, m: int, c: float, share: float, layers: int, reps: int,
         order: str = "dualpipev") -> dict:
    """Spawn target: the four runs, ``reps`` rounds in rotating order, in one process tree."""
    import torch.distributed as dist

    from megatron_pp_ext.analysis.lowering import COMMIT, LOCKSTEP
    from megatron_pp_ext.runtime.transport import TorchDistTransport

    schedule = _schedule(order, world, m)
    transport = TorchDistTransport(None)
    runs = {label: (costs, posting is not None,
                    _steps(schedule, rank, transport, costs, posting))
            for label, costs, posting in (
                ("floor (a = 0)", MoECosts(c, 0.0, layers), None),
                ("all-to-alls alone", MoECosts(c, share * c, layers), None),
                ("paired, DualPipe's commit", MoECosts(c, share * c, layers), COMMIT),
                ("paired, lockstep rounds", MoECosts(c, share * c, layers), LOCKSTEP))}
    labels = list(runs)
    out = {label: [] for label in labels}
    pairs = {}
    for label in labels:  # one untimed warm-up each
        dist.barrier()
        _step(schedule, rank, transport, *runs[label])
    for rep in range(reps):
        for label in labels[rep % len(labels):] + labels[:rep % len(labels)]:
            dist.barrier()
            start, end, pairs[label] = _step(schedule, rank, transport, *runs[label])
            spans = [None] * world
            dist.all_gather_object(spans, (start, end))
            out[label].append(max(e for _, e in spans) - min(s for s, _ in spans))
    counts = [None] * world
    dist.all_gather_object(counts, pairs["paired, DualPipe's commit"])
    return {"steps": out, "pairs_per_rank": counts}


def _size(text: str) -> tuple[int, int]:
    p, m = text.lower().split("x")
    return int(p), int(m)


def main(argv=None) -> int:
    from megatron_pp_ext.train.processes import spawn

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=_size, nargs="+",
                        default=[(4, 16), (4, 32), (2, 8), (2, 32)],
                        help="p x m, e.g. 4x16 (the issue's size first)")
    parser.add_argument("--share", type=float, default=0.3, help="a / c")
    parser.add_argument("--c-ms", type=float, default=4.0, help="a layer's forward compute")
    parser.add_argument("--layers", type=int, default=1, help="MoE layers per chunk")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS, help="the folder for the results")
    args = parser.parse_args(argv)
    from bench.provenance import current, finish, short

    started, prov = time.perf_counter(), current(argv)
    rows, raw = [], []
    runs = [(p, m, "dualpipev") for p, m in args.sizes]
    runs.insert(1, (*args.sizes[0], TORCH_DUALPIPEV))
    runs.insert(2, (*args.sizes[0], "dualpipe"))  # the bidirectional DualPipe, its own pairs
    for p, m, order in runs:
        result = spawn(p, tree, m, args.c_ms / 1000, args.share, args.layers, args.reps, order,
                       timeout_s=1200)[0]
        steps = {label: statistics.median(times) for label, times in result["steps"].items()}
        floor, alone, commit, rounds = steps.values()
        hidden, hidden_rounds = ((alone - paired) / (alone - floor) if alone > floor
                                 else float("nan") for paired in (commit, rounds))
        alone_share = hidden_on_the_device_alone(order, p, m, args.c_ms / 1000, args.share,
                                                 args.layers)
        cells = [f"{1e3 * steps[label]:.1f} ({1e3 * min(times):.1f}-{1e3 * max(times):.1f})"
                 for label, times in result["steps"].items()]
        rows.append(f"| {order} | {p} | {m} | {' | '.join(cells)} | "
                    f"{result['pairs_per_rank']} | {hidden:.0%} | {hidden_rounds:.0%} | "
                    f"{alone_share:.1%} |")
        raw.append({"order": order, "p": p, "m": m, **result, "hidden": hidden,
                    "hidden_lockstep_rounds": hidden_rounds,
                    "hidden_on_the_device_alone": alone_share})
    prov = finish(prov, started)
    text = "\n".join([
        "# (h) MoE all-to-all hidden by DualPipeV's F&B pairs (emulated device)",
        "",
        short(prov),
        "",
        f"{args.layers} MoE layer(s) per chunk, a layer's forward compute "
        f"{args.c_ms:g} ms, each all-to-all {args.share:.0%} of it; steps in ms, median "
        f"(min-max) of {args.reps} rounds, the four runs rotating in one process tree; "
        "hidden: (alone - paired) / (alone - floor), with the pairs posted as DualPipe "
        "commits them and in lockstep rounds (the unpaired runs: Megatron's fused calls, "
        "as on gloo). Target (issue 43): at least 70 % at p=4, m=16. torch.pipelining's "
        "DualPipeV order: computed by torch's own ScheduleDualPipeV, run on the plugin's "
        "executor (not torch's runtime). On the device alone: what the order's pairs hide "
        "with no host time and every message free (`device_only_step`: each rank's actions "
        "in order, a pair lasting its two streams' span).",
        "",
        "| order | p | m | floor (a = 0) | all-to-alls alone | paired, DualPipe's commit "
        "| paired, lockstep rounds | F&B pairs per rank | hidden (commit) | hidden (rounds) "
        "| hidden on the device alone |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
        *rows]) + "\n"
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "moe_overlap.md").write_text(text)
    (args.out / "moe_overlap.json").write_text(json.dumps(
        {"provenance": prov, "args": {**vars(args), "sizes": args.sizes, "out": str(args.out)},
         "runs": raw}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
