"""Bench (g): schedules built for costs and memory (zb-auto, v-half, v-min) against every
fixed schedule and torch.pipelining's V orders, with per-stage costs from real models.

Costs. Each stage's F, I, W of an 8B-class GPT (Llama-3-8B's shape: 32 layers, hidden 4096,
SwiGLU 14336, GQA 8 groups, a 128 256-token vocabulary, sequence 8192, micro-batch 1, bf16)
priced from its FLOPs on an H100 (``plan -- ARGS --gpu H100``: the output layer over the
padded vocabulary makes the last stage about 1.6x a middle one at p = 4), for the loop layout
(p stages) and for the V layout (2p stages), then scaled so that a middle rank's F is 20 ms.
Messages take 0.3 of a middle rank's chunk forward (6 ms at v = 1; the same time per message
for v = 2). Memory: 1F1B's peak, p microbatches of a rank's layers, on every rank.

Rows. Per layout: the plugin's fixed schedules (1f1b runs Megatron's 1F1B order, bit for bit;
interleaved, Megatron's interleaved order, v = 2 in the loop layout), torch.pipelining's
ZBVZeroBubble and DualPipeV orders (computed by torch 2.13's own code, run on our executor),
v-half, v-min, and zb-auto built for that layout's costs. For each: the simulator's step time
(buffered model), the peak in v=1 units, and the step measured on the emulated device (p gloo
processes, each action sleeping its stage's cost, ``emulated_device.DeviceClock``), median of
``reps`` rounds in rotating order, one step between barriers. The floor: the busiest rank's
total work plus the fill it cannot avoid (its first forward's earliest start).

    .venv/bin/python bench/synthesized.py            # p=4 m=16 and p=8 m=32, 3 rounds
    .venv/bin/python bench/synthesized.py --quick    # p=4 m=16 only, 2 rounds
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT, ROOT / "tests"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

MODEL = ["--num-layers", "32", "--hidden-size", "4096", "--ffn-hidden-size", "14336",
         "--num-attention-heads", "32", "--group-query-attention", "--num-query-groups", "8",
         "--seq-length", "8192", "--max-position-embeddings", "8192", "--micro-batch-size",
         "1", "--vocab-size", "128256", "--swiglu", "--bf16", "--untie-embeddings-and-output-"
         "weights", "--position-embedding-type", "rope", "--normalization", "RMSNorm",
         "--disable-bias-linear", "--tokenizer-type", "NullTokenizer"]
T_MIDDLE = 0.020  # a middle rank's F, seconds
COMM = 0.3  # a message, in middle chunk forwards


def stage_costs(p: int, m: int, chunks: int) -> dict[str, list[float]]:
    """Per stage F, I, W seconds of the model at p, m, v chunks per rank, from its FLOPs."""
    from megatron_pp_ext.planner.pretrain_plan import plan_pretrain

    argv = MODEL + ["--pipeline-model-parallel-size", str(p), "--global-batch-size", str(m)]
    if chunks == 2:
        argv += ["--num-virtual-stages-per-pipeline-rank", "2"]
    plan = plan_pretrain(argv, schedule="zb-v" if chunks == 2 else "1f1b", gpu="H100",
                         world_size=p)
    return {kind: list(plan.stage_costs[kind]) for kind in ("t_f", "t_i", "t_w")}


def scaled(costs: dict, p: int, chunks: int) -> dict:
    """Costs scaled so that a middle rank's share of F is ``T_MIDDLE`` (per chunk 1/v)."""
    middle = costs["t_f"][p // 2] * chunks  # a middle rank's share
    factor = T_MIDDLE / middle
    return {kind: [x * factor for x in values] for kind, values in costs.items()}


def torch_order(name: str, p: int, m: int):
    """torch.pipelining's per-rank order for ZBVZeroBubble / DualPipeV, by its own code."""
    from torch.distributed.pipelining import schedules as torch_schedules

    from megatron_pp_ext.ir import Schedule

    cls = {"ZBVZeroBubble": torch_schedules.ScheduleZBVZeroBubble,
           "DualPipeV": torch_schedules.ScheduleDualPipeV}[name]
    order = object.__new__(cls)  # the attributes its __init__ sets before computing orders
    order.pp_group_size, order.n_local_stages = p, 2
    order._num_stages = order.num_stages = 2 * p
    order._n_microbatches = m
    rows = [",".join(str(a) for a in order._calculate_single_rank_operations(r)
                     if a is not None) for r in range(p)]
    return Schedule.from_csv("\n".join(rows) + "\n", name=f"torch {name}")


def rows_for(p: int, m: int) -> dict:
    """{label: schedule} and the costs per layout."""
    from megatron_pp_ext.schedules import build_schedule

    costs = {1: scaled(stage_costs(p, m, 1), p, 1), 2: scaled(stage_costs(p, m, 2), p, 2)}
    comm = COMM * costs[1]["t_f"][p // 2] / 2  # 0.3 of a middle chunk forward (v = 2)
    schedules = {}
    for name in ("1f1b", "zb-h1", "zb-h2"):
        schedules[name] = (build_schedule(name, p, m), 1)
    schedules["interleaved"] = (build_schedule("interleaved", p, m, 2), 2)
    for name in ("zb-v", "dualpipev", "v-half", "v-min"):
        schedules[name] = (build_schedule(name, p, m), 2)
    for name in ("ZBVZeroBubble", "DualPipeV"):
        schedules[f"torch {name}"] = (torch_order(name, p, m), 2)
    for chunks in (1, 2):
        shares = _shares(costs[chunks], build_schedule("1f1b" if chunks == 1 else "zb-v", p, m))
        schedules[f"zb-auto v={chunks}"] = (build_schedule(
            "zb-auto", p, m, chunks, t_f=shares["t_f"], t_i=shares["t_i"], t_w=shares["t_w"],
            t_comm=comm, memory_budget=p), chunks)
    return {"schedules": schedules, "costs": costs, "comm": comm}


def _shares(costs: dict, schedule) -> dict:
    """A rank's share per kind: its stages' costs summed."""
    return {kind: [sum(values[s] for s in schedule.stages_of(r))
                   for r in range(schedule.num_ranks)] for kind, values in costs.items()}


def floor(schedule, costs: dict, comm: float) -> float:
    """The busiest rank's total work plus the earliest its first forward can start."""
    from megatron_pp_ext.analysis.simulate import CostModel

    per = CostModel.for_stages(**costs).per_stage(schedule)
    best = 0.0
    for rank in range(schedule.num_ranks):
        stages = schedule.stages_of(rank)
        work = sum(per["t_f"][s] + per["t_i"][s] + per["t_w"][s] for s in stages) * \
            schedule.num_microbatches
        first = min(stages)
        fill = sum(per["t_f"][s] for s in range(first)) + comm * sum(
            1 for s in range(first) if schedule.stage_to_rank[s] != schedule.stage_to_rank[s + 1])
        best = max(best, work + fill)
    return best


def tree(rank: int, world: int, p: int, m: int, reps: int) -> dict:
    """Spawn target: every row, one step each between barriers, ``reps`` rotating rounds."""
    import torch
    import torch.distributed as dist

    from bench.emulated_device import DeviceClock, ROWS, WIDTH, device_work_class
    from megatron_pp_ext.runtime.executor import Executor, steps_for
    from megatron_pp_ext.runtime.transport import TorchDistTransport
    from support.emulated import microbatch_inputs, stage_weights

    built = rows_for(p, m)
    transport = TorchDistTransport(None)
    base = device_work_class()

    class StageTimed(base):
        """Each action lasts its own stage's cost."""

        def __init__(self, schedule, rank, weights, inputs, costs):
            super().__init__(schedule, rank, weights, inputs, costs=None)
            self.stage_costs = costs

        def _kind(self, kind, action, method, *args):
            start = time.perf_counter()
            result = method(*args)
            key = {"F": "t_f", "I": "t_i", "W": "t_w"}.get(kind)
            cost = (self.stage_costs["t_i"][action.stage] + self.stage_costs["t_w"][action.stage]
                    if kind == "B" else self.stage_costs[key][action.stage])
            DeviceClock.wait_until(start + cost)
            return result

        def forward(self, action, x):
            return self._kind("F", action, super(base, self).forward, action, x)

        def backward(self, action, grad):
            return self._kind(action.kind, action, super(base, self).backward, action, grad)

        def weight(self, action):
            return self._kind("W", action, super(base, self).weight, action)

    labels = list(built["schedules"])
    times = {label: [] for label in labels}
    steps = {}  # each schedule's compiled steps on this rank, derived once before any clock
    for label in labels:
        schedule, chunks = built["schedules"][label]
        steps[label] = steps_for(schedule, rank, transport, StageTimed(
            schedule, rank, stage_weights(schedule.num_stages, WIDTH),
            microbatch_inputs(m, ROWS, WIDTH), built["costs"][chunks]))
    for round_ in range(reps + 1):  # round 0 warms up, not kept
        order = labels[round_ % len(labels):] + labels[:round_ % len(labels)]
        for label in order:
            schedule, chunks = built["schedules"][label]
            weights = stage_weights(schedule.num_stages, WIDTH)
            inputs = microbatch_inputs(m, ROWS, WIDTH)
            work = StageTimed(schedule, rank, weights, inputs, built["costs"][chunks])
            dist.barrier()
            start = time.perf_counter()
            Executor(schedule, rank, transport, work, recv_shape=(ROWS, WIDTH),
                     dtype=torch.float64, device=torch.device("cpu"), timeout_s=300,
                     steps=steps[label]).run()
            end = time.perf_counter()
            if round_:
                times[label].append((start, end))
    return times


def run(p: int, m: int, reps: int) -> dict:
    from megatron_pp_ext.analysis.simulate import CostModel, simulate
    from megatron_pp_ext.train.processes import spawn

    built = rows_for(p, m)
    per_rank = spawn(p, tree, p, m, reps, timeout_s=1800)
    rows = []
    for label, (schedule, chunks) in built["schedules"].items():
        costs = CostModel.for_stages(**built["costs"][chunks], t_comm=built["comm"])
        predicted = simulate(schedule, costs)
        rounds = [max(r[label][k][1] for r in per_rank) - min(r[label][k][0] for r in per_rank)
                  for k in range(reps)]
        rows.append({"schedule": label, "v": chunks, "predicted_s": predicted.makespan,
                     "measured_s": statistics.median(rounds), "rounds_s": rounds,
                     "peak_v1": max(predicted.peak_activations) / chunks,
                     "floor_s": floor(schedule, built["costs"][chunks], built["comm"]),
                     "synthesized_from": schedule.options.get("synthesized_from")})
    return {"p": p, "m": m, "reps": reps, "comm_s": built["comm"], "rows": rows,
            "last_over_middle_f": built["costs"][1]["t_f"][-1] / built["costs"][1]["t_f"][p // 2]}


def markdown(result: dict) -> list[str]:
    p, m = result["p"], result["m"]
    rows = result["rows"]
    fixed_peers = [r for r in rows if not r["schedule"].startswith(("zb-auto", "v-"))]
    best_peer = min(fixed_peers, key=lambda r: r["measured_s"])
    autos = [r for r in rows if r["schedule"].startswith("zb-auto")]
    best_auto = min(autos, key=lambda r: r["measured_s"])
    lines = [f"### p={p}, m={m} (last stage {result['last_over_middle_f']:.2f}x a middle one; "
             f"t_comm {result['comm_s'] * 1e3:.1f} ms; budget {p} v=1 units = 1F1B's peak)", "",
             "| schedule | v | measured step | predicted | vs floor (measured) | peak (v=1) | "
             "built from |", "|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: r["measured_s"]):
        spread = f"{min(r['rounds_s']) * 1e3:.0f}-{max(r['rounds_s']) * 1e3:.0f}"
        lines.append(f"| {r['schedule']} | {r['v']} | {r['measured_s'] * 1e3:.1f} ms ({spread})"
                     f" | {r['predicted_s'] * 1e3:.1f} ms | {r['measured_s'] / r['floor_s']:.3f}"
                     f" | {r['peak_v1']:g} | {r['synthesized_from'] or ''} |")
    lines += ["", f"zb-auto (best layout: {best_auto['schedule']}) vs the best fixed or peer "
              f"schedule ({best_peer['schedule']}): {best_auto['measured_s'] / best_peer['measured_s']:.3f}"
              f" of its step; vs the floor: {best_auto['measured_s'] / best_auto['floor_s']:.3f}", ""]
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "synthesized"))
    args = parser.parse_args(argv)
    sizes = [(4, 16)] if args.quick else [(4, 16), (8, 32)]
    reps = args.reps or (2 if args.quick else 3)
    from bench.provenance import current, finish, short

    started, prov = time.perf_counter(), current(argv)
    results = [run(p, m, reps) for p, m in sizes]
    prov = finish(prov, started)
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps({"provenance": prov, "results": results},
                                                   indent=1))
    lines = ["# Schedules built for costs and memory (bench g)", "", short(prov), ""]
    for result in results:
        lines += markdown(result)
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
