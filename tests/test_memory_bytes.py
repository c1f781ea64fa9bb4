"""Activation memory in bytes (runtime/memory.py), exactly, on a deterministic toy model.

Every stage is one linear layer ``y = x @ W_s`` (float64, ``ROWS x WIDTH`` activations, W an
``nn.Parameter``); the last stage's loss is ``y.sum()``. Autograd saves exactly one tensor per
F that is an activation: the layer's input ``x`` (``mm`` saves the weight too when x requires
grad, but a parameter is not an activation). So one F holds ``UNIT = ROWS * WIDTH * 8`` bytes.
The split backward is written by hand: I computes the input gradient (freeing the graph) and
queues (x, grad_y) for W, so a pending W holds 2 * UNIT bytes (its input and its output
gradient).
"""

from __future__ import annotations

import torch

from megatron_pp_ext.ir import BACKWARD, BACKWARD_INPUT, FORWARD
from megatron_pp_ext.runtime.executor import Executor
from megatron_pp_ext.runtime.inmemory import run_ranks_in_threads
from megatron_pp_ext.runtime.memory import ActivationMemory, predicted_peak_bytes, unique_bytes
from megatron_pp_ext.schedules import build_schedule
from megatron_pp_ext.schedules.validate import peak_activations
from megatron_pp_ext.units import format_bytes_iec
from support.emulated import microbatch_inputs, stage_weights

ROWS, WIDTH = 3, 6
UNIT = ROWS * WIDTH * 8  # one float64 activation: 144 bytes


class LinearWork:
    """The StageWork of one rank: linear stages, a hand-written I/W split with a W queue."""

    def __init__(self, schedule, rank, weights, inputs):
        self.schedule, self.rank, self.inputs = schedule, rank, inputs
        self.params = {s: torch.nn.Parameter(weights[s].clone())
                       for s in schedule.stages_of(rank)}
        self.saved: dict[tuple, tuple] = {}
        self.queue: dict[tuple, tuple] = {}  # the W queue: (stage, mb) -> (x, grad_y)
        self.losses: dict[int, float] = {}

    def _last(self, stage):
        return stage == self.schedule.num_stages - 1

    def forward(self, action, input_tensor):
        stage, mb = action.stage, action.microbatch
        x = self.inputs[mb] if stage == 0 else input_tensor
        y = x @ self.params[stage]
        self.saved[(stage, mb)] = (x, y)
        if self._last(stage):
            loss = y.sum()  # saves nothing: its backward needs only the shape
            self.losses[mb] = float(loss.detach())
            return loss
        return y

    def backward(self, action, output_grad):
        stage, mb = action.stage, action.microbatch
        x, y = self.saved.pop((stage, mb))
        grad_y = torch.ones_like(y) if self._last(stage) else output_grad
        weight = self.params[stage]
        if action.kind == BACKWARD:
            wants = (weight, x) if x.requires_grad else (weight,)
            grads = torch.autograd.grad(y, wants, grad_y)
            weight.grad = grads[0] if weight.grad is None else weight.grad + grads[0]
            return grads[1] if x.requires_grad else None
        # I: the input gradient now (the graph is freed), the weight GEMM's operands queued
        self.queue[(stage, mb)] = (x.detach(), grad_y)
        if not x.requires_grad:
            return None
        return torch.autograd.grad(y, (x,), grad_y)[0]

    def weight(self, action):
        x, grad_y = self.queue.pop((action.stage, action.microbatch))
        weight = self.params[action.stage]
        g = x.t() @ grad_y
        weight.grad = g if weight.grad is None else weight.grad + g

    def held_tensors(self):
        return [t for pair in self.queue.values() for t in pair]

    def deallocate(self, output):
        pass


def run(schedule, work_cls=LinearWork, memory=True):
    weights = stage_weights(schedule.num_stages, WIDTH)
    inputs = microbatch_inputs(schedule.num_microbatches, ROWS, WIDTH)

    def rank_fn(rank, transport):
        work = work_cls(schedule, rank, weights, inputs)
        executor = Executor(schedule, rank, transport, work, recv_shape=(ROWS, WIDTH),
                            dtype=torch.float64, device=torch.device("cpu"), timeout_s=20.0,
                            memory=memory)
        return executor.run(), work

    return run_ranks_in_threads(schedule.num_ranks, rank_fn, timeout_s=30.0)


def expected_peaks(schedule, rank, count_stash=True):
    """The exact peak of ``LinearWork`` on ``rank`` in UNITs, and its parts, derived from the
    action lists alone by following what the executor holds and when it samples:

    * an F holds its input (1); a B frees it; an I frees it and queues its input and output
      gradient (2) for the W, which frees them;
    * a message from a peer that arrives while the rank waits for a LATER message of the same
      peer waits in the stash (1) until its action takes it (it then is that action's input:
      an F saves it, an I queues it, a B drops it);
    * a tensor handed to another stage of the same rank waits (1) until that stage takes it.

    Samples: after each action, after each hand-over, after each early arrival."""
    from megatron_pp_ext.analysis.messages import comm_plan, incoming_messages

    plans = comm_plan(schedule, rank)
    queues = {peer: list(msgs) for peer, msgs in incoming_messages(schedule, rank).items()}
    last = schedule.num_stages - 1
    saved, w_queue, stash, local = set(), set(), set(), set()
    best = (-1, None)

    def sample():
        nonlocal best
        parts = {"saved": len(saved), "w_queue": 2 * len(w_queue),
                 "waiting": (len(stash) if count_stash else 0) + len(local)}
        if sum(parts.values()) > best[0]:
            best = (sum(parts.values()), parts)

    for action, plan in zip(schedule.actions[rank], plans):
        key = (action.stage, action.microbatch)
        if plan.recv is not None:
            while plan.recv not in stash:
                message = queues[plan.recv.peer].pop(0)
                stash.add(message)
                if message != plan.recv:
                    sample()
            stash.discard(plan.recv)
        elif action.kind == FORWARD and action.stage > 0:
            local.discard(("a", key))
        elif action.kind in (BACKWARD, BACKWARD_INPUT) and action.stage < last:
            local.discard(("g", key))
        if action.kind == FORWARD:
            saved.add(key)
        elif action.kind == BACKWARD:
            saved.discard(key)
        elif action.kind == BACKWARD_INPUT:
            saved.discard(key)
            w_queue.add(key)
        else:
            w_queue.discard(key)
        sample()
        if plan.send is None:
            if action.kind == FORWARD and action.stage < last:
                local.add(("a", (action.stage + 1, action.microbatch)))
                sample()
            elif action.kind in (BACKWARD, BACKWARD_INPUT) and action.stage > 0:
                local.add(("g", (action.stage - 1, action.microbatch)))
                sample()
    return best[0], {part: units * UNIT for part, units in best[1].items()}


def test_one_f_saves_exactly_its_input():
    schedule = build_schedule("1f1b", 2, 4)
    results = run(schedule)
    for result, work in results:
        assert result.saved_bytes_per_stage == {s: UNIT for s in schedule.stages_of(work.rank)}
        assert not work.queue and not work.saved


def test_1f1b_p2_m4_peak_bytes_are_the_in_flight_inputs():
    """1F1B, p=2, m=4: rank 0 runs F0 F1 B0 F2 B1 F3 B2 B3, so after F1 it holds the inputs
    of microbatches 0 and 1 (2 x 144 bytes, nothing else: the gradient of B0 is that action's
    input, not held); rank 1 runs F B F B ..., one input at a time."""
    schedule = build_schedule("1f1b", 2, 4)
    assert [str(a) for a in schedule.actions[0]] == \
        ["0F0", "0F1", "0B0", "0F2", "0B1", "0F3", "0B2", "0B3"]
    results = run(schedule)
    assert [r.peak_bytes for r, _ in results] == [2 * UNIT, 1 * UNIT]
    assert [r.peak_activations for r, _ in results] == [2, 1]  # the count stays a count
    assert results[0][0].peak_bytes_parts == {"saved": 2 * UNIT, "w_queue": 0, "waiting": 0}
    # the prediction: the simulator's count, calibrated with one F's bytes per stage
    assert predicted_peak_bytes(schedule, {0: UNIT, 1: UNIT}) == [2 * UNIT, UNIT]
    assert results[0][0].device_peak_bytes is None  # the CPU has no allocator peak


def test_1f1b_peaks_equal_count_times_unit_for_more_ranks():
    schedule = build_schedule("1f1b", 4, 8)
    results = run(schedule)
    counts = peak_activations(schedule)
    assert counts == [4, 3, 2, 1]
    assert [r.peak_bytes for r, _ in results] == [c * UNIT for c in counts]
    assert predicted_peak_bytes(schedule, {s: UNIT for s in range(4)}) == \
        [c * UNIT for c in counts]


def test_zb_h1_counts_the_w_queue():
    """ZB-H1: after an I the graph is gone, the W queue holds x and grad_y (2 units) until
    the W: the bytes exceed count x UNIT, exactly as the walk over the action list says."""
    schedule = build_schedule("zb-h1", 2, 4)
    results = run(schedule)
    for rank, ((result, work), count) in enumerate(zip(results, peak_activations(schedule))):
        units, parts = expected_peaks(schedule, rank)
        assert result.peak_bytes == units * UNIT
        assert result.peak_bytes_parts == parts
        assert parts["w_queue"] > 0
        assert result.peak_bytes > count * UNIT  # the W queue's output gradients
        assert not work.queue  # drained
    # rank 0 runs F0 F1 I0 W0 ...: after I0, F1's input (1) and I0's queued input and
    # output gradient (2); rank 1 runs F0 I0 F1 I1 W0: after I1 two pending W's (4)
    assert [str(a) for a in schedule.actions[0][:4]] == ["0F0", "0F1", "0I0", "0W0"]
    assert [str(a) for a in schedule.actions[1][:5]] == ["1F0", "1I0", "1F1", "1I1", "1W0"]
    assert [r.peak_activations for r, _ in results] == [2, 2]  # the count
    assert [r.peak_bytes for r, _ in results] == [3 * UNIT, 4 * UNIT]
    assert results[0][0].peak_bytes_parts == {"saved": UNIT, "w_queue": 2 * UNIT, "waiting": 0}
    assert results[1][0].peak_bytes_parts == {"saved": 0, "w_queue": 4 * UNIT, "waiting": 0}


def test_every_schedule_matches_the_derived_walk():
    """Every schedule at a few p, m: the measured peak bytes and their parts equal the walk
    derived from the action lists (saved inputs, W queue, early arrivals, hand-overs)."""
    for name, v in [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1),
                    ("zb-h2", 1), ("zb-v", 2), ("dualpipev", 2)]:
        for p, m in [(2, 4), (3, 6), (4, 8)]:
            schedule = build_schedule(name, p, m, chunks=v)
            results = run(schedule)
            for rank, (result, _work) in enumerate(results):
                units, parts = expected_peaks(schedule, rank)
                assert (result.peak_bytes, result.peak_bytes_parts) == (units * UNIT, parts), \
                    (name, p, m, rank)


def test_early_arrivals_in_the_inbox_count():
    """An early arrival: rank 1 runs microbatch 1 before microbatch 0, but rank 0 sends
    microbatch 0's activation first. Rank 1, waiting for microbatch 1's, receives microbatch
    0's first: it waits in the stash until 1F0. After 1F1 rank 1 holds 1F1's input AND the
    waiting activation: 2 units, though its count of held activations is 1."""
    from megatron_pp_ext.ir import Action, Schedule

    schedule = Schedule("reordered", 2, (0, 1), [
        [Action.parse(a) for a in ("0F0", "0F1", "0B1", "0B0")],
        [Action.parse(a) for a in ("1F1", "1B1", "1F0", "1B0")]])
    results = run(schedule)
    result = results[1][0]
    assert result.peak_activations == 1
    assert result.peak_bytes == 2 * UNIT
    assert result.peak_bytes_parts == {"saved": UNIT, "w_queue": 0, "waiting": UNIT}
    assert expected_peaks(schedule, 1) == (2, result.peak_bytes_parts)
    assert expected_peaks(schedule, 1, count_stash=False)[0] == 1  # the stash makes the peak
    assert results[0][0].peak_bytes == 2 * UNIT  # rank 0: both inputs, nothing waiting


def test_stash_bytes_count_a_waiting_tensor():
    """Arrivals waiting for their action, as the executor samples them: held, a storage once."""
    a = torch.zeros(ROWS, WIDTH, dtype=torch.float64)
    waiting = [a, a[1:]]  # a view of the same storage
    assert unique_bytes(waiting) == UNIT
    meter = ActivationMemory()
    assert meter.sample((), waiting) == UNIT
    assert meter.peak_parts == {"saved": 0, "w_queue": 0, "waiting": UNIT}


def test_storages_are_counted_once_and_parameters_never():
    meter = ActivationMemory()
    w = torch.nn.Parameter(torch.randn(WIDTH, WIDTH, dtype=torch.float64))
    plain_weight = torch.randn(WIDTH, WIDTH, dtype=torch.float64, requires_grad=True)
    x = torch.randn(ROWS, WIDTH, dtype=torch.float64, requires_grad=True)
    meter.note_input(x)  # a received stage input: a leaf that requires grad, counted
    h = x @ w            # saves x and w (w: a parameter, not counted)
    y = torch.tanh(h @ plain_weight)  # saves h and the plain weight (not counted), and y
    z = (x + x) @ w      # add saves nothing; mm saves x + x and w
    out = y.sum() + z.sum()
    assert meter.record_forward(0, 0, out) == 4 * UNIT  # x, h, y, x + x
    assert meter.saved_bytes == {(0, 0): 4 * UNIT}
    assert meter.sample() == 4 * UNIT
    out.backward()
    meter.after_backward(0, 0, BACKWARD_INPUT)  # the graph is freed: nothing stays
    assert meter.sample() == 0
    assert meter.peak_bytes == 4 * UNIT
    assert unique_bytes([x, x[1:], x.t()]) == UNIT



def test_a_weight_made_where_a_freed_input_was_is_not_an_activation():
    """PipeDream's weight versions are leaves that require grad, made each update, and the
    allocator may place one where a received input was. Its address alone once made it an
    activation (the flaky rank-1 bytes of test_pipedream_train); the base tensor here pins
    the storage so that the address is reused on purpose, not by the allocator's chance."""
    meter = ActivationMemory()
    base = torch.randn(ROWS, WIDTH, dtype=torch.float64)
    received = base[:].requires_grad_(True)  # a leaf on base's storage
    meter.note_input(received)
    del received  # freed: its storage (kept here by base) now holds something else
    version = base.detach().requires_grad_(True)  # a weight version on the same storage
    # a leaf that requires grad and was not received: mm saves it and the version, tanh its
    # output; only the output is an activation
    other = torch.randn(ROWS, ROWS, dtype=torch.float64, requires_grad=True)
    meter.record_forward(0, 0, torch.tanh(other @ version))
    assert meter.sample() == UNIT
    # the same when the input is alive but its storage was replaced (deallocated)
    meter = ActivationMemory()
    received = torch.randn(ROWS, WIDTH, dtype=torch.float64, requires_grad=True)
    meter.note_input(received)
    version = torch.empty(0, dtype=torch.float64).set_(received.untyped_storage()) \
        .view(ROWS, WIDTH).requires_grad_(True)
    received.data = torch.empty(1, dtype=torch.float64)
    meter.record_forward(0, 0, torch.tanh(other @ version))
    assert meter.sample() == UNIT

def test_a_saved_parameter_keeps_its_identity():
    """The measurement reads what autograd saved and changes nothing: a custom Function gets
    its parameter back as the same object, with its attributes (Megatron's linear sets
    ``weight.grad_added_to_main_grad`` on it; saved_tensors_hooks would hand back a copy)."""
    weight = torch.nn.Parameter(torch.randn(WIDTH, WIDTH, dtype=torch.float64))
    weight.main_grad = torch.zeros_like(weight)
    seen = []

    class Linear(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w):
            ctx.save_for_backward(x, w)
            return x @ w

        @staticmethod
        def backward(ctx, grad):
            x, w = ctx.saved_tensors
            seen.append(w is weight and hasattr(w, "main_grad"))
            return grad @ w.t(), x.t() @ grad

    schedule = build_schedule("1f1b", 1, 1)

    class Work(LinearWork):
        def forward(self, action, input_tensor):
            x = self.inputs[action.microbatch]  # data, no grad: an activation
            y = Linear.apply(x, weight).sum()
            self.saved[(0, action.microbatch)] = (x, y)
            return y

        def backward(self, action, output_grad):
            _x, y = self.saved.pop((0, action.microbatch))
            y.backward()

    ((result, _work),) = run(schedule, work_cls=Work)
    assert seen == [True]
    assert result.saved_bytes_per_stage == {0: UNIT}  # x; the parameter is not counted
    assert result.peak_bytes == UNIT


def test_forward_only_and_memory_off_measure_nothing():
    schedule = build_schedule("1f1b", 2, 4)
    results = run(schedule, memory=False)
    assert all(r.peak_bytes is None and r.saved_bytes_per_stage is None for r, _ in results)


def test_format_bytes_iec():
    assert format_bytes_iec(144) == "144 B"
    assert format_bytes_iec(2048) == "2.0 KiB"
    assert format_bytes_iec(3 * 1024 ** 2) == "3.0 MiB"
    assert format_bytes_iec(5 * 1024 ** 3) == "5.0 GiB"


def test_the_measurement_is_off_unless_asked(monkeypatch):
    schedule = build_schedule("1f1b", 2, 4)
    monkeypatch.delenv("MEGATRON_PP_EXT_MEMORY", raising=False)
    assert all(r.peak_bytes is None for r, _ in run(schedule, memory=None))
    monkeypatch.setenv("MEGATRON_PP_EXT_MEMORY", "0")
    assert all(r.peak_bytes is None for r, _ in run(schedule, memory=None))
    monkeypatch.setenv("MEGATRON_PP_EXT_MEMORY", "1")
    assert [r.peak_bytes for r, _ in run(schedule, memory=None)] == [2 * UNIT, UNIT]


def test_trains_step_line_labels_the_count_and_gives_units():
    from megatron_pp_ext.train.progress import format_step

    line = format_step(1, 2, 4.0, 0.1, None, None, [2, 1], [4741120, 2469508])
    assert line.endswith("peak activations (count) [2, 1]  "
                         "activation memory [4.5 MiB, 2.4 MiB]")
    gpu = format_step(1, 2, 4.0, 0.1, None, None, [2, 1], [2048, 1024], [3 * 2 ** 30, 2 ** 30])
    assert gpu.endswith("activation memory [2.0 KiB, 1.0 KiB]  "
                        "CUDA peak allocated [3.0 GiB, 1.0 GiB]")
    # without bytes (pp=1, or nothing measured) the line is as it always was
    assert format_step(1, 2, 4.0, 0.1, None, None, [1]).endswith("peak activations [1]")
