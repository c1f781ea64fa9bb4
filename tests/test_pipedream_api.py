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


class _MegatronLike:
    """The shape of Megatron's optimizer: a ChainedOptimizer whose ``step()`` is a collective
    (here: it must not be called) over optimizers with local ``prepare_grads`` (main_grad into
    grad) and ``step_with_ready_grads``."""

    class Inner:
        def __init__(self, params, lr, clip):
            self.optimizer = torch.optim.SGD(params, lr=lr)
            self.config = type("Config", (), {"clip_grad": clip})()
            self.param_groups = self.optimizer.param_groups

        def prepare_grads(self):
            for group in self.optimizer.param_groups:
                for p in group["params"]:
                    p.grad = p.main_grad
            return False

        def step_with_ready_grads(self):
            self.optimizer.step()
            return True

    def __init__(self, params, lr, clip=0.0):
        self.chained_optimizers = [self.Inner(params, lr, clip)]
        self.param_groups = self.chained_optimizers[0].param_groups

    def step(self):
        raise AssertionError("Megatron's step() all-reduces the grad norm: never called here")


def _megatron_like_rank(rank, transport, clip=0.0):
    p, m, steps = transport.world_size, 2, 3
    weights = stage_weights(p, WIDTH)
    inputs = microbatch_inputs(m * steps, ROWS, WIDTH)
    module = ToyStage(weights[rank])
    module.weight.main_grad = torch.zeros_like(module.weight)  # as Megatron's DDP gives it
    optimizer = _MegatronLike(list(module.parameters()), LR, clip)
    pipeline = AsyncPipeline("pipedream-2bw", [module], optimizer, _forward_fn(p, inputs),
                             num_microbatches=m, steps=steps, recv_shape=(ROWS, WIDTH),
                             dtype=torch.float64, transport=transport, timeout_s=30)
    pipeline.run()
    assert not module.weight.main_grad.any()  # zeroed after each update
    return module.weight.detach().clone()


def test_megatron_style_optimizer_steps_locally_through_main_grad():
    out = run_ranks_in_threads(2, _megatron_like_rank)
    want, _ = reference_2bw(2, 2, 3)
    for s in range(2):
        torch.testing.assert_close(out[s], want[s], rtol=1e-12, atol=1e-12)


def test_gradient_clipping_is_refused():
    with pytest.raises(ValueError, match="clip_grad=1.0"):
        run_ranks_in_threads(2, lambda r, t: _megatron_like_rank(r, t, clip=1.0))
