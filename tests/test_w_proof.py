"""Proof that W does the work (issue 13, part 2), for every split schedule.

Comparing a split schedule's final gradients with 1F1B's would also pass if every weight
gradient were computed in I. Here each rank watches every B, I and W of a step on the tiny
Megatron-Core GPT (``support.wgrad_runs.w_proof_step``: its parameters' gradients before and
after each action):

* after an I, no deferred weight (Megatron's linears, TE modules) has changed, bit for bit;
* a W changes only deferred weights, and each by exactly what the full backward of that
  (stage, microbatch) adds: the change its B makes in a 1F1B step on the same model and data
  (matched by global parameter name and microbatch, so V layouts compare with Megatron's);
* every deferred weight of every microbatch changes in exactly one W (or, for DualPipeV's
  full B actions, one B), and the final gradients equal 1F1B's;
* ``StepResult.weight_grads`` reports per rank the GEMMs I queued and W ran, and W's seconds.
"""

import pytest
import torch

from megatron_pp_ext.train.processes import spawn
from support.te_standin import te_layer_spec
from support.wgrad_runs import w_proof_steps

pytestmark = pytest.mark.megatron_cpu
FP32 = dict(rtol=1e-5, atol=1e-6)


def watched(world_size, split, layout="loop", **common):
    """The split schedule's step (in ``layout``) and 1F1B's (Megatron's layout), each rank
    watched; per run, the ranks' results."""
    per_rank = spawn(world_size, w_proof_steps,
                     [dict(name=split, layout=layout, **common), dict(name="1f1b", **common)],
                     timeout_s=240)
    return [[ranks[i] for ranks in per_rank] for i in range(2)]


def assert_w_does_the_work(split_ranks, reference_ranks):
    for r in split_ranks + reference_ranks:
        assert r["violations"] == [], r["violations"][:5]
    got = {k: v for r in split_ranks for k, v in r["deltas"].items()}
    want = {k: v for r in reference_ranks for k, v in r["deltas"].items()}
    assert sorted(got) == sorted(want) and want  # every (weight, microbatch), once
    assert {kind for kind, _ in want.values()} == {"B"}
    from_w = [k for k, (kind, _) in got.items() if kind == "W"]
    assert from_w
    for key, (kind, change) in got.items():
        torch.testing.assert_close(change, want[key][1], **FP32, msg=str(key))
        assert change.abs().max() > 0, key  # each microbatch contributes
    for r in split_ranks:
        assert r["counts"]["I"] == r["counts"]["W"] > 0
        stats = r["weight_grads"]
        assert stats["deferred"] == stats["in_w"] > 0 and stats["kept_in_i"] == 0, stats
        assert stats["w_seconds"] > 0
    # one weight GEMM per deferred weight per W'd microbatch
    assert sum(r["weight_grads"]["in_w"] for r in split_ranks) == len(from_w)
    grads = {k: g for r in split_ranks for k, g in r["grads"].items()}
    reference = {k: g for r in reference_ranks for k, g in r["grads"].items()}
    assert sorted(grads) == sorted(reference)
    for name, grad in reference.items():
        torch.testing.assert_close(grads[name], grad, **FP32, msg=name)
    return from_w, got


@pytest.mark.parametrize("name,layout", [
    ("zb-h1", "loop"), ("zb-h2", "loop"), ("zb-v", "v"), ("dualpipev", "v")])
def test_w_holds_every_deferred_weight_gradient(name, layout):
    split, reference = watched(2, name, layout=layout)
    from_w, got = assert_w_does_the_work(split, reference)
    if name == "dualpipev":  # DualPipeV pairs some full B's with its I/W's
        assert any(kind == "B" for kind, _ in got.values())
    else:  # every deferred weight gradient of every microbatch came from a W
        assert len(from_w) == len(got)


def test_w_holds_te_weight_gradients():
    """Transformer Engine stand-in linears (TE's deferral switched on by the plugin)."""
    split, reference = watched(2, "zb-v", layout="v", layer_spec_fn=te_layer_spec)
    from_w, got = assert_w_does_the_work(split, reference)
    assert len(from_w) == len(got)
    assert all(r["weight_grads"]["by_kind"]["te"] > 0 for r in split)


def test_w_holds_sequence_parallel_weight_gradients():
    """tp=2 x pp=2 with sequence parallelism: W re-gathers the input of the column-parallel
    linears and adds exactly the full backward's gradient."""
    split, reference = watched(4, "zb-h1", tp=2, sp=True)
    from_w, got = assert_w_does_the_work(split, reference)
    assert len(from_w) == len(got)
    assert all(r["weight_grads"]["by_kind"]["linear+sp"] > 0 for r in split)
