"""bench/gpu_check.py, the GPU check, on a machine without a GPU: its CPU part as CI runs it
(every schedule over the NCCL-rules fabric, gradients equal to pp=1; the multi-GPU NCCL part
stated NOT RUN), the logic of its CUDA path with a stand-in for torch.cuda (no stream or event
semantics: those need a GPU), and its NCCL part's processes rehearsed on gloo made to batch as
NCCL does."""

from __future__ import annotations

import contextlib
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # `bench.gpu_check`, also for the ranks it spawns

from bench import gpu_check  # noqa: E402


def test_cpu_part_passes_and_says_what_did_not_run():
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "bench/gpu_check.py", "--device", "cpu", "--quick"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    assert time.monotonic() - started < 120
    summary = out.split("GPU check summary:", 1)[1]
    for name in gpu_check.SCHEDULES:
        line = next((line for line in summary.splitlines()
                     if re.match(rf"PASS\s+{re.escape(name)}\s", line)), None)
        assert line is not None, f"no PASS line for {name}:\n{summary}"
        assert "gradients equal to pp=1" in line and "order = action list" in line
        # one line per run before the summary: p=2, 4 at m=4
        assert len(re.findall(rf"^\s+ok\s+{re.escape(name)}\s+p=\d m=4 .*gradients equal to "
                              r"pp=1", out, re.M)) == 2
    assert "FAIL" not in out
    assert "NOT RUN CUDA stream check: device is cpu" in summary
    if torch.cuda.device_count() < 2:
        assert re.search(r"^NOT RUN real NCCL \(multi-GPU\) part: torch sees \d GPU\(s\)",
                         summary, re.M), summary
        assert re.search(r"^NOT RUN verify on GPUs \(pretrain_gpt.py\): torch sees \d GPU\(s\)",
                         summary, re.M), summary
    assert re.search(r"^RESULT: PASS \(14 of 14 fabric runs passed; NOT RUN: ", summary, re.M)


def test_nccl_part_is_not_run_without_two_gpus():
    if torch.cuda.device_count() >= 2:
        pytest.skip("this machine has 2 GPUs: the NCCL part runs here")
    reason = gpu_check.nccl_unavailable(no_nccl=False)
    assert reason is not None and "one GPU cannot host several NCCL ranks" in reason
    part = gpu_check.nccl_part([4], 4, 16, 30.0, no_nccl=False)
    assert part.status == gpu_check.NOT_RUN and part.runs == []


def test_a_wrong_gradient_or_loss_is_reported():
    want, want_losses = gpu_check.reference(2, 2, 3, 4, torch.device("cpu"), torch.float64)
    ok = gpu_check.compare(dict(want), {0: want_losses[0], 1: want_losses[1]}, want,
                           want_losses, torch.float64, "cpu")
    assert ok[:2] == (True, True) and ok[3] == []
    off = {0: want[0], 1: want[1] + 1e-9}
    grads_ok, losses_ok, worst, problems = gpu_check.compare(
        off, {0: want_losses[0], 1: want_losses[1] * 1.001}, want, want_losses, torch.float64,
        "cpu")
    assert not grads_ok and not losses_ok and worst == pytest.approx(1e-9, rel=1e-3)
    assert any("stage 1: gradient differs" in p for p in problems)


# ------------------------------------------------------------ the CUDA path, stand-in only
class _Event:
    recorded = 0

    def __init__(self, enable_timing: bool = False):
        self.at = None

    def record(self, stream=None):
        self.at = time.perf_counter()
        _Event.recorded += 1

    def elapsed_time(self, end) -> float:
        return (end.at - self.at) * 1e3


class _Stream:
    waits = 0

    def __init__(self, device=None, **kwargs):
        pass

    def wait_event(self, event):
        assert event.at is not None, "waits on an event nobody recorded"
        _Stream.waits += 1


@pytest.fixture
def cuda_stand_in(monkeypatch):
    """torch.cuda's calls that gpu_check makes, as no-ops on the CPU (tensors stay on the
    CPU: this runs the CUDA path's logic, not CUDA's semantics)."""
    recorded_streams = []
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(torch.cuda, "Stream", _Stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _Stream())
    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.Tensor, "record_stream",
                        lambda self, stream: recorded_streams.append(stream), raising=False)
    _Event.recorded = _Stream.waits = 0
    return recorded_streams


@pytest.mark.parametrize("name", gpu_check.SCHEDULES)
def test_cuda_path_logic_with_a_stand_in(cuda_stand_in, name):
    run = gpu_check.run_on_fabric(name, 2, 4, torch.device("cpu"), torch.float64, 3, 6,
                                  timeout_s=30, sleep_cycles=1000, cuda=True)
    assert run.ok, run.line()
    assert {"F"} <= set(run.ms_by_kind) and all(v >= 0 for vs in run.ms_by_kind.values()
                                                for v in vs)
    # every action timed with an event pair, every post and copy with an event, and the
    # waits made the current stream wait for the copies
    actions = len(gpu_check.build(name, 2, 4).actions[0]) + len(
        gpu_check.build(name, 2, 4).actions[1])
    assert sum(len(v) for v in run.ms_by_kind.values()) == actions
    assert _Event.recorded > 2 * actions and _Stream.waits > 0 and cuda_stand_in


def test_stream_control_has_teeth(cuda_stand_in):
    """With copies that are not asynchronous (the stand-in), the control must fail: a read
    without the wait sees the copied data, so the check could prove nothing."""
    ok, detail = gpu_check.stream_check(torch.device("cpu"), torch.float32)
    assert not ok and "COPIED (no teeth)" in detail
    assert "read after its wait: right" in detail  # the fabric's own transfer


# ------------------------------------------------------------ the NCCL part, rehearsed
def test_nccl_part_rehearsed_on_gloo_under_nccls_rules():
    """The NCCL part's processes, runs and checks, on gloo inside support.nccl_rules (one
    Work per batch, batches in order, data visible after the wait): TorchDistTransport takes
    its batched path, every schedule's gradients equal pp=1."""
    part = gpu_check.nccl_part([4], 4, 16, 30.0, no_nccl=False, backend="gloo")
    assert part.status == "PASS", part.detail + "\n" + "\n".join(r.line() for r in part.runs)
    assert [(r.name, r.m) for r in part.runs] == [("1f1b", 2)] + [
        (name, 4) for name in gpu_check.SCHEDULES]
    assert all(r.ok and r.grads_ok and r.order_ok for r in part.runs)
    # GPipe's receives go ahead of its forwards (lowering.nccl_post_ahead): that path too
    assert {(r.name, r.posting) for r in part.runs} == {
        ("1f1b", "megatron"), ("gpipe", "megatron, ahead"), ("zb-h1", "megatron"),
        *((name, "lockstep") for name in ("interleaved", "zb-h2", "zb-v", "dualpipev"))}


def test_a_wrong_gradient_fails_the_run_and_the_exit_code(monkeypatch, capsys):
    real = gpu_check.reference

    def off_for_zb_v(num_stages, m, *args):
        grads, losses = real(num_stages, m, *args)
        if num_stages == 4 and m == 4:  # zb-v / dualpipev at p=2, interleaved at p=2
            grads[3] = grads[3] + 1e-6
        return grads, losses

    monkeypatch.setattr(gpu_check, "reference", off_for_zb_v)
    assert gpu_check.main(["--device", "cpu", "--quick", "--ps", "2", "--no-nccl"]) == 1
    out = capsys.readouterr().out
    assert re.search(r"^FAIL  zb-v\s+1 of 1 runs failed: p=2 m=4", out, re.M), out
    assert "stage 3: gradient differs" in out
    assert re.search(r"^PASS  1f1b\s", out, re.M)
    assert "NOT RUN real NCCL (multi-GPU) part: --no-nccl given" in out
    assert re.search(r"^RESULT: FAIL ", out, re.M)
