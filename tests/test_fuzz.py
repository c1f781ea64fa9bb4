"""Fuzz: 200 random (schedule, p <= 6, m <= 16, v, options) runs of the one executor on the
in-memory transport, each rank slowed by its own random delay per action, finish (no hang:
every wait has a timeout and the run as a whole a deadline) with exactly the gradients and
losses of the same schedule run without delays, and within rounding of the pp=1 run."""

from __future__ import annotations

import random
from collections import Counter

import torch

from megatron_pp_ext.ir import ScheduleError
from megatron_pp_ext.schedules import build_schedule

from support.inmemory import assert_equals_pp1, gathered, run_inmemory

RUNS = 200
SEED = 20260511
MAX_DELAY_S = 0.001  # per action, per rank; 0..1 ms keeps 200 runs well under 30 s
SCHEDULES = ["gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2", "zb-v", "dualpipev"]


def draw(rng: random.Random):
    """One random valid configuration: (name, p, m, v, builder options)."""
    while True:
        name = rng.choice(SCHEDULES)
        p, m = rng.randint(1, 6), rng.randint(1, 16)
        v, options = 1, {}
        if name == "interleaved":
            v = rng.choice([2, 3])
            if rng.random() < 0.5:
                options["microbatch_group_size_per_vp_stage"] = rng.randint(p, max(p, m))
        elif name in ("zb-v", "dualpipev"):
            v = 2
            if name == "dualpipev" and rng.random() < 0.3:
                options["match_dualpipe"] = True
        elif name in ("zb-h1", "zb-h2") and rng.random() < 0.5:
            options["max_pending_backward"] = rng.randint(1, 2 * p)
        try:
            return name, p, m, v, options, build_schedule(name, p, m, chunks=v, **options)
        except ScheduleError:
            continue  # a combination the builder refuses (e.g. interleaved with m < p)


def test_random_runs_with_random_delays_match_the_undelayed_runs():
    rng = random.Random(SEED)
    seen: Counter = Counter()
    undelayed: dict = {}
    for run in range(RUNS):
        name, p, m, v, options, schedule = draw(rng)
        seen[name] += 1
        delays = [rng.choice([0.0, rng.uniform(0.0, MAX_DELAY_S)]) for _ in range(p)]
        where = f"run {run}: {name} p={p} m={m} v={v} {options} delays={delays}"
        # Deadline per wait 10 s, per run 20 s: a hang fails the run instead of the suite.
        results = run_inmemory(schedule, delays=delays, timeout_s=10.0)
        grads, losses = gathered(results)
        key = (name, p, m, v, tuple(sorted(options.items())))
        if key not in undelayed:
            undelayed[key] = gathered(run_inmemory(schedule, timeout_s=10.0))
        want_grads, want_losses = undelayed[key]
        assert sorted(grads) == list(range(schedule.num_stages)), where
        for stage, grad in want_grads.items():
            assert torch.equal(grads[stage], grad), f"{where}: stage {stage} gradient differs"
        assert losses == want_losses, where
        assert_equals_pp1(results, schedule, where)
    # every schedule was drawn often enough to mean something
    assert set(seen) == set(SCHEDULES) and min(seen.values()) >= 10, seen
