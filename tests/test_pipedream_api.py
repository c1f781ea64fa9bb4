"""The Python API (``runtime.pipedream.AsyncPipeline``): model chunks and an optimizer, on the
in-memory transport and over gloo processes, equal to the papers' update rules."""

from __future__ import annotations

import pytest
import torch

from megatron_pp_ext.runtime.inmemory import run_ranks_in_threads
from megatron_pp_ext.runtime.pipedream import AsyncPipeline
from support.emulated import microbatch_inputs, stage_weights
from support.pipedream import (
    LR,
    ROWS,
    WIDTH,
    ToyStage,
    reference_2bw,
    reference_pipedream,
)


def _forward_fn(p, inputs):
    def forward_fn(stage, microbatch, call, input_tensor):
        y = call(inputs[microbatch] if stage == 0 else input_tensor)
        return y.sum() if stage == p - 1 else y
    return forward_fn


def _rank(rank, transport, name, m, steps, vertical_sync=False):
    p = transport.world_size
    weights = stage_weights(p, WIDTH)
    inputs = microbatch_inputs(m * steps, ROWS, WIDTH)
    module = ToyStage(weights[rank])
    optimizer = torch.optim.SGD(module.parameters(), lr=LR)
    pipeline = AsyncPipeline(name, [module], optimizer, _forward_fn(p, inputs),
                             num_microbatches=m, steps=steps, vertical_sync=vertical_sync,
                             recv_shape=(ROWS, WIDTH), dtype=torch.float64,
                             transport=transport, timeout_s=30)
    result = pipeline.run()
    return (module.weight.detach().clone(), result.losses, result.max_versions_held,
            result.max_stashed_bytes, result.losses_per_step(m))


@pytest.mark.parametrize("name,vertical_sync", [("pipedream", False), ("pipedream", True),
                                                ("pipedream-2bw", False)])
def test_api_inmemory_equals_reference(name, vertical_sync):
    p, m, steps = 3, 4, 3
    out = run_ranks_in_threads(p, lambda r, t: _rank(r, t, name, m, steps, vertical_sync))
    if name == "pipedream":
        want, want_losses = reference_pipedream(p, m * steps, vertical_sync)
    else:
        want, want_losses = reference_2bw(p, m, steps)
    for s in range(p):
        torch.testing.assert_close(out[s][0], want[s], rtol=1e-12, atol=1e-12)
    assert out[-1][1] == pytest.approx(want_losses, rel=1e-12)
    assert out[0][1] == []  # losses live on the last stage
    assert len(out[-1][4]) == steps
    bytes_per_version = WIDTH * WIDTH * 8
    for rank in range(p):
        held = out[rank][2]
        assert out[rank][3] == held * bytes_per_version
        if name == "pipedream-2bw":
            assert held == 2
        elif not vertical_sync:
            assert held == p - rank


def _gloo_rank(rank, world_size, name, m, steps):
    from megatron_pp_ext.runtime.transport import TorchDistTransport

    return _rank(rank, TorchDistTransport(None, timeout_s=60), name, m, steps)


@pytest.mark.parametrize("name", ["pipedream", "pipedream-2bw"])
def test_api_over_gloo_equals_reference(name):
    from megatron_pp_ext.train.processes import spawn

    p, m, steps = 2, 2, 3
    out = spawn(p, _gloo_rank, name, m, steps, timeout_s=120)
    want, _ = (reference_pipedream(p, m * steps) if name == "pipedream"
               else reference_2bw(p, m, steps))
    for s in range(p):
        torch.testing.assert_close(out[s][0], want[s], rtol=1e-12, atol=1e-12)
