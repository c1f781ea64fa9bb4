"""Bench (a): every schedule on an emulated device, over the real Executor and gloo.

A rank's part of the model costs ``t_F`` for a forward, ``t_I`` for the input-gradient half of
a backward and ``t_W`` for its weight-gradient half (a full backward ``t_B = t_I + t_W``): the
stages sleep those times, standing in for GPU kernels that leave the CPU free. A schedule with
``v`` chunks per rank (interleaved, zb-v, dualpipev) runs chunks costing ``1/v`` of that
(dualpipe's two chunks are whole parts, each microbatch crossing one of them: ``t``), so
every schedule does the same work per rank (``m (t_F + t_I + t_W)``), as in
``megatron_pp_ext.analysis.select``.

One process tree per pipeline size ``p`` runs, for each ``m``:

* the plugin's schedules: ``Executor(schedule, rank, TorchDistTransport(), EmulatedStageWork)``;
* Megatron-Core 0.19.2's OWN ``forward_backward_pipelining_without_interleaving`` and
  ``..._with_interleaving`` on a minimal fake Megatron model (:class:`SleepStage`: a module
  with ``.config`` and ``set_input_tensor`` whose autograd Function sleeps ``t_F`` forward and
  ``t_B`` backward), and the plugin's drop-in ``ScheduleFunction("1f1b")`` on the same fake
  model (the two 1F1B implementations over identical stage code);
* PyTorch's own runtime, ``torch.distributed.pipelining`` (``PipelineStage`` and its schedule
  classes, ``bench.torch_pipelining.TORCH``) on the same default group, its chunks costing
  what the plugin's do, the I/W split being torch's own (measured, not predicted);

every step between two barriers (as Megatron's optimizer step synchronizes the ranks),
schedules in a rotating order, ``reps`` rounds. A step's time is the last rank's end minus
the first rank's start (one monotonic clock for all processes of the machine).

Then, with no barrier: ``k`` steps back to back per schedule (each rank starts its next step as
soon as its own part of the previous one is done), ``b2b_reps`` rounds in rotating order. The
steady-state time per step is ``(E_k - E_1) / (k - 1)``, ``E_j`` the time the last rank
finishes step ``j``; the median over the rounds.

Then the *cross-step* runs, with gradient clipping and fp16 loss scaling emulated (for 1f1b,
zb-h2 and zb-v, ``k`` steps back to back, ``b2b_reps`` rounds, every (schedule, mode) in
rotating order; :class:`OptimizerStepEmulation`). Each step ends with an optimizer step of
``t_opt`` (a device kernel's time, like the stages') and two one-float all-reduces over every
rank on a group of their own (the loss scaler's found-inf, MAX; the squared grad norm, SUM):

* ``sync``: Megatron's ``optimizer.step()``: both all-reduces block, then the optimizer runs;
* ``post-validated``: ``integration.post_validation``'s step: both all-reduces are posted
  asynchronously, the snapshot (``t_copy``) and the optimistic step (``t_opt``) run at once,
  and the step settles (waits for both) when the rank starts its next step, before its first
  forward reads the weights. On the steps in ``rollback_steps`` the global norm is above the
  clip: the settle restores the snapshot and redoes the step (``t_copy + t_opt`` more).

The steady step is measured as for the back-to-back runs, ``E_j`` taken when the rank's
optimizer step returns.

Predictions (``bench.calibration``): ``simulate`` with the same costs and ``t_comm``,
``post`` and ``t_overhead`` taken from a separate calibration tree (1F1B alone at one m), never
from the tree being judged. ``t_comm`` is half the mean round trip of an activation-sized
message over gloo between two ranks, from ping-pongs sampled at the start and before every
round (so under the same load as the steps; the mean, as a step sums many hops). The
back-to-back prediction simulates the ``k`` steps as one concatenated schedule and applies the
same ``(E_k - E_1) / (k - 1)``.
"""

from __future__ import annotations

import itertools
import statistics
import time
from dataclasses import dataclass

import torch

from bench.torch_pipelining import TORCH
from megatron_pp_ext.analysis.simulate import CostModel, simulate
from megatron_pp_ext.ir import Action, Schedule
from megatron_pp_ext.schedules import build_schedule

# Plugin schedules: (label, registry name, v)
PLUGIN = [("gpipe", "gpipe", 1), ("1f1b", "1f1b", 1), ("interleaved v=2", "interleaved", 2),
          ("zb-h1", "zb-h1", 1), ("zb-h2", "zb-h2", 1), ("zb-v", "zb-v", 2),
          ("dualpipev", "dualpipev", 2), ("dualpipe", "dualpipe", 2)]
# Runs on the fake Megatron model: (label, which function, v, what to predict it with)
MEGATRON = [("megatron 1f1b", "megatron-1f1b", 1, ("1f1b", 1)),
            ("megatron interleaved v=2", "megatron-interleaved", 2, ("interleaved", 2)),
            ("plugin 1f1b on megatron stage", "plugin-1f1b", 1, ("1f1b", 1))]
BACK_TO_BACK = ["1f1b", "zb-h1", "zb-h2", "zb-v", "dualpipev", "megatron 1f1b"]
# Built only when asked for by name (Setup.only): (label, registry name, v, builder options
# as a function of p). zb-v with 2p-1 warm-up forwards: zb-h2's memory, steps that overlap.
PLUGIN_ONLY_WHEN_ASKED = [("zb-v w=2p-1", "zb-v", 2,
                           lambda p: {"warmup_forwards": max(p, 2 * p - 1)})]
# back to back with clipping and loss scaling emulated
CROSS_STEP = ["1f1b", "zb-h2", "zb-v", "zb-v w=2p-1"]
OPTIMIZER_MODES = ("sync", "post-validated", "run-ahead")

ROWS, WIDTH = 8, 64  # the emulated activation: 8 x 64 float64 = 4 KiB
SEQ, MBS = 16, 1  # the fake Megatron model's activation: 16 x 1 x 64 float32 = 4 KiB


@dataclass(frozen=True)
class Setup:
    p: int
    ms: tuple
    t: float = 0.020  # t_F = t_I = t_W, seconds (per rank; a chunk costs t / v)
    reps: int = 5
    k_steps: int = 4  # back-to-back steps per schedule
    b2b_reps: int = 3  # rounds of back-to-back runs
    back_to_back_ms: tuple = ()  # the m's to run back to back (none: skip)
    megatron: bool = True
    torch_pipelining: bool = True  # torch.distributed.pipelining's schedules (TORCH rows)
    niceness: int = -20  # 0: leave the priority alone
    only: tuple = ()  # run just these labels (empty: all)
    # cross-step runs (at the back-to-back m's): optimizer step emulation, in units of t
    optimizer_modes: tuple = OPTIMIZER_MODES  # empty: skip the cross-step runs
    t_opt_units: float = 0.5  # the optimizer step (Adam over a rank's parameters)
    t_copy_units: float = 0.25  # post-validation's snapshot copy (or its restore)
    rollback_steps: tuple = (2,)  # steps whose global norm is above the clip (of k_steps)
    timeline_labels: tuple = ()  # cross-step runs traced once for the timeline (CLI: zb-h2)
    timeline_modes: tuple = ("sync", "run-ahead")


def costs_for(t: float, v: int):
    from support.emulated import EmulatedCosts

    return EmulatedCosts(t_f=t / v, t_i=t / v, t_w=t / v)


class DeviceClock:
    """Makes an action last its cost, as a device kernel would: the action's CPU work runs
    first, then a sleep until ``start + cost``. ``time.sleep`` wakes late (~0.1 ms on an idle
    machine, more with more busy processes than cores); each process keeps a running mean of
    how late it woke (each observation capped at ``CAP``, so one long preemption does not
    shorten the next sleeps) and sleeps that much less, so an action lasts its cost on
    average instead of cost + wake-up latency, which would charge schedules with more,
    shorter actions for an artefact of the emulation."""

    late = 0.0  # running mean of the wake-up delay in this process, seconds
    CAP = 0.001

    @classmethod
    def wait_until(cls, deadline: float) -> None:
        remaining = deadline - time.perf_counter()
        if remaining <= 0:
            return
        time.sleep(max(0.0, remaining - cls.late))
        woke = time.perf_counter() - (deadline - cls.late)  # delay of this wake-up
        cls.late += 0.1 * (min(max(woke, 0.0), cls.CAP) - cls.late)


def raise_priority(niceness: int = -20) -> bool:
    """Renice every thread of this process (gloo's included; Linux nice is per thread), so
    that a rank that wakes from a sleep or a receive gets a core promptly on a machine shared
    with other work. The ranks sleep most of the time, so this takes little from anyone.
    Best effort: False where not permitted."""
    import os

    try:
        for tid in os.listdir("/proc/self/task"):
            os.setpriority(os.PRIO_PROCESS, int(tid), niceness)
        return True
    except (OSError, PermissionError):
        return False


def device_work_class():
    from support.emulated import EmulatedCosts, EmulatedStageWork

    class DeviceStageWork(EmulatedStageWork):
        """``EmulatedStageWork`` whose actions last their cost (``DeviceClock``)."""

        def __init__(self, schedule, rank, weights, inputs, costs):
            super().__init__(schedule, rank, weights, inputs, costs=EmulatedCosts())
            self.device_costs = costs

        def _timed(self, kind, method, *args):
            start = time.perf_counter()
            result = method(*args)
            DeviceClock.wait_until(start + self.device_costs.of(kind))
            return result

        def forward(self, action, input_tensor):
            return self._timed("F", super().forward, action, input_tensor)

        def backward(self, action, output_grad):
            return self._timed(action.kind, super().backward, action, output_grad)

        def weight(self, action):
            return self._timed("W", super().weight, action)

    return DeviceStageWork


# ------------------------------------------------------------------ the fake Megatron model
class _Sleep(torch.autograd.Function):
    """y = x * w; sleeps t_f in forward and t_b in backward."""

    @staticmethod
    def forward(ctx, x, weight, t_f: float, t_b: float):
        start = time.perf_counter()
        ctx.save_for_backward(x, weight)
        ctx.t_b = t_b
        y = x * weight
        DeviceClock.wait_until(start + t_f)
        return y

    @staticmethod
    def backward(ctx, grad):
        start = time.perf_counter()
        x, weight = ctx.saved_tensors
        grads = grad * weight, (grad * x).sum().reshape(weight.shape), None, None
        DeviceClock.wait_until(start + ctx.t_b)
        return grads


class SleepStage(torch.nn.Module):
    """The least a Megatron schedule needs of a model chunk: ``config``, ``set_input_tensor``,
    a forward that takes the received activation (or, on the first stage, the data)."""

    def __init__(self, config, first: bool, t_f: float, t_b: float, vp_stage=None):
        super().__init__()
        from megatron.core.enums import ModelType

        self.model_type = ModelType.encoder_or_decoder
        self.config, self.first, self.t_f, self.t_b = config, first, t_f, t_b
        self.vp_stage = vp_stage
        self.weight = torch.nn.Parameter(torch.ones(1))
        self.input_tensor = None

    def set_input_tensor(self, tensors):
        self.input_tensor = tensors[0] if isinstance(tensors, list) else tensors

    def forward(self, data):
        x = data if self.first else self.input_tensor
        return _Sleep.apply(x, self.weight, self.t_f, self.t_b)


def _loss(output):
    loss = output.sum()
    return loss, {"loss": loss.detach()}


def fake_forward_step(data_iterator, model):
    return model(next(data_iterator)), _loss


def fake_config(p: int, v: int):
    from megatron.core.transformer.transformer_config import TransformerConfig

    vp = v if v > 1 else None
    return TransformerConfig(
        num_layers=p * v, hidden_size=64, num_attention_heads=4,
        pipeline_model_parallel_size=p, virtual_pipeline_model_parallel_size=vp,
        pipeline_dtype=torch.float32, params_dtype=torch.float32,
        use_cpu_initialization=True, overlap_p2p_comm=vp is not None,
        batch_p2p_comm=vp is None)


def fake_chunks(rank: int, p: int, v: int, t: float):
    config = fake_config(p, v)
    return [SleepStage(config, first=(c * p + rank == 0), t_f=t / v, t_b=2 * t / v,
                       vp_stage=c if v > 1 else None) for c in range(v)]


# ------------------------------------------------------------------ the optimizer step
class OptimizerStepEmulation:
    """What a rank does between two steps with ``--clip-grad`` and fp16 loss scaling on, in
    one of :data:`OPTIMIZER_MODES` (see the module's docstring): the found-inf and grad-norm
    all-reduces on ``group``, the optimizer's ``t_opt``, post-validation's ``t_copy`` and the
    redo on a rollback. Costs are device time (``DeviceClock``)."""

    def __init__(self, mode: str, group, t_opt: float, t_copy: float, rollback_steps=()):
        if mode not in OPTIMIZER_MODES:
            raise ValueError(f"mode {mode!r}: one of {OPTIMIZER_MODES}")
        self.mode, self.group, self.t_opt, self.t_copy = mode, group, t_opt, t_copy
        self.rollback_steps = set(rollback_steps)
        self.pending = None  # (works, step) of a post-validated step not yet settled
        self.rollbacks = 0

    def _device(self, seconds: float) -> None:
        DeviceClock.wait_until(time.perf_counter() + seconds)

    def _reductions(self, async_op: bool):
        import torch.distributed as dist

        found_inf, norm = torch.zeros(1), torch.ones(1)
        return [dist.all_reduce(found_inf, op=dist.ReduceOp.MAX, group=self.group,
                                async_op=async_op),
                dist.all_reduce(norm, op=dist.ReduceOp.SUM, group=self.group,
                                async_op=async_op)]

    def settle(self) -> None:
        """Post-validated: wait for the step's reductions; roll back and redo if it was one
        of the clipped steps. Called before the next step's first forward (and at the end)."""
        if self.pending is None:
            return
        works, step = self.pending
        self.pending = None
        for work in works:
            work.wait()
        if step in self.rollback_steps:
            self.rollbacks += 1
            self._device(self.t_copy + self.t_opt)  # restore the snapshot, step again clipped

    def before_step(self) -> None:
        if self.mode == "post-validated":
            self.settle()

    def after_compute(self) -> bool:
        """Run ahead: settle the previous step now; True when this step must be replayed."""
        if self.mode != "run-ahead" or self.pending is None:
            return False
        previous = self.pending[1]
        self.settle()
        return previous in self.rollback_steps

    def after_step(self, step: int) -> None:
        if self.mode == "sync":
            self._reductions(async_op=False)
            self._device(self.t_opt)
        else:
            self.pending = (self._reductions(async_op=True), step)
            self._device(self.t_copy + self.t_opt)  # snapshot, optimistic step


def traced_round(tracer, optimizer: "OptimizerStepEmulation", k: int, m: int, rank: int):
    """``k`` steps back to back as the cross-step runs make them, every action traced: step j's
    microbatch i is labelled i + j*m (as ``concatenated``), the optimizer step, the wait for the
    previous step's reductions and a replay are events of their own. Absolute times."""
    import torch.distributed as dist

    from megatron_pp_ext.timeline import COMM_WAIT, COMPUTE, Event

    def renumbered(events, j):
        out = []
        for e in events or []:
            if e.category == COMPUTE:
                action = Action.parse(e.label)
                label = str(Action(action.stage, action.kind, action.microbatch + j * m))
            else:
                label = f"step {j}: {e.label}"
            out.append(Event(e.rank, label, e.start, e.end, e.category))
        return out

    events = []
    dist.barrier()
    for j in range(k):
        start = time.perf_counter()
        optimizer.before_step()
        if time.perf_counter() - start > 1e-4:
            events.append(Event(rank, f"wait: step {j - 1} validated", start,
                                time.perf_counter(), COMM_WAIT))
        events += renumbered(tracer(), j)
        start = time.perf_counter()
        replay = optimizer.after_compute()
        if time.perf_counter() - start > 1e-4:
            events.append(Event(rank, f"wait: step {j - 1} validated (run ahead)", start,
                                time.perf_counter(), COMM_WAIT))
        if replay:
            events += renumbered(tracer(), j)
        start = time.perf_counter()
        optimizer.after_step(j)
        events.append(Event(rank, f"opt{j}", start, time.perf_counter(), COMPUTE))
    optimizer.settle()
    return events


# ------------------------------------------------------------------ one step of each kind
def torch_runners(runners: dict, out: dict, rank: int, p: int, m: int, setup) -> list:
    """Add a runner per ``TORCH`` row that torch accepts at (p, m); record the error of the
    ones it refuses (every rank refuses alike: the checks are on p, m and the layout).
    Returns the labels added: new schedule objects, each needing its own warm-up step."""
    from bench.torch_pipelining import runner_or_error

    added = []
    for label, *_ in TORCH:
        if setup.only and label not in setup.only:
            continue
        runner, error = runner_or_error(label, rank, p, m, setup.t, ROWS, WIDTH)
        if error is not None:
            out.setdefault("torch_errors", {})[(m, label)] = error
            continue
        runners[label] = runner.step
        added.append(label)
    return added


def plugin_runner(schedule: Schedule, rank: int, transport, weights, inputs, costs,
                  trace: bool = False):
    """A callable running one step on the executor (its events when ``trace``: absolute
    perf_counter times). The rank's compiled steps are derived here, once, as the drop-in
    derives them once per schedule: no timed step pays the lowering."""
    from megatron_pp_ext.runtime.executor import Executor, steps_for

    work_class = device_work_class()
    steps = steps_for(schedule, rank, transport,
                      work_class(schedule, rank, weights, inputs, costs))

    def step():
        work = work_class(schedule, rank, weights, inputs, costs)
        result = Executor(schedule, rank, transport, work, recv_shape=(ROWS, WIDTH),
                          dtype=torch.float64, device=torch.device("cpu"), timeout_s=120,
                          trace=trace, steps=steps).run()
        return result.events if trace else None
    return step


def megatron_step(function, chunks, m: int, data):
    iterators = [itertools.repeat(data) for _ in chunks]
    function(forward_step_func=fake_forward_step,
             data_iterator=iterators if len(chunks) > 1 else iterators[0],
             model=chunks if len(chunks) > 1 else chunks[0],
             num_microbatches=m, seq_length=SEQ, micro_batch_size=MBS)
    for chunk in chunks:
        chunk.weight.grad = None


def round_trip(transport, rank: int, repeats: int = 60) -> list[tuple[float, float]]:
    """Rank 0 <-> 1 ping-pong of one activation through the executor's transport call, fused
    as the executor fuses them (a send goes out with the next receive). Rank 0 returns
    (round trip, time its fused send+receive call took to post) per repeat."""
    from megatron_pp_ext.runtime.transport import RecvRequest

    tensor = torch.zeros(ROWS, WIDTH, dtype=torch.float64)
    request = lambda peer: RecvRequest(peer, (ROWS, WIDTH), torch.float64, torch.device("cpu"))
    samples = []
    total = repeats + 2
    if rank == 1:
        _, recv = transport.exchange(None, request(0), False)
    for i in range(total):
        if rank == 0:
            start = time.perf_counter()
            send, recv = transport.exchange((tensor, 1), request(1), False)
            posted = time.perf_counter()
            recv.wait(30)
            send.wait(30, transport.poll)
            if i >= 2:
                samples.append((time.perf_counter() - start, posted - start))
        elif rank == 1:
            got = recv.wait(30)
            send, recv = transport.exchange((got, 0), request(0) if i + 1 < total else None,
                                            False)
            send.wait(30, transport.poll)
    return samples


def tree(rank: int, world: int, setup: Setup) -> dict:
    """Spawn target: everything of bench (a) for one pipeline size, in one process tree."""
    import torch.distributed as dist

    from support.emulated import microbatch_inputs, stage_weights
    from megatron_pp_ext.runtime.transport import TorchDistTransport

    p, t = world, setup.t
    reniced = raise_priority(setup.niceness) if setup.niceness else False
    transport = TorchDistTransport(None)
    out = {"rank": rank, "reniced": reniced, "rtt": round_trip(transport, rank, 40),
           "steps": {}, "b2b": {}, "cross": {}}
    optimizer_group = dist.new_group(list(range(world))) if setup.optimizer_modes else None
    dist.barrier()

    runners = {}  # label -> (callable running one step of this m)
    tracers = {}  # label -> the same step, returning its traced events (plugin schedules)
    megatron = {}
    if setup.megatron:
        from megatron.core.pipeline_parallel import schedules as mcore

        from megatron_pp_ext.train.processes import init_megatron
        from megatron_pp_ext.integration.forward_backward import ScheduleFunction

        init_megatron(p, 2)
        if setup.niceness:
            raise_priority(setup.niceness)  # the new groups' gloo threads too
        megatron = {
            "megatron-1f1b": (mcore.forward_backward_pipelining_without_interleaving,
                              fake_chunks(rank, p, 1, t)),
            "megatron-interleaved": (mcore.forward_backward_pipelining_with_interleaving,
                                     fake_chunks(rank, p, 2, t)),
            "plugin-1f1b": (ScheduleFunction("1f1b"), fake_chunks(rank, p, 1, t)),
        }
    data = torch.ones(SEQ, MBS, 64)

    for m in setup.ms:
        runners.clear()
        plugin = [label for label, _, _ in PLUGIN] + [
            label for label, _, _, _ in PLUGIN_ONLY_WHEN_ASKED if label in setup.only]
        for label in plugin:
            schedule = labelled_schedule(label, p, m)  # validated once, not timed
            weights = stage_weights(schedule.num_stages, WIDTH)
            inputs = microbatch_inputs(m, ROWS, WIDTH)
            costs = costs_for(t, schedule.path_chunks)  # dualpipe's stages are whole parts
            runners[label] = plugin_runner(schedule, rank, transport, weights, inputs, costs)
            tracers[label] = plugin_runner(schedule, rank, transport, weights, inputs, costs,
                                           trace=True)
        for label, key, v, _ in (MEGATRON if setup.megatron else []):
            function, chunks = megatron[key]
            runners[label] = lambda f=function, c=chunks: megatron_step(f, c, m, data)
        fresh = torch_runners(runners, out, rank, p, m, setup) if setup.torch_pipelining else []

        labels = [label for label in runners if not setup.only or label in setup.only]
        for label in labels:  # one untimed warm-up step each (imports, caches, torch's set-up)
            if m == setup.ms[0] or label in fresh:
                runners[label]()
                dist.barrier()
        steps = {label: [] for label in labels}
        for rep in range(setup.reps):
            dist.barrier()
            out["rtt"] += round_trip(transport, rank, 20)  # sampled under the same load
            shift = rep % len(labels)
            for label in labels[shift:] + labels[:shift]:
                dist.barrier()
                start = time.perf_counter()
                runners[label]()
                steps[label].append((start, time.perf_counter()))
        for label in labels:
            out["steps"][(m, label)] = steps[label]

        if m in setup.back_to_back_ms:
            b2b_labels = [x for x in BACK_TO_BACK if x in labels]
            rounds = {label: [] for label in b2b_labels}
            for rep in range(setup.b2b_reps):
                shift = rep % len(b2b_labels)
                for label in b2b_labels[shift:] + b2b_labels[:shift]:
                    dist.barrier()
                    start = time.perf_counter()
                    ends = []
                    for _ in range(setup.k_steps):
                        runners[label]()
                        ends.append(time.perf_counter())
                    rounds[label].append((start, ends))
            for label in b2b_labels:
                out["b2b"][(m, label)] = rounds[label]

        if m in setup.back_to_back_ms and setup.optimizer_modes:
            combos = [(label, mode) for label in CROSS_STEP if label in labels
                      for mode in setup.optimizer_modes]
            rounds = {combo: [] for combo in combos}
            for rep in range(setup.b2b_reps):
                shift = rep % len(combos)
                for label, mode in combos[shift:] + combos[:shift]:
                    optimizer = OptimizerStepEmulation(
                        mode, optimizer_group, setup.t_opt_units * t, setup.t_copy_units * t,
                        setup.rollback_steps)
                    dist.barrier()
                    start = time.perf_counter()
                    ends = []
                    for j in range(setup.k_steps):
                        optimizer.before_step()
                        runners[label]()
                        if optimizer.after_compute():
                            runners[label]()  # the replay
                        optimizer.after_step(j)
                        ends.append(time.perf_counter())
                    optimizer.settle()
                    rounds[(label, mode)].append((start, ends))
            for (label, mode), value in rounds.items():
                out["cross"][(m, label, mode)] = value
            # one more, untimed, traced round: the timeline of consecutive steps
            for label, mode in combos:
                if label in setup.timeline_labels and mode in setup.timeline_modes:
                    out.setdefault("cross_trace", {})[(m, label, mode)] = traced_round(
                        tracers[label], OptimizerStepEmulation(
                            mode, optimizer_group, setup.t_opt_units * t,
                            setup.t_copy_units * t, setup.rollback_steps),
                        setup.k_steps, m, rank)
    dist.barrier()
    return out


# ------------------------------------------------------------------ predictions and summary
def concatenated(schedule: Schedule, k: int) -> Schedule:
    """``k`` steps of ``schedule`` as one schedule: step j runs microbatches j*m .. j*m+m-1."""
    m = schedule.num_microbatches
    actions = [[Action(a.stage, a.kind, a.microbatch + j * m) for j in range(k) for a in row]
               for row in schedule.actions]  # every rank: all of step 0, then step 1, ...
    return Schedule(f"{schedule.name} x{k}", m * k, schedule.stage_to_rank, actions,
                    dict(schedule.options))


def step_ends(timeline, m: int, k: int) -> list[float]:
    ends = [0.0] * k
    for event in timeline.compute_events():
        step = Action.parse(event.label).microbatch // m
        ends[step] = max(ends[step], event.end)
    return ends


def predict(name: str, v: int, p: int, m: int, t: float, t_comm: float, post: float = 0.0,
            k: int = 0) -> dict:
    """Simulated step (and, for k > 1, steady back-to-back period). ``post``: a per-action
    overhead added to every F, I and B (each posts a send and/or a receive; W moves
    nothing), for the prediction that also charges the executor's calls to the transport."""
    schedule = build_schedule(name, p, m, v)
    v = schedule.path_chunks  # a stage's share of the rank: 1/v (dualpipe: a whole part)
    costs = CostModel.for_stages(t_f=t / v + post, t_i=t / v + post, t_w=t / v,
                                 t_b=2 * t / v + post, t_comm=t_comm)  # per chunk: t / v
    timeline = simulate(schedule, costs, validate=False)
    result = {"makespan": timeline.makespan, "bubble": timeline.bubble_fraction}
    if k > 1:
        ends = step_ends(simulate(concatenated(schedule, k), costs), m, k)
        result["period"] = (ends[-1] - ends[0]) / (k - 1)
    return result


def summarize(per_rank: list[dict], setup: Setup) -> dict:
    """Step times, per-round ratios to 1F1B and this tree's ping-pong figures from one tree's
    per-rank timings. Predictions are attached later (``bench.calibration.apply``), with
    numbers taken from a different run."""
    p, t = len(per_rank), setup.t
    # the mean, not the median: a step sums many hops, so their expected time is what counts
    trips = [trip for trip, _ in per_rank[0]["rtt"]] or [0.0]
    posts = [post for _, post in per_rank[0]["rtt"]] or [0.0]
    rtt, post = statistics.fmean(trips), statistics.fmean(posts)
    rows = []
    for (m, label) in per_rank[0]["steps"]:
        runs = zip(*(r["steps"][(m, label)] for r in per_rank))
        times = [max(end for _, end in run) - min(start for start, _ in run) for run in runs]
        rows.append({"p": p, "m": m, "schedule": label, "v": _v_of(label), "times": times,
                     "median": statistics.median(times), "zero_bubble_limit": m * 3 * t})
    b2b = []
    k = setup.k_steps
    for (m, label), rounds in per_rank[0]["b2b"].items():
        periods = []
        for j in range(len(rounds)):
            ends = [max(r["b2b"][(m, label)][j][1][i] for r in per_rank) for i in range(k)]
            periods.append((ends[-1] - ends[0]) / (k - 1))
        b2b.append({"p": p, "m": m, "schedule": label, "v": _v_of(label), "periods": periods,
                    "period": statistics.median(periods)})
    _ratios_to_1f1b(rows, "times")
    _ratios_to_1f1b(b2b, "periods")
    cross = []
    for (m, label, mode), rounds in per_rank[0].get("cross", {}).items():
        periods = []
        for j in range(len(rounds)):
            ends = [max(r["cross"][(m, label, mode)][j][1][i] for r in per_rank)
                    for i in range(k)]
            periods.append((ends[-1] - ends[0]) / (k - 1))
        cross.append({"p": p, "m": m, "schedule": label, "mode": mode, "v": _v_of(label),
                      "periods": periods, "period": statistics.median(periods),
                      "t_opt": setup.t_opt_units * t, "t_copy": setup.t_copy_units * t,
                      "rollback_steps": list(setup.rollback_steps), "k": k})
    _cross_step_ratios(cross)
    timelines = [cross_timeline(per_rank, m, label, mode, k)
                 for (m, label, mode) in per_rank[0].get("cross_trace", {})]
    errors = [{"p": p, "m": m, "schedule": label, "error": error}
              for (m, label), error in per_rank[0].get("torch_errors", {}).items()]
    return {"p": p, "t": t, "rtt": rtt, "rtt_median": statistics.median(trips), "post": post,
            "t_comm": rtt / 2, "reniced": all(r["reniced"] for r in per_rank), "rows": rows,
            "back_to_back": b2b, "cross_step": cross, "torch_errors": errors,
            **({"cross_timelines": timelines} if timelines else {})}


def _v_of(label: str) -> int:
    chunks = {label: v for label, _, v in PLUGIN}
    chunks.update({label: v for label, _, v, _ in PLUGIN_ONLY_WHEN_ASKED})
    chunks.update({label: v for label, _, v, _ in MEGATRON})
    chunks.update({label: v for label, _, v, _ in TORCH})
    return chunks[label]


def _ratios_to_1f1b(rows: list, key: str) -> None:
    """Per round (same round = measured side by side) ratio to the plugin's 1f1b, and its
    median; nothing where the tree did not run 1f1b at that m."""
    for row in rows:
        base = next((r for r in rows if r["m"] == row["m"] and r["schedule"] == "1f1b"), None)
        if base is not None:
            row["vs_1f1b_rounds"] = [a / b for a, b in zip(row[key], base[key])]
            row["vs_1f1b"] = statistics.median(row["vs_1f1b_rounds"])


def cross_timeline(per_rank: list, m: int, label: str, mode: str, k: int):
    """The traced cross-step round of every rank as one measured ``Timeline`` (seconds from
    the first rank's first event)."""
    from dataclasses import replace

    from megatron_pp_ext.timeline import Timeline

    events = [e for r in per_rank for e in r["cross_trace"][(m, label, mode)]]
    origin = min(e.start for e in events)
    events = [replace(e, start=e.start - origin, end=e.end - origin) for e in events]
    v = _v_of(label)
    return Timeline(f"{label} x{k} back to back, {mode}", len(per_rank), m * k, v, events,
                    source="measured", unit="s")


def _cross_step_ratios(rows: list) -> None:
    """Per round ratios of each cross-step row to 1F1B with Megatron's synchronous step
    (``vs_1f1b_sync``: what a Megatron-LM run does today) and to 1F1B in the same mode."""
    for row in rows:
        for key, mode in (("vs_1f1b_sync", "sync"), ("vs_1f1b_same_mode", row["mode"])):
            base = next((r for r in rows if r["m"] == row["m"] and r["schedule"] == "1f1b"
                         and r["mode"] == mode), None)
            if base is not None:
                row[f"{key}_rounds"] = [a / b for a, b in zip(row["periods"], base["periods"])]
                row[key] = statistics.median(row[f"{key}_rounds"])


def run(p: int, ms, t: float = 0.020, reps: int = 5, back_to_back_ms=(), k_steps: int = 4,
        b2b_reps: int = 3, megatron: bool = True, niceness: int = -20, only=(),
        timeout_s: float = 900, optimizer_modes=OPTIMIZER_MODES, rollback_steps=(2,),
        timeline_labels=(), torch_pipelining: bool = True) -> dict:
    from megatron_pp_ext.train.processes import spawn

    setup = Setup(p=p, ms=tuple(ms), t=t, reps=reps, k_steps=k_steps, b2b_reps=b2b_reps,
                  back_to_back_ms=tuple(back_to_back_ms), megatron=megatron,
                  torch_pipelining=torch_pipelining, niceness=niceness,
                  only=tuple(only), optimizer_modes=tuple(optimizer_modes),
                  rollback_steps=tuple(rollback_steps), timeline_labels=tuple(timeline_labels))
    from bench.provenance import utc_now

    started = utc_now()
    per_rank = spawn(p, tree, setup, timeout_s=timeout_s)
    return {**summarize(per_rank, setup), "utc_start": started, "utc_end": utc_now(),
            "reps": reps}


def labelled_schedule(label: str, p: int, m: int) -> Schedule:
    """The schedule a plugin row of this bench runs (``PLUGIN``, ``PLUGIN_ONLY_WHEN_ASKED``)."""
    for known, name, v in PLUGIN:
        if known == label:
            return build_schedule(name, p, m, v)
    for known, name, v, options_for in PLUGIN_ONLY_WHEN_ASKED:
        if known == label:
            return build_schedule(name, p, m, v, **options_for(p))
    raise ValueError(f"{label!r} is not a plugin row of this bench")
