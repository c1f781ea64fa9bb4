"""Bench: PipeDream and PipeDream-2BW against flushed 1F1B on an emulated device, over gloo.

Every rank holds one toy stage (``tanh(x @ W)``, ``--width`` square, float64) that sleeps
``t_F`` in each forward and ``t_B`` in each backward, standing in for GPU kernels that leave
the CPU free. All schedules run the same stage code (``runtime.weight_versions.
VersionedStageWork``) through the one executor over gloo (``TorchDistTransport``), ``--steps``
optimizer batches of ``m`` microbatches, SGD:

* ``1f1b`` (barrier): one flushed 1F1B step per batch, the optimizer step after it, and a
  barrier between steps (as Megatron's optimizer step synchronizes the ranks: grad norm);
* ``1f1b`` (back to back): the same steps with no barrier (each rank starts its next step when
  its own part of the previous one is done);
* ``pipedream`` (weight stashing), ``pipedream`` with vertical sync, ``pipedream-2bw``: one
  action list for all batches, no flush.

Reported per schedule: time per microbatch (the whole run / microbatches: measured, and
predicted by ``analysis.simulate``, which also gives the steady state without fill and drain),
the floor (``t_F + t_B``: no rank ever idle), weight versions held per rank and their bytes
(each version a full copy of the stage's weights; 1F1B keeps one: the parameters), and peak
activations per rank with their bytes as the executor measures them (``runtime.memory``: the
saved tensors of the in-flight microbatches; a toy stage saves its input and its output,
2 x rows x width floats a microbatch). Writes ``bench/results/pipedream.{md,json,png}``::

    .venv/bin/python -m bench.pipedream            # p=4, m=8, 4 batches, t_F=20 ms, t_B=40 ms
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"

# (label, schedule name, options)
RUNS = [
    ("1f1b (barrier)", "1f1b", {}),
    ("1f1b (back to back)", "1f1b", {}),
    ("pipedream", "pipedream", {}),
    ("pipedream (vertical sync)", "pipedream", {"vertical_sync": True}),
    ("pipedream-2bw", "pipedream-2bw", {}),
]


@dataclass
class Config:
    p: int = 4
    m: int = 8
    steps: int = 4
    t_f: float = 0.020
    t_b: float = 0.040
    width: int = 256
    rows: int = 64
    lr: float = 0.01
    reps: int = 3


class _Stage(torch.nn.Module):
    def __init__(self, weight):
        super().__init__()
        self.weight = torch.nn.Parameter(weight)

    def forward(self, x):
        return torch.tanh(x @ self.weight)


def _flushed_1f1b(p: int, m: int):
    """1F1B with an optimizer step after the flush, as the versioned work runs it: every
    microbatch on version 0, one update after the last backward."""
    from megatron_pp_ext.schedules import build_schedule

    schedule = build_schedule("1f1b", p, m)
    schedule.options["weight_update"] = {"rule": "1f1b", "batch": m, "delay": 0}
    return schedule


def _rank(rank: int, world: int, cfg: Config) -> dict:
    import torch.distributed as dist

    from megatron_pp_ext.runtime.executor import Executor
    from megatron_pp_ext.runtime.transport import TorchDistTransport
    from megatron_pp_ext.runtime.weight_versions import VersionedStageWork, plan_versions
    from megatron_pp_ext.schedules import build_async_schedule

    class SleepingWork(VersionedStageWork):
        def forward(self, action, input_tensor):
            time.sleep(cfg.t_f)
            return super().forward(action, input_tensor)

        def backward(self, action, output_grad):
            time.sleep(cfg.t_b)
            grad = super().backward(action, output_grad)
            finished.append(time.perf_counter())  # in microbatch order: 1F1B's B's are
            return grad

    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(cfg.width, cfg.width, generator=gen, dtype=torch.float64)
               / cfg.width ** 0.5 for _ in range(cfg.p)]
    inputs = [torch.randn(cfg.rows, cfg.width, generator=gen, dtype=torch.float64)
              for _ in range(cfg.m * cfg.steps)]
    transport = TorchDistTransport(None, timeout_s=120)
    last = cfg.p - 1
    out: dict = {}

    def forward_fn_for(offset):
        def forward_fn(stage, microbatch, call, x):
            y = call(inputs[offset + microbatch] if stage == 0 else x)
            return y.sum() if stage == last else y
        return forward_fn

    def run(schedule, module, optimizer, offset):
        plan = plan_versions(schedule)
        work = SleepingWork(schedule, rank, {rank: module}, optimizer, forward_fn_for(offset),
                            plan=plan)
        executor = Executor(schedule, rank, transport, work, recv_shape=(cfg.rows, cfg.width),
                            dtype=torch.float64, device=torch.device("cpu"), timeout_s=120)
        result = executor.run()
        return work, result

    for rep in range(cfg.reps):
        for label, name, options in RUNS:
            module = _Stage(weights[rank].clone())
            optimizer = torch.optim.SGD(module.parameters(), lr=cfg.lr)
            dist.barrier()
            start = time.perf_counter()
            held, stashed, peak, peak_bytes = 1, 0, 0, 0
            finished: list[float] = []
            if name == "1f1b":
                schedule = _flushed_1f1b(cfg.p, cfg.m)
                for step in range(cfg.steps):
                    if label.endswith("(barrier)") and step:
                        dist.barrier()
                    work, result = run(schedule, module, optimizer, step * cfg.m)
                    peak = max(peak, result.peak_activations)
                    peak_bytes = max(peak_bytes, getattr(result, "peak_bytes", None) or 0)
            else:
                schedule = build_async_schedule(name, cfg.p, cfg.m, steps=cfg.steps, **options)
                work, result = run(schedule, module, optimizer, 0)
                held, stashed = work.max_versions_held(), work.max_stashed_bytes()
                peak = result.peak_activations
                peak_bytes = getattr(result, "peak_bytes", None) or 0
            end = time.perf_counter()
            times = [None] * world
            dist.all_gather_object(times, (start, end))
            seconds = max(e for _, e in times) - min(s for s, _ in times)
            entry = out.setdefault(label, {"seconds": [], "steady": [], "held": held,
                                           "stashed": stashed, "peak": peak,
                                           "peak_bytes": peak_bytes})
            entry["seconds"].append(seconds)
            # steady state on this rank: from the end of batch 0's last backward to the end
            # of the last batch's, per microbatch (the fill before and the drain after excluded)
            m = cfg.m
            entry["steady"].append((finished[-1] - finished[m - 1]) / (len(finished) - m))
    return out


def _predicted(cfg: Config) -> dict:
    from megatron_pp_ext.analysis.simulate import CostModel, async_steady_state, simulate
    from megatron_pp_ext.schedules import build_async_schedule, build_schedule

    costs = CostModel(t_f=cfg.t_f, t_b=cfg.t_b)
    one = simulate(build_schedule("1f1b", cfg.p, cfg.m), costs).makespan / cfg.m
    predicted = {"1f1b (barrier)": (one, one), "1f1b (back to back)": (None, one)}
    for label, name, options in RUNS[2:]:
        whole = simulate(build_async_schedule(name, cfg.p, cfg.m, steps=cfg.steps, **options),
                         costs).makespan / (cfg.m * cfg.steps)
        steady = async_steady_state(name, cfg.p, cfg.m, costs, **options).per_microbatch
        predicted[label] = (whole, steady)
    return predicted


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    for field, value in asdict(Config()).items():
        parser.add_argument(f"--{field.replace('_', '-')}", type=type(value), default=value)
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)
    cfg = Config(**{k: getattr(args, k) for k in asdict(Config())})

    from megatron_pp_ext.train.processes import spawn
    from megatron_pp_ext.train.quiet import hide_megatron_warnings

    hide_megatron_warnings()
    if cfg.steps < 2:
        parser.error("--steps must be >= 2 (the steady state is measured between batches)")

    ranks = spawn(cfg.p, _rank, cfg, timeout_s=600)
    predicted = _predicted(cfg)
    floor = cfg.t_f + cfg.t_b
    version_bytes = cfg.width * cfg.width * 8
    rows = []
    for label, _name, _options in RUNS:
        seconds = statistics.median(ranks[0][label]["seconds"])
        steady = statistics.median(ranks[0][label]["steady"])
        per_mb = seconds / (cfg.m * cfg.steps)
        held = [r[label]["held"] for r in ranks]
        rows.append({
            "schedule": label,
            "seconds_per_microbatch": per_mb,
            "steady_seconds_per_microbatch": steady,
            "predicted_per_microbatch": predicted[label][0],
            "predicted_steady_per_microbatch": predicted[label][1],
            "floor": floor,
            "versions_held_per_rank": held,
            "weight_version_bytes_per_rank": [h * version_bytes for h in held],
            "peak_activations_per_rank": [r[label]["peak"] for r in ranks],
            # the executor's measured peak of saved-tensor bytes (runtime/memory.py; weight
            # versions, leaves that require grad, are not activations and not counted)
            "activation_bytes_per_rank": [r[label]["peak_bytes"] for r in ranks],
            "runs_seconds": ranks[0][label]["seconds"],
        })
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "pipedream.json").write_text(json.dumps({"config": asdict(cfg), "rows": rows},
                                                   indent=1) + "\n")
    (out / "pipedream.md").write_text(_markdown(cfg, rows))
    _figure(cfg, rows, out / "pipedream.png")
    print(_markdown(cfg, rows))
    return 0


def _ms(x) -> str:
    return "-" if x is None else f"{1000 * x:.1f}"


def _kib(values) -> str:
    return "[" + ", ".join(f"{v / 1024:.0f}" for v in values) + "]"


def _markdown(cfg: Config, rows: list[dict]) -> str:
    lines = [
        "# PipeDream and PipeDream-2BW vs flushed 1F1B (emulated device, gloo)",
        "",
        f"`.venv/bin/python -m bench.pipedream`: p = {cfg.p} gloo processes, m = {cfg.m} "
        f"microbatches per optimizer batch, {cfg.steps} batches, t_F = {1000 * cfg.t_f:g} ms, "
        f"t_B = {1000 * cfg.t_b:g} ms (sleeps), one toy stage per rank ({cfg.width} x "
        f"{cfg.width} float64 weights = {cfg.width * cfg.width * 8 / 1024:.0f} KiB a version; "
        f"a held microbatch saves its input and output, 2 x {cfg.rows} x {cfg.width} float64 = "
        f"{2 * cfg.rows * cfg.width * 8 / 1024:.0f} KiB, as the executor measures it), SGD, "
        f"median of {cfg.reps} runs. "
        f"Floor: t_F + t_B = {1000 * (cfg.t_f + cfg.t_b):g} ms per microbatch.",
        "",
        "| schedule | ms per microbatch, whole run (measured) | predicted | steady state "
        "(measured) | predicted | floor | weight versions per rank | their KiB per rank | peak activations per "
        "rank | their KiB per rank (measured) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['schedule']} | {_ms(r['seconds_per_microbatch'])} | "
            f"{_ms(r['predicted_per_microbatch'])} | {_ms(r['steady_seconds_per_microbatch'])} | "
            f"{_ms(r['predicted_steady_per_microbatch'])}"
            f" | {_ms(r['floor'])} | {r['versions_held_per_rank']} | "
            f"{_kib(r['weight_version_bytes_per_rank'])} | {r['peak_activations_per_rank']} | "
            f"{_kib(r['activation_bytes_per_rank'])} |")
    lines += [
        "",
        "1F1B fills and drains the pipeline every step ((m + p - 1)(t_F + t_B) per m "
        "microbatches); the asynchronous schedules fill once and drain once for the whole run, "
        "so their steady state runs at the floor and the whole run approaches it as batches are "
        "added. What they pay: weight versions (PipeDream: p - r on rank r, each a full copy of "
        "the stage's weights; with vertical sync p on every rank; 2BW: 2) and stale gradients "
        "(docs/pipedream.md). 1F1B back to back (no barrier between steps) already overlaps "
        "part of the drain with the next fill. Activations are the same as 1F1B's (p - r).",
        "",
        "![time per microbatch and weight versions](pipedream.png)",
        "",
    ]
    return "\n".join(lines)


def _figure(cfg: Config, rows: list[dict], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # the markdown table carries the same numbers
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.2))
    labels = [r["schedule"] for r in rows]
    x = range(len(rows))
    left.bar([i - 0.3 for i in x], [1000 * r["seconds_per_microbatch"] for r in rows], 0.3,
             label="whole run (measured)")
    left.bar([i for i in x], [1000 * r["steady_seconds_per_microbatch"] for r in rows], 0.3,
             label="steady state (measured)")
    left.bar([i + 0.3 for i in x], [1000 * (r["predicted_steady_per_microbatch"] or 0)
                                    for r in rows], 0.3, label="steady state (predicted)")
    left.axhline(1000 * (cfg.t_f + cfg.t_b), color="k", linestyle="--",
                 label="floor t_F + t_B")
    left.set_xticks(list(x), labels, rotation=20, ha="right", fontsize=8)
    left.set_ylabel("ms per microbatch")
    left.set_title(f"time per microbatch (p={cfg.p}, m={cfg.m}, {cfg.steps} batches)")
    left.set_ylim(0, 1.35 * max(1000 * r["seconds_per_microbatch"] for r in rows))
    left.legend(fontsize=7, ncol=2, loc="upper right")
    ranks = range(cfg.p)
    shown = [r for r in rows if not r["schedule"].startswith("1f1b (back")]
    width = 0.8 / len(shown)
    for k, r in enumerate(shown):
        right.bar([q + k * width for q in ranks],
                  [b / 1024 for b in r["weight_version_bytes_per_rank"]], width,
                  label=r["schedule"])
    right.set_xticks([q + 0.4 - width / 2 for q in ranks], [f"rank {q}" for q in ranks])
    right.set_ylim(0, 1.35 * max(max(r["weight_version_bytes_per_rank"]) for r in rows) / 1024)
    right.set_ylabel("KiB of weight versions")
    right.set_title("weight versions held per rank (1F1B: the parameters)")
    right.legend(fontsize=7, ncol=2, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_loss_curves(summaries: dict[str, str], path: str) -> None:
    """The per-step losses of ``train`` runs (label -> its summary.json) in one figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for label, summary in summaries.items():
        losses = json.loads(Path(summary).read_text())["losses"]
        ax.plot(range(1, len(losses) + 1), losses, label=label)
    ax.set_xlabel("step (optimizer batch of m microbatches)")
    ax.set_ylabel("loss (mean over the batch)")
    ax.set_title("tiny Megatron-Core GPT, p=4, m=8, Adam lr 3e-3, the same data")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
