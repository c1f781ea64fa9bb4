"""Failure behaviour: bad input is refused before any communication with a message that names
the values, the rule and the fix; ranks that disagree fail together at startup; a dead or hung
rank makes every other rank stop with an error naming the rank, the peer and the pending
action (multi-process gloo runs of the drop-in function on the tiny Megatron-Core GPT)."""

from __future__ import annotations

import os
import queue
import time
import types

import pytest
import torch

from megatron_pp_ext.train import processes as launch
from megatron_pp_ext.integration import forward_backward as fb
from megatron_pp_ext.integration.forward_backward import ScheduleFunction
from megatron_pp_ext.ir import ScheduleError
from megatron_pp_ext.runtime.errors import PipelineTimeoutError
from megatron_pp_ext.runtime.executor import Executor
from megatron_pp_ext.schedules import build_schedule

from support.inmemory import ROWS, WIDTH, RecordingWork

P2P_TIMEOUT = 5.0


# ------------------------------------------------------------------ multi-process helpers
def collect(world_size: int, fn, *args, silent=(), deadline_s: float = 180.0, **kwargs) -> dict:
    """Run ``fn(rank, world_size, *args, **kwargs)`` in gloo processes (train.processes's worker)
    and return {rank: result} for the ranks that reported, plus {rank: "died (exit N)"} for
    the ranks that died without a word. ``deadline_s`` only bounds a broken run (a rank that
    never reports is then missing from the result and the test fails on it); no assertion reads
    the wall clock, which a loaded machine stretches. Unlike ``launch.spawn`` it keeps collecting after a
    rank dies: the point is what the survivors say. Ranks in ``silent`` are not waited for
    (they hang); every rank is stopped at the end."""
    ctx = launch._context("forkserver")
    results = ctx.Queue()
    store = launch.host_store(deadline_s)
    port = store.port
    procs = [ctx.Process(target=launch._worker,
                         args=(r, world_size, port, deadline_s, fn, args, kwargs, results),
                         daemon=True) for r in range(world_size)]
    started = time.monotonic()
    for proc in procs:
        proc.start()
    out: dict = {}
    try:
        while (len(set(out) | set(silent)) < world_size
               and time.monotonic() - started < deadline_s):
            try:
                rank, ok, payload = results.get(timeout=0.2)
            except queue.Empty:
                for r, proc in enumerate(procs):
                    if r not in out and proc.exitcode not in (None, 0) and results.empty():
                        out[r] = f"died (exit {proc.exitcode})"
                continue
            out[rank] = launch._loads(payload) if ok else {"raised": payload}
    finally:
        launch._stop(procs, graceful=False)
        results.close()
        store.close()
    return out


def report_step(rank, world_size, schedule_fn, num_microbatches_by_rank=None, **kwargs):
    """Spawn target: one tiny-GPT step; the exception (if any) comes back as data."""
    from support.reference import run_step

    if num_microbatches_by_rank is not None:
        kwargs["num_microbatches"] = num_microbatches_by_rank[rank]
    started = time.monotonic()
    try:
        run_step(rank, world_size, schedule_fn, **kwargs)
        return {"ok": True, "elapsed": time.monotonic() - started}
    except BaseException as exc:  # noqa: BLE001 - the test asserts on it
        return {"ok": False, "type": type(exc).__name__,
                "is_timeout": isinstance(exc, PipelineTimeoutError),
                "text": str(exc), "peer": getattr(exc, "peer", None),
                "rank": getattr(exc, "rank", None), "pending": getattr(exc, "pending", None),
                "suspects": getattr(exc, "suspects", None),
                "elapsed": time.monotonic() - started}


class FailingRank:
    """A picklable forward_backward_func: ``inner``, except that on global rank ``rank`` the
    forward_step_func dies (``os._exit``) or hangs at its ``after``-th call."""

    def __init__(self, inner, rank: int, after: int, how: str = "die"):
        self.inner, self.rank, self.after, self.how = inner, rank, after, how

    def __call__(self, **kwargs):
        import torch.distributed as dist

        if dist.get_rank() == self.rank:
            step, calls = kwargs["forward_step_func"], [0]

            def failing_step(*args, **kw):
                calls[0] += 1
                if calls[0] > self.after:
                    if self.how == "die":
                        os._exit(17)
                    time.sleep(120)  # hung: alive, connected, silent
                return step(*args, **kw)

            kwargs["forward_step_func"] = failing_step
        return self.inner(**kwargs)


def _timeouts(timeout_s=P2P_TIMEOUT, **extra):
    return ScheduleFunction("1f1b", p2p_timeout_s=timeout_s, first_step_timeout_s=timeout_s,
                            **extra)


# ------------------------------------------------------------------ a rank dies / hangs
def test_a_rank_dies_mid_step_and_every_other_rank_names_it():
    """Rank 2 dies at its 4th forward (microbatch 3, mid-step) in a 4-rank 1F1B run; gloo
    reports the lost connection at once: its neighbours stop on the lost connection, not on
    their timeout, and rank 0 on its neighbour's failure."""
    out = collect(4, report_step, FailingRank(_timeouts(), rank=2, after=3), pp=4,
                  num_microbatches=8)
    assert out[2].startswith("died"), out[2]
    for rank in (0, 1, 3):
        got = out[rank]
        assert isinstance(got, dict) and not got.get("ok"), (rank, got)
        assert got["is_timeout"], (rank, got["type"], got["text"])
        assert got["rank"] == rank
        assert got["text"].startswith(f"pipeline rank {rank} ")
        assert "pending" in got["text"] and got["pending"]
    # the neighbours of the dead rank name it as the peer they lost, and what they waited for
    for rank in (1, 3):
        assert out[rank]["type"] == "PeerLostError", out[rank]["text"]  # not a timeout
        assert out[rank]["peer"] == 2, out[rank]["text"]
        assert "rank 2" in out[rank]["pending"], out[rank]["pending"]
        assert "lost its connection to rank 2" in out[rank]["text"]
    # rank 1 had sent microbatch 3 forward (rank 2's 4th forward got it) and waits for rank
    # 2: either the gradient of microbatch 0 or, in the steady state, a later one
    assert "backward tensor of microbatch" in out[1]["pending"] or "send" in out[1]["pending"]
    # rank 3 waits for an activation rank 2 never delivered: microbatch 3, which rank 2 never
    # computed, or microbatch 2, whose send rank 2 had posted but gloo had not yet carried
    # when the process died (a send waits for the receiver's receive: under load rank 3 posts
    # it late). Microbatches 0 and 1 did arrive: rank 2 ran B1, which needs rank 3's B1.
    # Or rank 3 is still to post its fused send_backward_recv_forward (a gradient for rank 2,
    # the next activation from it) when rank 2 dies, and gloo refuses the post to a closed
    # connection: seen on a slower machine (2026-12-02), where rank 3 runs behind.
    pending = out[3]["pending"]
    assert any(f"3F{i} (microbatch {i}) waiting for the forward tensor of microbatch {i} "
               "from rank 2" in pending for i in (2, 3)) or \
        pending == "posting send_backward_recv_forward (rank 2)", pending
    # rank 0 only talks to rank 1, yet its error names rank 2 from the peers' reports
    assert out[0]["peer"] == 1
    assert out[0]["suspects"] == [2], out[0]["text"]
    assert "Suspected to have failed first: rank(s) [2]" in out[0]["text"]


def test_a_hung_rank_times_out_naming_the_peer_and_the_pending_action():
    """Rank 1 hangs (alive, silent) at its 3rd forward: its neighbours give up after
    the first step's timeout (2 s here, to keep the test short)."""
    timeout = 2.0
    out = collect(4, report_step, FailingRank(_timeouts(timeout), rank=1, after=2, how="hang"),
                  silent=(1,), pp=4, num_microbatches=8)
    assert 1 not in out or out[1].startswith("died"), out.get(1)  # never returned
    for rank in (0, 2):
        got = out[rank]
        assert got["is_timeout"] and got["peer"] == 1, got
        assert got["text"].startswith(f"pipeline rank {rank} waited 2."), got["text"]
        assert "s for rank 1 and gave up: pending" in got["text"], got["text"]
        assert got["elapsed"] > timeout - 0.2, got["elapsed"]  # it waited the timeout out
    # rank 2 received microbatches 0 and 1, and waits for microbatch 2's activation
    assert "2F2 (microbatch 2) waiting for the forward tensor of microbatch 2 from rank 1" in \
        out[2]["pending"]
    assert "Last actions of rank 2: 2F0 2F1" in out[2]["text"]
    # rank 3 waits on rank 2, which gave up and left: it names rank 2 as its peer, and,
    # from rank 2's report, rank 1 as the suspect
    assert out[3]["is_timeout"] and out[3]["peer"] == 2, out[3]
    assert "rank 2 waited for rank 1 and gave up" in out[3]["text"], out[3]["text"]
    assert out[3]["suspects"] == [1], out[3]["text"]
    # and where the ranks it names run (published at the first step's agreement)
    import socket

    here = socket.gethostname()
    assert out[2]["text"].endswith(
        f" Hosts: rank 1 on host {here}; rank 2 (this one) on host {here}."), out[2]["text"]
    assert out[3]["text"].endswith(f" Hosts: rank 1 on host {here}, rank 2 on host {here}; "
                                   f"rank 3 (this one) on host {here}."), out[3]["text"]


# ------------------------------------------------------------------ startup agreement
def test_ranks_with_different_num_microbatches_all_fail_at_startup():
    out = collect(4, report_step, _timeouts(), pp=4, num_microbatches_by_rank=[8, 8, 4, 8])
    for rank in range(4):
        got = out[rank]
        assert got["type"] == "ValueError", (rank, got)
        assert got["text"].startswith("pipeline ranks disagree before the first step: "
                                      "ranks 0, 1, 3 have num_microbatches=8, "
                                      "rank 2 has num_microbatches=4"), got["text"]
        assert "must call forward_backward_func with the same" in got["text"]


def test_ranks_with_different_options_name_the_option():
    per_rank = [_timeouts(), _timeouts(), _timeouts(), ScheduleFunction(
        "gpipe", p2p_timeout_s=P2P_TIMEOUT, first_step_timeout_s=P2P_TIMEOUT)]
    out = collect(4, report_step_per_rank, per_rank, pp=4, num_microbatches=4)
    for rank in range(4):
        assert out[rank]["type"] == "ValueError", out[rank]
        assert ("ranks 0, 1, 2 have schedule=1f1b, rank 3 has schedule=gpipe"
                in out[rank]["text"]), out[rank]["text"]


def report_step_per_rank(rank, world_size, schedule_fns, **kwargs):
    return report_step(rank, world_size, schedule_fns[rank], **kwargs)


# ------------------------------------------------------------------ bad input, nothing sent
class _Group:
    def __init__(self, size, rank=0):
        self._size, self._rank = size, rank

    def size(self):
        return self._size

    def rank(self):
        return self._rank


def _config(**overrides):
    values = dict(pipeline_model_parallel_size=4, variable_seq_lengths=False,
                  sequence_parallel=False, hidden_size=8, pipeline_dtype=torch.float32,
                  microbatch_group_size_per_vp_stage=None, timers=None,
                  finalize_model_grads_func=None)
    values.update(overrides)
    return types.SimpleNamespace(**values)


class _Reached(Exception):
    """The call got past every check and reached communication."""


@pytest.fixture
def comm_spy(monkeypatch):
    """Records any attempt to communicate: building the transport, the startup agreement,
    torch.distributed's collectives and P2P calls."""
    import torch.distributed as dist

    calls = []

    def record(name):
        def spy(*args, **kwargs):
            calls.append(name)
            raise _Reached(name)
        return spy

    monkeypatch.setattr(fb, "_transport_for", record("transport"))
    monkeypatch.setattr(fb.agreement, "check_agreement", record("agreement"))
    for name in ("all_gather", "all_gather_object", "batch_isend_irecv", "isend", "irecv",
                 "send", "recv", "broadcast", "gather_object"):
        monkeypatch.setattr(dist, name, record(name))
    return calls


def _call(schedule="1f1b", chunks=1, iterators=None, m=8, pp=4, config=None, options=None,
          p2p_communicator=None):
    function = ScheduleFunction(schedule, **(options or {}))
    config = config or _config(pipeline_model_parallel_size=pp)
    models = [types.SimpleNamespace(config=config) for _ in range(chunks)]
    pg = types.SimpleNamespace(pp=_Group(pp), tp=_Group(1), cp=_Group(1))
    return function(
        forward_step_func=None, data_iterator=iterators if iterators is not None else
        [None] * chunks, model=models if chunks > 1 else models[0], num_microbatches=m,
        seq_length=4, micro_batch_size=2, pg_collection=pg, p2p_communicator=p2p_communicator)


def test_valid_input_reaches_communication(comm_spy):
    """The control: with good input the call gets as far as the spies."""
    with pytest.raises(_Reached):
        _call()
    assert comm_spy == ["transport"]


@pytest.mark.parametrize("m", [0, -3])
def test_too_few_microbatches(comm_spy, m):
    with pytest.raises(ValueError, match=rf"num_microbatches={m}: it must be an integer >= 1 "
                       r".*raise the global batch size or lower micro_batch_size"):
        _call(m=m)
    assert comm_spy == []


def test_unknown_schedule_suggests_the_closest(comm_spy):
    with pytest.raises(ValueError, match=r"unknown schedule 'zb_h1'.*Did you mean 'zb-h1'"):
        ScheduleFunction("zb_h1")
    with pytest.raises(ValueError, match=r"unknown schedule 'dualpip'.*Did you mean 'dualpipe'"):
        ScheduleFunction("dualpip")
    assert comm_spy == []


def test_pipeline_size_disagreeing_with_the_config(comm_spy):
    with pytest.raises(ValueError, match=r"the pipeline size disagrees: the step communicates "
                       r"on pg_collection.pp of size 4, but config.pipeline_model_parallel_size"
                       r"=2; pass the pipeline group"):
        _call(config=_config(pipeline_model_parallel_size=2))
    assert comm_spy == []


def test_pipeline_size_disagreeing_between_communicator_and_pg_collection(comm_spy):
    communicator = types.SimpleNamespace(pp_group=_Group(4))
    config = _config(pipeline_model_parallel_size=1)
    with pytest.raises(ValueError, match=r"communicates on p2p_communicator.pp_group of size 4, "
                       r"but pg_collection.pp.size\(\)=2"):
        ScheduleFunction("1f1b")(
            forward_step_func=None, data_iterator=None, model=types.SimpleNamespace(config=config),
            num_microbatches=8, seq_length=4, micro_batch_size=2,
            pg_collection=types.SimpleNamespace(pp=_Group(2), tp=_Group(1), cp=_Group(1)),
            p2p_communicator=communicator)
    assert comm_spy == []


def test_model_chunks_not_v(comm_spy):
    with pytest.raises(ValueError, match=r"schedule '1f1b' runs v=1 model chunks per rank, but "
                       r"`model` holds 2.*or choose a schedule for 2 chunks per rank "
                       r"\('interleaved'\)"):
        _call(chunks=2)
    with pytest.raises(ValueError, match=r"schedule 'interleaved' runs v=3 model chunks per "
                       r"rank, but `model` holds 2"):
        _call("interleaved", chunks=2, options={"chunks": 3})
    assert comm_spy == []


def test_data_iterators_not_v(comm_spy):
    with pytest.raises(ValueError, match=r"`data_iterator` holds 1 entries but `model` has 2 "
                       r"chunk\(s\) on this rank.*pass a list of 2"):
        _call("interleaved", chunks=2, iterators=[None])
    assert comm_spy == []


def test_v_shape_schedules_need_two_chunks(comm_spy):
    with pytest.raises(ValueError, match=r"'zb-v' is a V-shape schedule: it runs exactly v=2 "
                       r"model chunks per rank.*chunks=3 was asked"):
        _call("zb-v", chunks=3, options={"chunks": 3})
    with pytest.raises(ValueError, match=r"schedule 'dualpipev' runs v=2 model chunks per rank, "
                       r"but `model` holds 1"):
        _call("dualpipev", chunks=1)
    assert comm_spy == []


def test_interleaved_divisibility(comm_spy):
    with pytest.raises(ScheduleError, match=r"m=6 mod microbatch_group_size_per_vp_stage=4 is "
                       r"2: it must be 0 or >= p=4.*pick m as a multiple of 4"):
        _call("interleaved", chunks=2, m=6)
    with pytest.raises(ValueError, match=r"must lie in \[p=4, m=3\].*use m >= p microbatches"):
        _call("interleaved", chunks=2, m=3)
    assert comm_spy == []


def test_received_tensor_of_the_wrong_shape_is_named():
    """Rank 0 sends (3, 6) tensors without checking them; rank 1 expects (4, 6)."""
    from support.emulated import microbatch_inputs, stage_weights
    from megatron_pp_ext.runtime.inmemory import run_ranks_in_threads

    schedule = build_schedule("1f1b", 2, 2)
    weights, inputs = stage_weights(2, WIDTH), microbatch_inputs(2, ROWS, WIDTH)

    def rank_fn(rank, transport):
        work = RecordingWork(schedule, rank, weights, inputs)
        shape = None if rank == 0 else (ROWS + 1, WIDTH)
        return Executor(schedule, rank, transport, work, recv_shape=shape, dtype=torch.float64,
                        device=torch.device("cpu"), timeout_s=5).run()

    with pytest.raises(ValueError) as info:
        run_ranks_in_threads(2, rank_fn, timeout_s=10)
    text = str(info.value)
    assert text.startswith("rank 1, action 1F0, receiving the forward tensor of microbatch 0 "
                           "from rank 0: received a tensor of shape (3, 6) and dtype "
                           "torch.float64 from rank 0, expected (4, 6) and torch.float64"), text
    assert "must agree on seq_length, micro_batch_size, hidden_size" in text


def test_sent_tensor_of_the_wrong_shape_is_refused_before_sending():
    schedule = build_schedule("1f1b", 2, 2)
    with pytest.raises(ValueError, match=r"rank 0: 0F0 produced a tensor of shape \(3, 6\) and "
                       r"dtype torch.float64, but rank 1 expects \(4, 6\)"):
        _run_with_shape(schedule, (ROWS + 1, WIDTH))


def _run_with_shape(schedule, shape):
    from support.emulated import microbatch_inputs, stage_weights
    from megatron_pp_ext.runtime.inmemory import run_ranks_in_threads

    weights, inputs = stage_weights(2, WIDTH), microbatch_inputs(2, ROWS, WIDTH)
    sent = []

    def rank_fn(rank, transport):
        original = transport.exchange

        def spy(send, recv, variable):
            if send is not None:
                sent.append(rank)
            return original(send, recv, variable)

        transport.exchange = spy
        work = RecordingWork(schedule, rank, weights, inputs)
        return Executor(schedule, rank, transport, work, recv_shape=shape, dtype=torch.float64,
                        device=torch.device("cpu"), timeout_s=5).run()

    try:
        return run_ranks_in_threads(2, rank_fn, timeout_s=10)
    finally:
        assert sent == [], f"ranks {sent} sent a tensor"



# ------------------------------------------------------------------ a peer fails and says so
class WrongShapeOnRank:
    """A picklable forward_backward_func: ``inner``, except that on global rank ``rank`` the
    forward output loses a row after ``after`` forwards (refused before it is sent)."""

    def __init__(self, inner, rank: int, after: int):
        self.inner, self.rank, self.after = inner, rank, after

    def __call__(self, **kwargs):
        import torch.distributed as dist

        if dist.get_rank() == self.rank:
            step, calls = kwargs["forward_step_func"], [0]

            def short_output(data_iterator, model):
                output, loss_func = step(data_iterator, model)
                calls[0] += 1
                return (output[:-1] if calls[0] > self.after else output), loss_func

            kwargs["forward_step_func"] = short_output
        return self.inner(**kwargs)


def report_step_under_nccl_rules(rank, world_size, schedule_fn, **kwargs):
    """report_step with torch.distributed's batches behaving as NCCL's (support.nccl_rules):
    the transport takes its NCCL code path, whose waits are polled. A rank that fails on its
    own (not on a peer) stays connected until every other rank has reported, as a rank on
    NCCL would: no closed connection tells its peers anything there."""
    from support.nccl_rules import nccl_rules

    from megatron_pp_ext.integration import agreement

    with nccl_rules():
        result = report_step(rank, world_size, schedule_fn, **kwargs)
    if not result["ok"] and not result["is_timeout"]:
        for peer in range(world_size):
            if peer != rank:
                agreement.await_peer_note(None, peer, within_s=150)
    return result


def test_a_rank_that_refuses_to_send_stops_its_peer_at_once_on_nccl():
    """Rank 0's second forward produces a tensor of the wrong shape: it raises before sending
    and publishes why. Rank 1, waiting for that activation with a timeout longer than the
    harness gives the whole run, stops on rank 0's report instead (NCCL path: a dead or
    failed peer never closes a connection there), naming rank 0 and its reason."""
    slow = ScheduleFunction("1f1b", p2p_timeout_s=600, first_step_timeout_s=600)
    out = collect(2, report_step_under_nccl_rules, WrongShapeOnRank(slow, rank=0, after=1),
                  pp=2, num_microbatches=4)
    assert out[0]["type"] == "ValueError", out[0]
    assert "0F1 produced a tensor of shape" in out[0]["text"], out[0]["text"]
    got = out[1]
    assert got["type"] == "PeerFailedError" and got["peer"] == 0, got
    assert got["text"].startswith("pipeline rank 1 stopped after "), got["text"]
    assert "pending 1F1 (microbatch 1) waiting for the forward tensor of microbatch 1" \
        in got["text"]
    assert "rank 0 reported a failure: rank 0 failed: rank 0: 0F1 produced a tensor of " \
        "shape" in got["text"], got["text"]


def test_tensor_shape_follows_the_megatron_function_replaced():
    """Megatron's interleaved schedule sends seq_length-long tensors whatever
    decoder_seq_length says; its 1F1B takes decoder_seq_length (Megatron-LM's own
    test_schedules passes decoder_seq_length=512 with seq_length=256 to both)."""
    from megatron.core.pipeline_parallel.schedules import get_tensor_shapes

    from megatron_pp_ext.integration.forward_backward import shape_decoder_seq_length

    config = types.SimpleNamespace(variable_seq_lengths=False, sequence_parallel=False,
                                   hidden_size=8)
    cp = _Group(1)

    def shape(chunks):
        return get_tensor_shapes(seq_length=256, micro_batch_size=2, config=config,
                                 decoder_seq_length=shape_decoder_seq_length(chunks, 512),
                                 tp_group=_Group(1), cp_group=cp)[0]

    assert shape(1) == (512, 2, 8)
    assert shape(2) == (256, 2, 8)
    assert shape_decoder_seq_length(2, None) is None and shape_decoder_seq_length(1, None) is None
