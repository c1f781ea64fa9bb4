"""Megatron-Core's OWN schedules on the CPU (gloo, several processes, a tiny real GPTModel)
against the pp=1 run of the same model on the same data; with Megatron's DDP and
overlap_grad_reduce, the plugin's schedules beside them.

Tolerance: none. With fp32, no dropout and the same microbatch order, every split runs the same
floating-point operations in the same order (each stage accumulates its weight gradients over
microbatches 0..m-1, as pp=1 does), so losses and gradients agree bit for bit. A mismatch is
a real difference (wrong stage placement, swapped messages, a different loss scaling).
"""

import gc
import weakref

import pytest
import torch

from megatron_pp_ext.integration.forward_backward import ScheduleFunction
from megatron_pp_ext.models import tiny_gpt
from megatron_pp_ext.train import processes
from megatron_pp_ext.train.processes import SpawnError, spawn
from support.reference import assert_same, merge_results, run_step, run_steps

M = 8  # microbatches
TIMEOUT = 60


def _run(world_size, schedule, **kwargs):
    return merge_results(spawn(world_size, run_step, schedule, timeout_s=TIMEOUT, **kwargs))


# ------------------------------------------------------------------ pure (no processes)


def test_stage_placement_loop_and_v():
    assert [tiny_gpt.chunk_stages(r, 4, 2, "loop") for r in range(4)] == [
        [0, 4], [1, 5], [2, 6], [3, 7]
    ]
    assert [tiny_gpt.chunk_stages(r, 4, 2, "v") for r in range(4)] == [
        [0, 7], [1, 6], [2, 5], [3, 4]
    ]
    assert tiny_gpt.stage_owner(7, 4, 2, "v") == (0, 1)
    assert list(tiny_gpt.stage_layers(tiny_gpt.TinyGPTConfig(), 7, 8)) == [7]
    with pytest.raises(ValueError, match="vp_size=2"):
        tiny_gpt.chunk_stages(0, 4, 3, "v")


def test_global_param_names():
    assert (
        tiny_gpt.global_param_name("module.decoder.layers.1.mlp.linear_fc1.weight", 6)
        == "decoder.layers.7.mlp.linear_fc1.weight"
    )
    assert tiny_gpt.global_param_name("output_layer.weight", 6) == "output_layer.weight"


def test_mock_batches_are_deterministic():
    a = tiny_gpt.mock_batches(num_microbatches=2, seed=3)
    b = tiny_gpt.mock_batches(num_microbatches=2, seed=3)
    for x, y in zip(a, b):
        for k in x:
            assert torch.equal(x[k], y[k])
    assert torch.equal(a[0]["labels"][:, :-1], a[0]["tokens"][:, 1:])


# ------------------------------------------------------------------ launcher


def _raise_on_rank1(rank, world_size):
    if rank == 1:
        raise ValueError("boom from rank 1")
    import torch.distributed as dist

    dist.barrier()  # rank 0 waits here until the parent stops it
    return rank


def _sleep(rank, world_size):
    import threading

    threading.Event().wait()  # forever: only the parent's timeout ends it


def _shim_roundtrip(rank, world_size):
    from megatron.core.pipeline_parallel import schedules

    from megatron_pp_ext.train import cpu_shims

    real_current_device = torch.cuda.current_device
    assert cpu_shims.apply_cpu_shims(force=True)
    assert cpu_shims.apply_cpu_shims(force=True)  # idempotent
    assert torch.cuda.current_device() == "cpu"
    assert schedules.torch.zeros([], dtype=torch.int, device="cuda").device.type == "cpu"
    assert schedules.torch.Tensor is torch.Tensor
    cpu_shims.remove_cpu_shims()
    assert torch.cuda.current_device is real_current_device
    assert schedules.torch is torch
    with cpu_shims.cpu_shims(force=True) as active:
        assert active and cpu_shims.shims_active()
    assert not cpu_shims.shims_active()
    return True


@pytest.mark.megatron_cpu
def test_spawn_returns_errors_and_timeouts(monkeypatch):
    queues = []  # each spawn's result queue, weakly
    context_class = type(processes._context("forkserver"))
    make_queue = context_class.Queue

    def recorded_queue(self, *args, **kwargs):
        queue = make_queue(self, *args, **kwargs)
        queues.append(weakref.ref(queue))
        return queue

    monkeypatch.setattr(context_class, "Queue", recorded_queue)
    gc.disable()
    try:
        with pytest.raises(SpawnError, match="(?s)rank 1 of 2 raised.*boom from rank 1") as err:
            spawn(2, _raise_on_rank1, timeout_s=TIMEOUT)
        assert err.value.rank == 1
        with pytest.raises(SpawnError, match="timed out"):
            spawn(2, _sleep, timeout_s=2)
        assert spawn(2, _shim_roundtrip, timeout_s=TIMEOUT) == [True, True]
        # The failed spawns' queues (and their semaphores) went with their processes, which
        # the last spawn's start released; the errors, kept here with their tracebacks, do not
        # hold them for a later garbage collection, which CPython 3.12 may run inside
        # multiprocessing's resource tracker ("called reentrantly ... might leak" warnings)
        assert len(queues) == 3 and [q() is None for q in queues[:2]] == [True, True]
    finally:
        gc.enable()


# ------------------------------------------------------------------ Megatron's schedules


@pytest.mark.megatron_cpu
@pytest.mark.parametrize("pp, schedule", [(2, "1f1b"), (4, "1f1b"), (4, "megatron")])
def test_megatron_1f1b_matches_pp1(megatron_reference, pp, schedule):
    ref = megatron_reference(num_microbatches=M)
    got = _run(pp, schedule, pp=pp, num_microbatches=M)
    assert len(got["losses"]) == M
    assert_same(got, ref)


@pytest.mark.megatron_cpu
def test_megatron_forward_only_losses_match_pp1(megatron_reference):
    ref = megatron_reference(num_microbatches=M)
    got = _run(4, "interleaved", pp=4, vp=2, num_microbatches=M, forward_only=True)
    assert got["grads"] == {}
    assert [float(x) for x in got["losses"]] == [float(x) for x in ref["losses"]]


@pytest.mark.megatron_cpu
@pytest.mark.parametrize(
    "pp, vp, overrides",
    [
        (2, 2, None),  # Megatron-LM's defaults: overlap_p2p_comm, no batching
        (4, 2, None),
        (4, 2, dict(overlap_p2p_comm=False, batch_p2p_comm=True)),
    ],
)
def test_megatron_interleaved_matches_pp1(megatron_reference, pp, vp, overrides):
    ref = megatron_reference(num_microbatches=M)
    got = _run(pp, "interleaved", pp=pp, vp=vp, num_microbatches=M, config_overrides=overrides)
    assert len(got["losses"]) == M
    assert_same(got, ref)


@pytest.mark.megatron_cpu
@pytest.mark.parametrize(
    "world, schedule, pp, vp",
    [
        (4, "1f1b", 4, None),
        (2, "interleaved", 2, 2),
        (4, "interleaved", 4, 2),
        (4, "1f1b", 2, None),  # data parallel 2: DDP averages two identical replicas
    ],
)
def test_ddp_overlap_grad_reduce_megatron_and_plugin_match_pp1(megatron_reference, world,
                                                               schedule, pp, vp):
    """Chunks wrapped in Megatron's DDP with overlap_grad_reduce=True: no_sync_func,
    grad_sync_func and finalize_model_grads_func all run; grads land in main_grad. Megatron's
    own schedule and the plugin's of the same name run side by side in the same processes
    (the same model, data and hooks): Megatron's equals pp=1 bit for bit, and the plugin's
    equals Megatron's bit for bit."""
    ref = megatron_reference(num_microbatches=M)
    common = dict(pp=pp, vp=vp, num_microbatches=M, ddp=True, overlap_grad_reduce=True)
    per_rank = spawn(world, run_steps, [dict(schedule=schedule, **common),
                                        dict(schedule=ScheduleFunction(schedule), **common)],
                     timeout_s=TIMEOUT)
    megatron, plugin = (merge_results([ranks[i] for ranks in per_rank]) for i in range(2))
    assert len(plugin["losses"]) == M
    assert_same(megatron, ref)
    assert_same(plugin, megatron)


@pytest.mark.megatron_cpu
@pytest.mark.parametrize("world, pp", [(2, 2), (4, 4), (4, 2)])
def test_plugin_gpipe_with_ddp_overlap_grad_reduce_matches_pp1(megatron_reference, world, pp):
    """The plugin's GPipe (no Megatron counterpart) under DDP with overlap_grad_reduce: every
    stage accumulates its weight gradients over microbatches 0..m-1 as pp=1 does, so bit for
    bit."""
    ref = megatron_reference(num_microbatches=M)
    got = _run(world, ScheduleFunction("gpipe"), pp=pp, num_microbatches=M, ddp=True,
               overlap_grad_reduce=True)
    assert len(got["losses"]) == M
    assert_same(got, ref)


@pytest.mark.megatron_cpu
def test_megatron_per_token_loss_matches_pp1(megatron_reference):
    """3-tuple loss + calculate_per_token_loss: finalize_model_grads divides by the token
    count broadcast from the last stage."""
    ref = megatron_reference(num_microbatches=M, ddp=True, per_token_loss=True)
    got = _run(4, "interleaved", pp=4, vp=2, num_microbatches=M, ddp=True, per_token_loss=True)
    assert_same(got, ref)


# ------------------------------------------------------------------ V layout


@pytest.mark.megatron_cpu
@pytest.mark.parametrize("pp", [2, 4])
def test_v_layout_chunks_match_pp1(megatron_reference, pp):
    """V placement (rank 0 holds the first and the last stage) built from Megatron's GPTModel,
    run by the schedule-free oracle on Megatron's forward_step/backward_step."""
    ref = megatron_reference(num_microbatches=M)
    results = spawn(
        pp, run_step, "sequential", pp=pp, layout="v", num_microbatches=M, timeout_s=TIMEOUT
    )
    assert results[0]["stages"] == [0, 2 * pp - 1]
    assert len(results[0]["losses"]) == M  # the last stage lives on rank 0
    assert_same(merge_results(results), ref)


@pytest.mark.megatron_cpu
def test_v_layout_with_ddp_hooks_and_several_runs_per_launch():
    """run_steps: two runs in the same two processes (Megatron re-initialized in between)."""
    common = dict(num_microbatches=4, ddp=True, overlap_grad_reduce=True)
    per_rank = spawn(
        2,
        run_steps,
        [
            dict(schedule="1f1b", pp=2, **common),
            dict(
                schedule="support.reference:sequential_forward_backward",
                pp=2,
                layout="v",
                **common,
            ),
        ],
        timeout_s=TIMEOUT,
    )
    loop, v = (merge_results([ranks[i] for ranks in per_rank]) for i in range(2))
    assert_same(v, loop)
    # Layer numbers follow the V placement: rank 0 holds layers 1-2 and 7-8 (1-based).
    assert per_rank[0][1]["layer_numbers"] == [[1, 2], [7, 8]]
    assert per_rank[1][1]["layer_numbers"] == [[3, 4], [5, 6]]


def test_v_layout_refuses_megatron_schedules():
    with pytest.raises(ValueError, match="loop placement"):
        run_step(0, 1, "interleaved", pp=1, layout="v")


@pytest.mark.megatron_cpu
@pytest.mark.parametrize("schedule, layout", [("zb-h1", "loop"), ("zb-h2", "loop"),
                                              ("zb-v", "v"), ("dualpipev", "v")])
def test_split_backward_with_ddp_overlap_grad_reduce_matches_pp1(megatron_reference, schedule,
                                                                 layout):
    """The split-backward schedules under Megatron DDP with overlap_grad_reduce, run twice in
    the same processes (the I/W patch entered and left twice): I leaves the
    deferred weights' grad-ready hook alone (DDP asserts on a None gradient and would start
    the reduction before W), W fires it with the real gradient, once per microbatch. Equal to
    pp=1 within fp32 (W accumulates each weight's microbatches in the schedule's order)."""
    ref = megatron_reference(num_microbatches=M)
    common = dict(pp=2, layout=layout, num_microbatches=M, ddp=True, overlap_grad_reduce=True)
    per_rank = spawn(2, run_steps, [dict(schedule=ScheduleFunction(schedule), **common)] * 2,
                     timeout_s=TIMEOUT)
    for step in range(2):
        got = merge_results([ranks[step] for ranks in per_rank])
        assert len(got["losses"]) == M
        assert_same(got, ref, rtol=1e-5, atol=1e-6)
