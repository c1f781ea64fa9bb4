"""Layer 3 under NCCL's rules: the tiny Megatron GPT in real processes over gloo made to batch
as NCCL does (support/nccl_rules.py: one Work per ``batch_isend_irecv``, a rank's batches run
one after another, received data visible only after the wait, rendezvous sends), with the
plugin's transport on its NCCL code path (batched, polled waits, nothing posted ahead).

First the harness is shown fair (Megatron-Core's own schedules give what plain gloo gives),
then the plugin is held to Megatron under the same rules, and the rest of its schedules to
pp=1. The plugin runs with short timeouts, so a hang is a named PipelineTimeoutError (rank,
peer, pending action) well before the spawn timeout, which is only the outer bound.

Mocked: nothing of Megatron; CUDA-only calls are redirected by train/cpu_shims as in
test_runtime_megatron.py. The unit tests at the end mock NCCL itself (no GPU here)."""

from __future__ import annotations

import datetime
import re

import pytest
import torch
import torch.distributed as dist

from megatron_pp_ext import device as device_helper
from megatron_pp_ext.integration.forward_backward import ScheduleFunction
from megatron_pp_ext.runtime import transport as transport_module
from megatron_pp_ext.runtime.transport import RecvRequest, TorchDistTransport, TransportTimeout
from megatron_pp_ext.train.processes import SpawnError, spawn
from support.nccl_rules import nccl_rules, probe_under_rules, run_steps_under_rules
from support.reference import assert_same, merge_results

FP32 = dict(rtol=1e-5, atol=1e-6)  # "within fp32 rounding"
#: Megatron's p2p through batch_isend_irecv (its interleaved default is lone isend/irecv)
MEGATRON_BATCHED = {"batch_p2p_comm": True, "overlap_p2p_comm": False}
#: the plugin gives up on a peer after this long: a hang is named, not a spawn timeout
PLUGIN_TIMEOUTS = dict(p2p_timeout_s=30.0, first_step_timeout_s=30.0)
SPAWN_TIMEOUT_S = 300


def plugin(name: str) -> ScheduleFunction:
    return ScheduleFunction(name, **PLUGIN_TIMEOUTS)


def side_by_side(world_size, *runs):
    """Several runs in the same processes (``nccl_rules=True``: under the rules); per run the
    merged losses and gradients, and ``nccl_batches``: batches issued on all ranks."""
    per_rank = spawn(world_size, run_steps_under_rules, list(runs), timeout_s=SPAWN_TIMEOUT_S)
    merged = []
    for i in range(len(runs)):
        ranks = [rank_runs[i] for rank_runs in per_rank]
        batches = sum(r.get("nccl_batches", 0) for r in ranks)
        merged.append(dict(merge_results(ranks), nccl_batches=batches))
    return merged


# ------------------------------------------------------------------ (a) the harness is fair
@pytest.mark.megatron_cpu
@pytest.mark.parametrize("schedule,pp,vp", [("1f1b", 2, None), ("1f1b", 4, None),
                                            ("interleaved", 4, 2)])
def test_megatrons_own_schedules_are_unchanged_by_nccl_rules(schedule, pp, vp):
    # Interleaved at pp=2 is left out: there the previous and the next rank are one peer and
    # Megatron's batch [send_prev, recv_prev, send_next, recv_next] pairs activations with
    # gradients (on NCCL as on gloo; Megatron-LM's argument check forbids it).
    run = dict(schedule=schedule, pp=pp, vp=vp, ddp=True, config_overrides=MEGATRON_BATCHED)
    plain, under_rules = side_by_side(pp, run, dict(run, nccl_rules=True))
    assert under_rules["nccl_batches"] > 0  # Megatron's p2p went through the replacement
    assert plain["nccl_batches"] == 0
    assert_same(under_rules, plain)


# ------------------------------------------------------------------ (b) plugin = Megatron
@pytest.mark.megatron_cpu
@pytest.mark.parametrize("pp", [2, 4])
def test_1f1b_matches_megatron_under_nccl_rules(pp):
    common = dict(pp=pp, ddp=True, nccl_rules=True,
                  config_overrides={"deallocate_pipeline_outputs": True})
    megatron, ours = side_by_side(pp, dict(schedule="1f1b", **common),
                                  dict(schedule=plugin("1f1b"), **common))
    assert ours["nccl_batches"] == megatron["nccl_batches"] > 0  # one batch per fused call
    assert_same(ours, megatron)


@pytest.mark.megatron_cpu
@pytest.mark.parametrize("pp", [2, 4])
def test_interleaved_matches_megatron_under_nccl_rules(pp):
    # pp=4: Megatron batches too; pp=2: Megatron-LM's default (lone isend/irecv, see above)
    overrides = MEGATRON_BATCHED if pp > 2 else None
    common = dict(pp=pp, vp=2, ddp=True, nccl_rules=True, config_overrides=overrides)
    megatron, ours = side_by_side(pp, dict(schedule="interleaved", **common),
                                  dict(schedule=plugin("interleaved"), **common))
    assert ours["nccl_batches"] > 0
    assert_same(ours, megatron)


# ------------------------------------------------------------------ (c) the rest = pp=1
@pytest.mark.megatron_cpu
@pytest.mark.parametrize("pp,name,layout", [
    (2, "gpipe", "loop"), (4, "gpipe", "loop"), (2, "zb-h1", "loop"), (4, "zb-h1", "loop"),
    (4, "zb-h2", "loop"), (2, "zb-v", "v"), (4, "zb-v", "v"), (2, "dualpipev", "v"),
    (4, "dualpipev", "v"),
])
def test_other_schedules_match_pp1_under_nccl_rules(pp, name, layout, megatron_reference):
    (ours,) = side_by_side(pp, dict(schedule=plugin(name), pp=pp, layout=layout, ddp=True,
                                    nccl_rules=True))
    assert ours["nccl_batches"] > 0
    assert len(ours["losses"]) == 8
    assert_same(ours, megatron_reference(ddp=True), **FP32)


# ------------------------------------------------------------------ (d) variable lengths
def _variable_length_step(schedule, pp):
    ranks = spawn(pp, probe_under_rules, schedule, pp=pp, variable_seq_lengths=True,
                  timeout_s=SPAWN_TIMEOUT_S)
    losses = [float(d["lm loss"]) for r in ranks for d in r["forward_data"]]
    grads = {name: g for r in ranks for name, g in r["grads"].items()}
    return losses, grads, [r["nccl_batches"] for r in ranks]


@pytest.mark.megatron_cpu
@pytest.mark.parametrize("pp", [2, 4])
def test_variable_sequence_lengths_match_megatron_under_nccl_rules(pp):
    """Shapes travel in a batch of their own, waited on before the payload batch (as
    Megatron's _communicate_shapes): same batches as Megatron, same results bit for bit."""
    ours, ours_grads, ours_batches = _variable_length_step(plugin("1f1b"), pp)
    megatron, megatron_grads, megatron_batches = _variable_length_step("1f1b", pp)
    assert len(ours) == 4 and ours == megatron
    assert ours_batches == megatron_batches and min(megatron_batches) > 0
    assert sorted(ours_grads) == sorted(megatron_grads) and len(ours_grads) > 10
    for name, grad in megatron_grads.items():
        assert torch.equal(ours_grads[name], grad), name


# ------------------------------------------------------------------ the harness itself
def _data_shows_only_after_the_wait(rank, world_size):
    """Spawn target: one Work per batch; wait(timeout) gives up; data lands at the wait."""
    with nccl_rules():
        if rank == 1:
            dist.barrier()  # rank 0 has seen its receive time out
            (work,) = dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.ones(4), 0),
                                              dist.P2POp(dist.isend, torch.ones(2), 0)])
            work.wait()
            dist.barrier()
            return {}
        first, second = torch.zeros(4), torch.zeros(2)
        works = dist.batch_isend_irecv([dist.P2POp(dist.irecv, first, 1),
                                        dist.P2POp(dist.irecv, second, 1)])
        try:
            works[0].wait(timeout=datetime.timedelta(seconds=0.2))
            timed_out = ""
        except RuntimeError as exc:
            timed_out = str(exc)
        dist.barrier()
        dist.barrier()  # the data has arrived: rank 1's send completed
        before = (first.sum().item(), second.sum().item())
        works[0].wait()
        return {"works": len(works), "timed_out": timed_out, "before": before,
                "after": (first.sum().item(), second.sum().item())}


@pytest.mark.megatron_cpu
def test_harness_one_work_per_batch_timeout_and_data_only_after_the_wait():
    result = spawn(2, _data_shows_only_after_the_wait, timeout_s=60)[0]
    assert result["works"] == 1
    assert "timed out" in result["timed_out"].lower()
    assert result["before"] == (0.0, 0.0)
    assert result["after"] == (4.0, 2.0)


def _batches_run_in_order(rank, world_size):
    """Spawn target: rank 0 posts [recv from 1] then [send to 1]; rank 1 posts [recv from 0]
    then [send to 0]. On NCCL each rank's second batch waits for its first: a deadlock."""
    peer = 1 - rank
    timeout = datetime.timedelta(seconds=0.3)
    with nccl_rules():
        inbox = torch.zeros(3)
        (first,) = dist.batch_isend_irecv([dist.P2POp(dist.irecv, inbox, peer)])
        (second,) = dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.full((3,), 1.0 + rank),
                                                       peer)])
        stuck = []
        for work in (first, second):
            try:
                work.wait(timeout=timeout)
            except RuntimeError as exc:
                stuck.append("timed out" in str(exc).lower())
        dist.barrier()
        # Unblock by hand, outside the batches: rank 1 feeds rank 0's first batch; rank 0
        # then drains the send that rank 1's second batch makes once its first completes.
        if rank == 1:
            dist.isend(torch.full((3,), 7.0), 0).wait()
        first.wait()
        second.wait()
        if rank == 0:
            drained = torch.zeros(3)
            dist.irecv(drained, 1).wait()
        dist.barrier()
        return {"stuck": stuck, "inbox": inbox.tolist()}


@pytest.mark.megatron_cpu
def test_harness_runs_a_ranks_batches_one_after_another():
    rank0, rank1 = spawn(2, _batches_run_in_order, timeout_s=60)
    assert rank0["stuck"] == [True, True] and rank1["stuck"] == [True, True]
    assert rank0["inbox"] == [7.0] * 3  # the message sent outside the batches
    assert rank1["inbox"] == [1.0] * 3  # rank 0's batched send, once its first batch ran


# ------------------------------------------------------------------ (e) units, NCCL mocked
class _OneWork:
    """What NCCL's batch_isend_irecv returns: ONE Work for the whole batch (mocked: no GPU
    here). Completes when ``complete`` is set; the received data lands at the wait."""

    def __init__(self, log, ops, payload, complete):
        self.log, self.ops, self.payload, self.complete = log, ops, payload, complete
        self.waited = False

    def is_completed(self):
        return self.complete

    def wait(self, timeout=None):
        assert self.complete, "a polled wait calls wait() only once is_completed() says so"
        self.waited = True
        self.log.append(("wait", self))
        for op in self.ops:
            if op.op is dist.irecv:
                op.tensor.copy_(self.payload(op.tensor))
        return True


class _P2POp:
    """torch's P2POp, less its check of the process group (there is none here)."""

    def __init__(self, op, tensor, peer=None, group=None, tag=0, group_peer=None):
        self.op, self.tensor, self.group_peer = op, tensor, group_peer


def _header_of(*shape):
    return transport_module.encode_header(torch.zeros(shape), torch.device("cpu"))


@pytest.fixture
def no_process_group(monkeypatch):
    """A pipeline group of 2 seen from rank 0, without a process group."""
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(device_helper, "comm_device", lambda group=None: torch.device("cpu"))


@pytest.fixture
def mocked_nccl(monkeypatch, no_process_group):
    """NCCL mocked: the group's backend, and batch_isend_irecv returning one Work per batch.
    A shape-header batch completes at once (the peer's header is (4, 3)); a payload batch
    when the test says so (every received element 5.0). Returns the log of batches/waits."""
    log = []

    def batch_isend_irecv(ops):
        header = ops[0].tensor.dtype == torch.int64
        payload = (lambda t: _header_of(4, 3)) if header else (lambda t: torch.full_like(t, 5.0))
        work = _OneWork(log, ops, payload, complete=header)
        log.append(("batch", work))
        return [work]

    monkeypatch.setattr(dist, "batch_isend_irecv", batch_isend_irecv)
    monkeypatch.setattr(dist, "P2POp", _P2POp)
    monkeypatch.setattr(device_helper, "backend_of", lambda group=None: "nccl")
    return log


def test_the_batched_path_waits_on_the_batchs_one_work_for_send_and_receive(mocked_nccl):
    transport = TorchDistTransport(None)
    assert (transport.batched, transport.poll, transport.prefetch_receives) == (True, True, False)
    request = RecvRequest(1, (4, 3), torch.float32, torch.device("cpu"))
    send, recv = transport.exchange((torch.ones(4, 3), 1), request, variable_shapes=False)
    ((_, work),) = mocked_nccl
    assert [op.op for op in work.ops] == [dist.isend, dist.irecv]
    assert not send.done()
    with pytest.raises(TransportTimeout):  # the receive waits on the batch's one Work
        recv.wait(0.05)
    with pytest.raises(TransportTimeout):  # and so does the send
        send.wait(0.05, transport.poll)
    work.complete = True
    assert send.done()
    assert torch.equal(recv.wait(1.0), torch.full((4, 3), 5.0))  # read after the wait
    assert work.waited


def test_variable_shapes_exchange_headers_in_a_batch_waited_on_before_the_payload(mocked_nccl):
    transport = TorchDistTransport(None)
    request = RecvRequest(1, None, torch.float32, torch.device("cpu"))
    send, recv = transport.exchange((torch.ones(2, 5), 1), request, variable_shapes=True)
    (kind1, headers), (kind2, waited), (kind3, payload) = mocked_nccl
    assert (kind1, kind2, kind3) == ("batch", "wait", "batch")
    assert waited is headers  # the headers' batch was waited on before the payload's posted
    assert [op.op for op in headers.ops] == [dist.isend, dist.irecv]  # both directions
    assert [op.tensor.dtype for op in headers.ops] == [torch.int64, torch.int64]
    assert [tuple(op.tensor.shape) for op in payload.ops] == [(2, 5), (4, 3)]
    payload.complete = True
    assert torch.equal(recv.wait(1.0), torch.full((4, 3), 5.0))
    send.wait(1.0, transport.poll)


def test_gloo_takes_the_direct_path_unless_told(no_process_group, monkeypatch):
    monkeypatch.setattr(device_helper, "backend_of", lambda group=None: "gloo")
    transport = TorchDistTransport(None)
    assert (transport.batched, transport.poll, transport.prefetch_receives) == (False, False, True)
    told = TorchDistTransport(None, batched=True)
    assert (told.batched, told.poll, told.prefetch_receives) == (True, True, False)
    # what nccl_rules() does inside each rank process:
    monkeypatch.setattr(device_helper, "p2p_batched", lambda group=None: True)
    assert TorchDistTransport(None).batched is True


def test_nccl_can_be_told_to_post_directly(no_process_group, monkeypatch):
    monkeypatch.setattr(device_helper, "backend_of", lambda group=None: "nccl")
    transport = TorchDistTransport(None, batched=False)
    assert (transport.batched, transport.poll, transport.prefetch_receives) == (False, True, False)


@pytest.mark.parametrize("reported,cuda,expected", [
    ("nccl", True, "nccl"), ("gloo", False, "gloo"),
    ("cpu:gloo,cuda:nccl", True, "nccl"),  # NCCL for the pipeline's CUDA tensors
    ("cpu:gloo,cuda:nccl", False, "gloo"),
    ("cuda:nccl,cpu:gloo", True, "nccl"),
])
def test_backend_of_a_group_with_a_backend_per_device(monkeypatch, reported, cuda, expected):
    # torch 2.13's dist.get_backend returns the creation string as it was given
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: reported)
    monkeypatch.setattr(device_helper, "cuda_available", lambda: cuda)
    assert device_helper.backend_of() == expected
    assert device_helper.p2p_batched() == (expected == "nccl")
    assert device_helper.waits_block_host() == (expected != "nccl")


def test_backend_of_a_group_whose_backends_torch_chose(monkeypatch):
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "undefined")
    monkeypatch.setattr(dist, "get_backend_config", lambda group=None: "cuda:nccl")
    monkeypatch.setattr(device_helper, "cuda_available", lambda: True)
    assert device_helper.backend_of() == "nccl"


# ------------------------------------------------------------------ the harness catches hangs
def _fused_calls_only(rank, world_size, runs):
    """Spawn target: ``run_steps_under_rules`` with the plugin running Megatron's fused calls
    for every schedule, unchecked (no lockstep rounds): its posting before lockstep existed."""
    from megatron_pp_ext.analysis.lowering import MEGATRON, lower
    from megatron_pp_ext.integration import forward_backward

    forward_backward.runtime_program = lambda schedule, **how: lower(schedule, MEGATRON)
    return run_steps_under_rules(rank, world_size, runs)


@pytest.mark.megatron_cpu
def test_harness_names_the_hang_of_fused_calls_on_a_v_schedule():
    """zb-v at pp=2 with fused calls only: each rank's host waits on a receive whose sender's
    matching send is queued behind a batch that waits on the first rank (a cycle)."""
    run = dict(schedule=ScheduleFunction("zb-v", p2p_timeout_s=10.0, first_step_timeout_s=10.0),
               pp=2, layout="v", ddp=True, nccl_rules=True)
    with pytest.raises(SpawnError) as info:
        spawn(2, _fused_calls_only, [run], timeout_s=SPAWN_TIMEOUT_S)
    message = " ".join(str(info.value).split())
    assert "PipelineTimeoutError" in message
    assert re.search(r"pipeline rank 0 waited [\d.]+ s for rank 1 and gave up: pending 3F0 "
                     r"|pipeline rank 1 waited [\d.]+ s for rank 0 and gave up: pending 1F1 ",
                     message), message[-2000:]


def test_a_pairs_two_sends_and_its_receives_share_one_batch_and_its_work(mocked_nccl):
    """DualPipe's commit: both sends of an F&B pair and the round's receives in one
    ``batch_isend_irecv``; with variable shapes, the headers of all four in one batch first."""
    transport = TorchDistTransport(None)
    requests = [RecvRequest(1, None, torch.float32, torch.device("cpu")) for _ in range(2)]
    sends, recvs = transport.exchange_many([(torch.ones(4, 3), 1), (torch.ones(4, 3), 1)],
                                           requests, variable_shapes=True)
    header, work = [w for kind, w in mocked_nccl if kind == "batch"]
    assert header.waited and not work.waited  # the shapes are in before the payload's batch
    assert [op.op for op in header.ops] == [dist.isend, dist.isend, dist.irecv, dist.irecv]
    assert [op.op for op in work.ops] == [dist.isend, dist.isend, dist.irecv, dist.irecv]
    assert [tuple(op.tensor.shape) for op in work.ops[2:]] == [(4, 3), (4, 3)]
    for send in sends:
        with pytest.raises(TransportTimeout):  # each send waits on the batch's one Work
            send.wait(0.02, transport.poll)
    work.complete = True
    assert all(torch.equal(r.wait(1.0), torch.full((4, 3), 5.0)) for r in recvs)
    for send in sends:
        send.wait(1.0, transport.poll)


def test_one_send_and_several_receives_share_one_batch_and_its_work(mocked_nccl):
    transport = TorchDistTransport(None)
    requests = [RecvRequest(peer, (4, 3), torch.float32, torch.device("cpu")) for peer in (0, 1)]
    (send,), recvs = transport.exchange_many([(torch.ones(4, 3), 1)], requests,
                                             variable_shapes=False)
    ((_, work),) = mocked_nccl
    assert [op.op for op in work.ops] == [dist.isend, dist.irecv, dist.irecv]
    for recv in recvs:
        with pytest.raises(TransportTimeout):
            recv.wait(0.02)
    work.complete = True
    assert all(torch.equal(r.wait(1.0), torch.full((4, 3), 5.0)) for r in recvs)
    send.wait(1.0, transport.poll)
