"""The rank functions the tests give ``verify`` (its ``targets``), each ending in the real
``verify`` rank (``megatron_pp_ext.verify.rank``):

* :func:`rank_as_the_tests_run`: with the tests' CPU patches (support.megatron_loop): the mock
  corpus of short documents, whose index the loop's runs cache under the same
  ``--data-cache-path`` (Megatron's cache key does not tell the two corpora apart: a verify
  rank with Megatron's own corpus would load the loop's index, or leave its own for them).
  A reference run is run once a session per argument set: its merged record is kept in the
  session's cache folder and handed back by rank 0 to a later verify of the same job (the
  cases compare several schedules with one job);

and the faults injected into one run, for the tests that hold ``verify`` to catching them,
each breaking the plugin's run on one pipeline rank (in that rank's process only):

* :func:`rank_without_one_w`: pipeline rank ``pp_rank`` leaves microbatch ``microbatch``'s
  weight gradient out of its first step (the W runs, its gradients are put back before
  Megatron's gradient sync sees them), as a schedule that lost a W would;
* :func:`rank_that_stops_answering`: pipeline rank ``pp_rank`` stops before its forward of
  microbatch ``microbatch`` in its second step (one chunk per rank; it sleeps), as a hung GPU
  would (the second: the plugin's first step waits three times longer).
"""

from __future__ import annotations

import json
import os
import time


def _pipeline_rank() -> int:
    from megatron.core import parallel_state

    return parallel_state.get_pipeline_model_parallel_rank()


def _kept_record(run):
    """Where a reference run's merged record is kept this session (None: not kept)."""
    import hashlib
    import os

    from support.megatron_loop import MOCK_CACHE_ENV

    folder = os.environ.get(MOCK_CACHE_ENV)
    if run.name != "reference" or not folder:
        return None
    key = hashlib.sha256(json.dumps(list(run.argv)).encode()).hexdigest()[:16]
    return os.path.join(folder, f"verify-reference-{key}.json")


def rank_as_the_tests_run(rank, world_size, run, device=None):
    from megatron_pp_ext.verify.rank import run_verify_rank
    from support.megatron_loop import apply_cpu_patches

    kept = _kept_record(run)
    if kept is not None and os.path.exists(kept):  # every rank sees it: none runs
        with open(kept) as f:
            return json.load(f) if rank == 0 else None
    apply_cpu_patches()
    record = run_verify_rank(rank, world_size, run, device)
    if kept is not None and record is not None:
        with open(kept + ".tmp", "w") as f:
            json.dump(record, f)
        os.replace(kept + ".tmp", kept)
    return record


def rank_without_one_w(rank, world_size, run, device=None, pp_rank=1, microbatch=0):
    from megatron_pp_ext.integration.megatron_stage import MegatronStageWork

    original = MegatronStageWork.weight
    left_out = []

    def weight(self, action):
        if left_out or action.microbatch != microbatch or _pipeline_rank() != pp_rank:
            return original(self, action)
        index = self._chunk(action.stage)
        before = {p: p.main_grad.clone() for p in self.chunks[index].parameters()
                  if getattr(p, "main_grad", None) is not None}
        self.weight_split.backward_weight(action, index)
        for param, grad in before.items():  # the W's contribution, left out
            param.main_grad.copy_(grad)
        left_out.append(action)
        self.grad_sync.after(action)

    MegatronStageWork.weight = weight
    return rank_as_the_tests_run(rank, world_size, run, device)


def rank_that_stops_answering(rank, world_size, run, device=None, pp_rank=0, microbatch=2):
    from megatron_pp_ext.integration.megatron_stage import MegatronStageWork

    original = MegatronStageWork.forward
    seen = []

    def forward(self, action, *args, **kwargs):
        if action.microbatch == microbatch and _pipeline_rank() == pp_rank:
            seen.append(action)
            if len(seen) == 2:
                time.sleep(3600)  # the spawn harness stops this rank once its peer reported
        return original(self, action, *args, **kwargs)

    MegatronStageWork.forward = forward
    return rank_as_the_tests_run(rank, world_size, run, device)
