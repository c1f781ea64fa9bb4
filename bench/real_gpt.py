"""Bench (b): the tiny real Megatron-Core GPTModel on CPU / gloo, p=4: the plugin's ``1f1b``
(``ScheduleFunction("1f1b")``, the drop-in forward_backward_func) against Megatron-Core's own
``forward_backward_pipelining_without_interleaving``.

One process tree builds the model once and alternates the two functions step by step (the
order flips every round), each step between two barriers; a step's time is the last rank's
end minus the first rank's start. ``runs`` such trees, each a fresh set of processes, one after
the other. Reported: per run, the median step of each and the median of the per-round ratios;
over all runs, the spread of both. This is CPU-bound (4 ranks computing on the machine's
cores, 2 here, next to whatever else runs), so single rounds and even single runs are noisy:
the spread, not one median, is the figure.
"""

from __future__ import annotations

import statistics
import time

LABELS = ("plugin 1f1b", "megatron 1f1b")


def tree(rank: int, world: int, m: int, steps: int) -> dict:
    import torch.distributed as dist
    from megatron.core.pipeline_parallel import schedules as mcore

    from megatron_pp_ext.models import tiny_gpt
    from megatron_pp_ext.train.processes import init_megatron
    from megatron_pp_ext.integration.forward_backward import ScheduleFunction

    cfg = tiny_gpt.TinyGPTConfig()
    init_megatron(world, None, seed=cfg.seed)
    config = tiny_gpt.make_transformer_config(cfg, world, None)
    chunks = tiny_gpt.build_model_chunks(cfg, vp_size=None, layout="loop", config=config)
    batches = tiny_gpt.mock_batches(cfg, m, seed=0)
    functions = {"plugin 1f1b": ScheduleFunction("1f1b"),
                 "megatron 1f1b": mcore.forward_backward_pipelining_without_interleaving}

    def step(label):
        for chunk in chunks:
            chunk.zero_grad(set_to_none=False)
        dist.barrier()
        start = time.perf_counter()
        functions[label](forward_step_func=tiny_gpt.forward_step_func,
                         data_iterator=iter(batches), model=chunks, num_microbatches=m,
                         seq_length=cfg.seq_length, micro_batch_size=cfg.micro_batch_size)
        return start, time.perf_counter()

    for label in LABELS:  # warm-up
        step(label)
    times = {label: [] for label in LABELS}
    for i in range(steps):
        order = LABELS if i % 2 == 0 else LABELS[::-1]
        for label in order:
            times[label].append(step(label))
    dist.barrier()
    return times


def run(p: int = 4, m: int = 8, steps: int = 10, runs: int = 3,
        timeout_s: float = 600) -> dict:
    """``runs`` fresh process trees, ``steps`` rounds each."""
    from bench.provenance import utc_now

    out = []
    for _ in range(runs):
        started = utc_now()
        out.append({**one_run(spawn_tree(p, m, steps, timeout_s)), "utc_start": started,
                    "utc_end": utc_now()})
    return {"p": p, "m": m, "steps": steps, "runs": out}


def spawn_tree(p: int, m: int, steps: int, timeout_s: float) -> list:
    from megatron_pp_ext.train.processes import spawn

    return spawn(p, tree, m, steps, timeout_s=timeout_s)


def one_run(per_rank: list) -> dict:
    times = {}
    for label in LABELS:
        runs = zip(*(r[label] for r in per_rank))
        times[label] = [max(e for _, e in run) - min(s for s, _ in run) for run in runs]
    ratios = [a / b for a, b in zip(times["plugin 1f1b"], times["megatron 1f1b"])]
    medians = {label: statistics.median(times[label]) for label in LABELS}
    return {"times": times, "median": medians, "ratios": ratios,
            "ratio": statistics.median(ratios),
            "ratio_of_medians": medians["plugin 1f1b"] / medians["megatron 1f1b"]}
