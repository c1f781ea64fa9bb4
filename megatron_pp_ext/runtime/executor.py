"""One executor for every schedule: it interprets one rank's part of a ``Program``.

The program (``program.py``, lowered by ``analysis/program_pass.py``; chosen for the transport by
``analysis/lowering.py``) lists, per rank, its compute actions, the batches of point-to-point ops
it posts and where it waits on them. The executor posts exactly those batches (one transport
call each: one ``batch_isend_irecv`` on NCCL), waits exactly where the program says, and runs
each action's hooks where the program says the action begins. It has no posting rules of its
own: a new way of posting is a new lowering pass.

What an action computes is the ``StageWork``'s business (Megatron's forward_step /
backward_step in production, toy stages in tests); the executor moves tensors, counts
held activations, frees sent outputs once their sends complete (Megatron's
``deallocate_output_tensor``), keeps a history for timeouts and, when asked, records a trace.
"""

from __future__ import annotations

import collections
import os
import re
import time
from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch

from ..ir import BACKWARD, BACKWARD_WEIGHT, FORWARD, Action, Schedule
from ..timeline import COMM_WAIT, COMPUTE, Event
from .. import device as device_helper
from .errors import PeerFailedError, PeerReported, PipelineTimeoutError
from ..analysis.lowering import runtime_program
from ..analysis.messages import ACTIVATION, GRADIENT, MEGATRON_TIMERS, Message, comm_plan
from ..analysis.program_steps import STEP_COMPUTE, STEP_POST, STEP_WAIT, compile_steps
from ..program import Program
from .memory import ActivationMemory
from .transport import RecvRequest, TransportTimeout

class StageWork(Protocol):
    # optional: ``begin(action)``, called before the action's inputs are received (hooks
    # that Megatron runs before its receive, e.g. enabling grad sync for the last backward)

    def forward(self, action: Action, input_tensor): ...  # -> output tensor (None on the last stage)

    def backward(self, action: Action, output_grad): ...  # B or I -> input gradient (None on stage 0)

    def weight(self, action: Action) -> None: ...

    def deallocate(self, output) -> None: ...  # the output has been sent: free its data


@dataclass
class StepResult:
    executed: list[Action]
    peak_activations: int  # a COUNT of chunk-activations (the simulator's unit), not bytes
    comm_calls: collections.Counter
    events: list[Event] = field(default_factory=list)
    # the I/W split's weight-gradient GEMMs on this rank (runtime.wgrad.WeightGradStats as a
    # dict: counts and W's seconds), from the work's ``weight_grad_stats()``; None without a split
    weight_grads: dict | None = None
    # Activation memory in bytes (runtime/memory.py); None for a forward-only step or with
    # Executor(memory=False). peak_bytes: the peak over the step of the unique storages held
    # by saved tensors, the W queue and waiting arrivals; peak_bytes_parts: that peak split
    # into "saved", "w_queue" and "waiting"; saved_bytes_per_stage: {stage: bytes one F of
    # the stage saved}; device_peak_bytes: on a GPU, the CUDA allocator's peak allocated
    # bytes over the step (everything: weights, gradients, optimizer state too), else None.
    peak_bytes: int | None = None
    peak_bytes_parts: dict | None = None
    saved_bytes_per_stage: dict | None = None
    device_peak_bytes: int | None = None
    overlapped_pairs: int = 0  # DualPipe's F&B pairs computed in one call (a COUNT)


def memory_measured() -> bool:
    """Whether executors measure activation bytes when not told (MEGATRON_PP_EXT_MEMORY=1;
    off by default: the walk costs host time on every F, like tracing)."""
    return os.environ.get("MEGATRON_PP_EXT_MEMORY", "0").strip().lower() not in (
        "0", "false", "no", "off")


class PeerLostError(PipelineTimeoutError):
    """The transport lost its connection to a peer (gloo: "Connection closed by peer" when the
    peer's process died): raised at once instead of a timeout, naming the same things."""

    def __init__(self, rank: int, peer: int, pending: str, waited_s: float, recent: list[str],
                 cause: str):
        super().__init__(rank, peer, pending, waited_s, recent)
        self.cause = cause
        history = " ".join(recent[-32:]) or "(none)"
        self.args = (
            f"pipeline rank {rank} lost its connection to rank {peer} after {waited_s:.1f} s: "
            f"pending {pending}. Rank {peer} has most likely died (the transport said: "
            f"{cause}). Last actions of rank {rank}: {history}",)


#: What gloo (and TCP) say when a peer's process is gone.
_CONNECTION_LOST = ("connection closed", "connection reset", "broken pipe", "connection refused")


def connection_lost(exc: BaseException) -> bool:
    return isinstance(exc, RuntimeError) and any(
        marker in str(exc).lower() for marker in _CONNECTION_LOST)


def program_for(schedule: Schedule, transport, work, timers=None,
                variable_shapes: bool = False) -> Program:
    """The program an executor runs when its caller gives none (``lowering.runtime_program``
    with what the transport and the work say about themselves): on NCCL the checked program,
    else Megatron's fused calls with receives posted a call early where the transport gains
    from it (gloo, in memory) and no timer times the calls; DualPipe's F&B pairs in one call
    where the work computes them so."""
    return runtime_program(
        schedule, batched=getattr(transport, "batched", False),
        prefetch=getattr(transport, "prefetch_receives", False) and timers is None,
        overlapped_pairs=callable(getattr(work, "overlapped_forward_backward", None)),
        variable_shapes=variable_shapes)


def steps_for(schedule: Schedule, rank: int, transport, work, timers=None,
              variable_shapes: bool = False) -> list[tuple]:
    """``rank``'s compiled steps of ``program_for``'s program: what an executor built without
    ``program`` or ``steps`` derives, lowering the whole schedule. A caller that runs one
    schedule step after step derives them once and passes ``steps=`` (the drop-in does:
    ``RunState``), so no step pays the lowering."""
    program = program_for(schedule, transport, work, timers, variable_shapes)
    return compile_steps(program, rank, schedule, timed=timers is not None)


class Executor:
    _memory: ActivationMemory | None = None  # set per step by run() (activation bytes)
    _device_probe = None

    def __init__(self, schedule: Schedule, rank: int, transport, work: StageWork, *,
                 recv_shape: tuple | None, dtype: torch.dtype, device: torch.device,
                 program: Program | None = None, timeout_s: float = 600.0,
                 variable_shapes: bool = False, trace: bool = False,
                 clock: Callable[[], float] = time.perf_counter, timers=None,
                 memory: bool | None = None, steps: list[tuple] | None = None):
        self.schedule, self.rank, self.transport, self.work = schedule, rank, transport, work
        self.recv_shape, self.dtype, self.device = recv_shape, dtype, device
        self.timeout_s, self.variable_shapes = timeout_s, variable_shapes
        self.trace, self.clock = trace, clock
        self.timers = timers  # Megatron's config.timers: each call is timed as Megatron does
        self.actions = schedule.actions[rank]
        self.plans = comm_plan(schedule, rank)
        # What this rank runs: the caller's program (the drop-in passes the one it checked),
        # else the one for this transport (``program_for``); ``steps``: already compiled.
        if steps is None:
            steps = (steps_for(schedule, rank, transport, work, timers, variable_shapes)
                     if program is None else
                     compile_steps(program, rank, schedule, timed=timers is not None))
        self.steps = steps
        # Activations are held until a B, or a W, frees them; a forward-only list holds none.
        self.frees_activations = any(a.kind != FORWARD for a in self.actions)
        # activation bytes (runtime/memory.py): with memory=True, or, when not given,
        # MEGATRON_PP_EXT_MEMORY=1 in the environment (the walk costs ~0.15 ms of host time
        # per layer and F: the drop-in measures only traced or auto-measuring steps)
        self.measure_memory = memory_measured() if memory is None else memory

    def run(self) -> StepResult:
        self._history = collections.deque(maxlen=32)  # the last actions, for errors
        self._events: list[Event] = []
        self._calls = collections.Counter()
        self._local: dict[tuple, object] = {}  # tensors handed between stages of this rank
        self._stash: dict[Message, object] = {}  # received, waiting for their action
        self._outgoing: dict[Message, object] = {}  # computed, waiting for their post
        self._receiving: dict[tuple, tuple] = {}  # (batch, op) -> (handle, message)
        self._unsent: dict[tuple, tuple] = {}  # (batch, op) -> (handle, output, message)
        self._unsent_activation: dict[tuple, tuple] = {}  # (stage, mb) -> (batch, op)
        self._reaped: set[tuple] = set()  # sends found complete before their wait
        self._open_timers: dict[int, str] = {}  # batch -> its call's timer, until its wait
        self._next = 0  # the next action to compute
        self._paired: int | None = None  # an F waiting for its pair's B
        self._pairs = 0
        self._held = self._peak = 0
        self._start_memory()
        begin = getattr(self.work, "begin", None)
        for step in self.steps:
            tag = step[0]
            if tag == STEP_POST:
                self._post(*step[1:])
            elif tag == STEP_WAIT:
                self._wait_step(step[1], step[2])
            elif tag == STEP_COMPUTE:
                self._compute_step(step[1], step[2])
            elif begin is not None:
                begin(self.actions[step[1]])
        for key in list(self._unsent):  # a program that leaves sends unwaited (the pass never does)
            self._wait_step(*key)
        left = (sorted(self._local) + [str(m) for m in self._stash]
                + [str(m) for m in self._outgoing] + [str(m) for _, m in self._receiving.values()])
        if left:
            raise RuntimeError(
                f"rank {self.rank}: tensors were left unconsumed at the end of the step: "
                f"{left} (the schedule lacks their consumers, or the program their posts "
                "and waits)")
        stats = getattr(self.work, "weight_grad_stats", None)
        result = StepResult(list(self.actions), self._peak, self._calls, self._events,
                            weight_grads=stats() if callable(stats) else None,
                            overlapped_pairs=self._pairs)
        self._finish_memory(result)
        return result

    # ------------------------------------------------------------------ compute steps
    def _compute_step(self, i: int, paired: bool) -> None:
        self._next = i + 1
        if paired:  # DualPipe's overlapped F&B pair: computed with the next compute step
            self._paired = i
            return
        action = self.actions[i]
        if self._paired is not None:
            first = self.actions[self._paired]
            self._paired = None
            self._pairs += 1
            incoming, partner_in = self._input_of(i - 1, first), self._input_of(i, action)
            start = self.clock() if self.trace else 0.0
            produced, partner_out = self.work.overlapped_forward_backward(
                first, incoming, action, partner_in)
            self._attribute(first, produced)
            self._attribute(action, partner_out)
            self._count(first)
            self._count(action)
            self._record(start, f"{first}+{action}")
            self._output(i - 1, first, produced)
            self._output(i, action, partner_out)
        else:
            incoming = self._input_of(i, action)
            start = self.clock() if self.trace else 0.0
            produced = self._compute(action, incoming)
            self._record(start, str(action))
            self._output(i, action, produced)
        self._reap()

    def _input_of(self, i: int, action: Action):
        """What ``action`` needs: received (the program waited for it) or handed over here."""
        plan = self.plans[i]
        if plan.recv is not None:
            if plan.recv not in self._stash:
                raise RuntimeError(
                    f"rank {self.rank}: {action} needs the {plan.recv.carries} tensor of "
                    f"microbatch {plan.recv.microbatch} from rank {plan.recv.peer}, which the "
                    "program has not received by then")
            incoming = self._stash.pop(plan.recv)
            if plan.recv.carries == ACTIVATION and incoming.is_floating_point():
                incoming.requires_grad_(True)
        else:
            incoming = self._local.pop(self._local_key(action), None)
        if action.kind == FORWARD and self._memory is not None:
            self._memory.note_input(incoming)
        after = self.schedule.downstream(action.stage)
        if action.kind != FORWARD and (after, action.microbatch) in self._unsent_activation:
            # Megatron's backward wants the sent output already deallocated.
            raise RuntimeError(
                f"rank {self.rank}: {action} runs before the program waits for the send of "
                f"the activation it computes the gradient of (stage {after}, "
                f"microbatch {action.microbatch})")
        return incoming

    def _compute(self, action: Action, incoming):
        if action.kind == FORWARD:
            produced = self.work.forward(action, incoming)
        elif action.kind == BACKWARD_WEIGHT:
            produced = self.work.weight(action)
        else:
            produced = self.work.backward(action, incoming)
        self._attribute(action, produced)
        self._count(action)
        return produced

    def _count(self, action: Action) -> None:
        """Activations held: +1 at the end of an F, -1 at the end of the B or W that frees it."""
        if action.kind == FORWARD:
            if self.frees_activations:
                self._held += 1
                self._peak = max(self._peak, self._held)
        elif action.kind in (BACKWARD, BACKWARD_WEIGHT):
            self._held -= 1
        self._sample_memory()

    def _record(self, start: float, label: str) -> None:
        if self.trace:
            self._events.append(Event(self.rank, label, start, self.clock(), COMPUTE))
        self._history.append(label)

    def _output(self, i: int, action: Action, produced) -> None:
        """Hand the output over on this rank, or keep it for the post that sends it."""
        plan = self.plans[i]
        if plan.send is None:
            if produced is not None:
                self._hand_over(action, produced)
            return
        self._check_outgoing(produced, plan.send, action)
        self._outgoing[plan.send] = produced

    # ------------------------------------------------------------------ posts and waits
    def _post(self, index: int, send_messages: list[Message], recvs: list[Message],
              name: str, until_wait: bool) -> None:
        """One call (one batch) for sends and/or receives, as the program lists it: sends
        first (one, or a DualPipe pair's two), then receives."""
        for message in send_messages:
            if message not in self._outgoing:
                raise RuntimeError(
                    f"rank {self.rank}: the program posts the send of {message} in batch "
                    f"#{index} before the action that computes it")
        sends = [(self._outgoing.pop(m), m.peer) for m in send_messages]
        self._calls[name] += 1
        timer = MEGATRON_TIMERS.get(name) if self.timers is not None else None
        if timer is not None:
            self.timers(timer, log_level=2).start()
        requests = [RecvRequest(m.peer, self.recv_shape, self.dtype, self.device)
                    for m in recvs]
        try:
            if len(requests) <= 1 and len(sends) <= 1:  # one of Megatron's calls
                send_handle, recv_handle = self.transport.exchange(
                    sends[0] if sends else None, requests[0] if requests else None,
                    self.variable_shapes)
                send_handles, recv_handles = [send_handle], [recv_handle]
            else:
                send_handles, recv_handles = self.transport.exchange_many(
                    sends, requests, self.variable_shapes)
        except RuntimeError as exc:
            peer = recvs[0].peer if recvs else sends[0][1]
            self._raise_if_lost(exc, peer, f"posting {name} (rank {peer})", 0.0)
            raise
        for k, (message, handle) in enumerate(zip(recvs, recv_handles)):
            self._receiving[(index, len(sends) + k)] = (handle, message)
        for k, (message, handle, (output, _)) in enumerate(zip(send_messages, send_handles,
                                                               sends)):
            self._unsent[(index, k)] = (handle, output, message)
            if message.carries == ACTIVATION:
                self._unsent_activation[(message.stage, message.microbatch)] = (index, k)
        if timer is not None:
            if until_wait and recvs:
                self._open_timers[index] = timer
            else:
                self.timers(timer).stop()
        self._reap()

    def _wait_step(self, index: int, op: int | None) -> None:
        if op is None:  # the whole batch
            for key in sorted(k for k in (*self._receiving, *self._unsent) if k[0] == index):
                self._wait_step(*key)
            return
        key = (index, op)
        if key in self._receiving:
            handle, message = self._receiving.pop(key)
            action = self.actions[min(self._next, len(self.actions) - 1)]
            self._stash[message] = self._wait(handle, message, action)
            needed = self.plans[self._next].recv if self._next < len(self.actions) else None
            if message != needed:  # an early arrival: it waits, held, for a later action
                self._sample_memory()
            if index in self._open_timers:
                self.timers(self._open_timers.pop(index)).stop()
        elif key in self._unsent:
            handle, output, message = self._unsent.pop(key)
            self._settled(message)
            self._finish_send(handle, message)
            self._release(output, message)
        elif key not in self._reaped:
            raise RuntimeError(f"rank {self.rank}: the program waits on op {op} of batch "
                               f"#{index}, which it has not posted")

    def _settled(self, message: Message) -> None:
        if message.carries == ACTIVATION:
            self._unsent_activation.pop((message.stage, message.microbatch), None)

    # ------------------------------------------------------------------ helpers
    def _local_key(self, action: Action):
        kind = ACTIVATION if action.kind == FORWARD else GRADIENT
        return (kind, action.stage, action.microbatch)

    def _hand_over(self, action: Action, produced) -> None:
        """A tensor for a stage on this same rank: detach it so each stage has its own graph."""
        before, after = (self.schedule.upstream(action.stage),
                         self.schedule.downstream(action.stage))
        if action.kind == FORWARD and after is not None:
            self._local[(ACTIVATION, after, action.microbatch)] = (
                produced.detach().requires_grad_(produced.is_floating_point()))
            self.work.deallocate(produced)
        elif action.kind != FORWARD and before is not None:
            self._local[(GRADIENT, before, action.microbatch)] = produced
        self._sample_memory()

    def _check_outgoing(self, tensor, message: Message, action: Action) -> None:
        if self.variable_shapes or self.recv_shape is None:
            return
        if tuple(tensor.shape) != tuple(self.recv_shape) or tensor.dtype != self.dtype:
            raise ValueError(
                f"rank {self.rank}: {action} produced a tensor of shape {tuple(tensor.shape)} "
                f"and dtype {tensor.dtype}, but rank {message.peer} expects "
                f"{tuple(self.recv_shape)} and {self.dtype} (seq_length x micro_batch_size x "
                "hidden_size, config.pipeline_dtype); pass the right seq_length, or set "
                "config.variable_seq_lengths=True when microbatches differ in length"
            )

    def _wait(self, handle, message: Message, action: Action) -> torch.Tensor:
        start = self.clock()
        pending = (f"{action} (microbatch {action.microbatch}) waiting for the "
                   f"{message.carries} tensor of microbatch {message.microbatch} from rank "
                   f"{message.peer}")
        try:
            tensor = handle.wait(self.timeout_s)
        except TransportTimeout:
            raise PipelineTimeoutError(self.rank, message.peer, pending, self.clock() - start,
                                       list(self._history)) from None
        except PeerReported as report:
            raise PeerFailedError(self.rank, report.peer, pending, self.clock() - start,
                                  list(self._history), report.note) from None
        except RuntimeError as exc:
            self._raise_if_lost(exc, message.peer, pending, self.clock() - start)
            raise
        except ValueError as exc:  # the transport's check of a received shape / dtype
            raise ValueError(
                f"rank {self.rank}, action {action}, receiving the {message.carries} tensor of "
                f"microbatch {message.microbatch} from rank {message.peer}: {exc} (the ranks "
                "must agree on seq_length, micro_batch_size, hidden_size and "
                "config.pipeline_dtype)") from None
        if self.trace:
            self._events.append(Event(self.rank, f"wait {action}<-rank {message.peer}", start,
                                      self.clock(), COMM_WAIT))
        return tensor

    def _reap(self) -> None:
        """Free outputs whose sends completed (Megatron's deallocate_output_tensor)."""
        for key, (handle, output, message) in list(self._unsent.items()):
            if handle.done():
                handle.wait(self.timeout_s, self.transport.poll)
                del self._unsent[key]
                self._reaped.add(key)
                self._settled(message)
                self._release(output, message)

    def _release(self, output, message: Message) -> None:
        # Only sent activations are freed (Megatron's deallocate_output_tensor); a gradient
        # is the autograd result itself.
        if message.carries == ACTIVATION:
            self.work.deallocate(output)

    def _finish_send(self, handle, message: Message) -> None:
        start = self.clock()
        pending = (f"the send of the {message.carries} tensor of microbatch "
                   f"{message.microbatch} for stage {message.stage} to rank {message.peer}")
        try:
            handle.wait(self.timeout_s, self.transport.poll)
        except TransportTimeout:
            raise PipelineTimeoutError(self.rank, message.peer, pending, self.timeout_s,
                                       list(self._history)) from None
        except PeerReported as report:
            raise PeerFailedError(self.rank, report.peer, pending, self.clock() - start,
                                  list(self._history), report.note) from None
        except RuntimeError as exc:
            self._raise_if_lost(exc, message.peer, pending, self.clock() - start)
            raise
        if self.trace:
            self._events.append(Event(self.rank, f"wait send->rank {message.peer} "
                                      f"{message.stage}{message.carries[0].upper()}"
                                      f"{message.microbatch}", start, self.clock(), COMM_WAIT))

    def _raise_if_lost(self, exc: BaseException, peer: int, pending: str,
                       waited_s: float) -> None:
        """A lost connection becomes a PeerLostError naming rank, peer and pending action."""
        if connection_lost(exc):
            # gloo: "[.../pair.cc:553] Connection closed by peer [ip]:port. This is typically..."
            cause = re.sub(r"^\[[^\]]*\]\s*", "", " ".join(str(exc).split()))
            cause = cause.split(". This is typically")[0][:200]
            raise PeerLostError(self.rank, peer, pending, waited_s, list(self._history),
                                cause) from exc

    # ------------------------------------------------------------------ activation bytes
    # (runtime/memory.py: the saved tensors of in-flight microbatches, the W queue's
    # tensors and the arrivals waiting for their action, as unique storages)
    def _start_memory(self) -> None:
        self._memory = (ActivationMemory() if self.measure_memory and self.frees_activations
                        else None)
        self._device_probe = (device_helper.start_memory_probe(self.device)
                              if self._memory is not None else None)

    def _attribute(self, action: Action, produced) -> None:
        """An F's saved tensors to its (stage, microbatch); released by its B, I or W."""
        if self._memory is None:
            return
        if action.kind == FORWARD:
            self._memory.record_forward(action.stage, action.microbatch, produced)
        else:
            self._memory.after_backward(action.stage, action.microbatch, action.kind)

    def _sample_memory(self) -> None:
        if self._memory is None:
            return
        held = getattr(self.work, "held_tensors", None)
        self._memory.sample(held() if callable(held) else (),
                            (list(self._stash.values()), list(self._local.values())))

    def _finish_memory(self, result: StepResult) -> None:
        if self._memory is None:
            return
        result.peak_bytes = int(self._memory.peak_bytes)
        result.peak_bytes_parts = dict(self._memory.peak_parts)
        result.saved_bytes_per_stage = self._memory.saved_bytes_per_stage()
        self._memory.release_all()
        if self._device_probe is not None:
            result.device_peak_bytes = device_helper.allocator_peak_bytes(self.device)
