"""One executor for every schedule: runs one rank's action list.

Communication is derived from the action list (``analysis/messages.py``). A send fuses with the next
action's receive when they go opposite ways, as Megatron's ``send_forward_recv_backward`` /
``send_backward_recv_forward``; receives are matched in each sender's order (the Inbox).

What an action computes is the ``StageWork``'s business (Megatron's forward_step /
backward_step in production, toy stages in tests); the executor moves tensors, counts
held activations, keeps a history for timeouts and, when asked, records a trace.
"""

from __future__ import annotations

import collections
import re
import time
from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch

from ..ir import BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, Action, Schedule
from ..timeline import COMM_WAIT, COMPUTE, Event
from .. import device as device_helper
from .errors import PeerFailedError, PeerReported, PipelineTimeoutError
from ..analysis.messages import (
    ACTIVATION,
    GRADIENT,
    MEGATRON_TIMERS,
    Inbox,
    LockstepPosting,
    Message,
    call_name,
    comm_plan,
    incoming_messages,
)
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


def memory_measured() -> bool:
    """Whether executors measure activation bytes when not told (MEGATRON_PP_EXT_MEMORY=1;
    off by default: the walk costs host time on every F, like tracing)."""
    import os

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


class Executor:
    _memory: ActivationMemory | None = None  # set per step by run() (activation bytes)
    _device_probe = None

    def __init__(self, schedule: Schedule, rank: int, transport, work: StageWork, *,
                 recv_shape: tuple | None, dtype: torch.dtype, device: torch.device,
                 timeout_s: float = 600.0, variable_shapes: bool = False,
                 trace: bool = False, clock: Callable[[], float] = time.perf_counter,
                 timers=None, incoming: dict[int, list[Message]] | None = None,
                 lockstep: LockstepPosting | None = None, post_ahead: bool = False,
                 memory: bool | None = None):
        self.schedule, self.rank, self.transport, self.work = schedule, rank, transport, work
        # What each peer sends this rank, in its order (a caller running many steps of one
        # schedule passes it in, derived once).
        self.incoming = incoming if incoming is not None else incoming_messages(schedule, rank)
        # A lockstep program (NCCL, where the fusion above could hang: see lowering.py):
        # after each action one batch with its send and every receive its peers' actions of
        # the same round send; receive-only batches for the rounds this rank sits idle.
        self.lockstep = lockstep
        self.recv_shape, self.dtype, self.device = recv_shape, dtype, device
        self.timeout_s, self.variable_shapes = timeout_s, variable_shapes
        self.trace, self.clock = trace, clock
        self.timers = timers  # Megatron's config.timers: each call is timed as Megatron does
        self.open_timers: dict[Message, str] = {}  # receives whose call's timer still runs
        self.actions = schedule.actions[rank]
        self.plans = comm_plan(schedule, rank)
        # Activations are held until a B, or a W, frees them; a forward-only list holds none.
        self.frees_activations = any(a.kind != FORWARD for a in self.actions)
        # Receives posted one action ahead where that cannot block a send (gloo, in memory:
        # not NCCL, whose same-peer operations queue behind each other) and where no one
        # times the calls (Megatron's timers time each call where Megatron makes it).
        self.prefetch = getattr(transport, "prefetch_receives", False) and timers is None
        # NCCL, where the lowering proved it safe (``lowering.nccl_post_ahead``): the next
        # action's receive, when it is not fused with this action's send, is posted before
        # this action computes, so its transfer overlaps the compute (as Megatron's
        # overlap_p2p_comm does). Its call is then timed at posting only.
        self.post_ahead = post_ahead and lockstep is None
        # DualPipeV's F&B pairs run in one call when the work (the model) offers one.
        self.overlap = bool(schedule.options.get("overlapped_pairs")) and callable(
            getattr(work, "overlapped_forward_backward", None))
        # activation bytes (runtime/memory.py): with memory=True, or, when not given,
        # MEGATRON_PP_EXT_MEMORY=1 in the environment (the walk costs ~0.15 ms of host time
        # per layer and F: the drop-in measures only traced or auto-measuring steps)
        self.measure_memory = memory_measured() if memory is None else memory

    def run(self) -> StepResult:
        self._history = collections.deque(maxlen=32)  # the last actions, for errors
        self._events: list[Event] = []
        self._calls = collections.Counter()
        self._local: dict[tuple, object] = {}  # tensors handed between stages of this rank
        self._unsent: list[tuple] = []  # (send handle, output, message) until the send is done
        self._inbox = Inbox(self.incoming)
        self._held = self._peak = 0
        self._start_memory()
        begin = getattr(self.work, "begin", None)
        i = 0
        while i < len(self.actions):
            action = self.actions[i]
            if begin is not None:
                begin(action)
            if self.lockstep is not None:
                for messages in self.lockstep.before.get(i, ()):
                    self._post(None, None, messages)
            incoming = self._input_of(i, action)
            if self._can_overlap(i):
                # DualPipe's overlapped F&B pair, when the model computes it in one call
                # and the backward's input is already here (never waited for early).
                partner = self.actions[i + 1]
                if begin is not None:
                    begin(partner)
                partner_in = self._input_of(i + 1, partner)
                start = self.clock() if self.trace else 0.0
                produced, partner_out = self.work.overlapped_forward_backward(
                    action, incoming, partner, partner_in)
                self._attribute(action, produced)
                self._attribute(partner, partner_out)
                self._count(action)
                self._count(partner)
                self._record(start, f"{action}+{partner}")
                self._emit(i, action, produced)
                self._emit(i + 1, partner, partner_out)
                i += 2
                continue
            if self.post_ahead:
                self._post_next_receive(i)
            start = self.clock() if self.trace else 0.0
            produced = self._compute(action, incoming)
            self._record(start, str(action))
            self._emit(i, action, produced)
            i += 1

        for handle, output, message in self._unsent:
            self._finish_send(handle, message)
            self._release(output, message)
        if self._local or self._inbox.stash:
            raise RuntimeError(
                f"rank {self.rank}: tensors were left unconsumed at the end of the step: "
                f"{sorted(self._local) + [str(m) for m in self._inbox.stash]} (the schedule "
                "lacks their consumers)")
        stats = getattr(self.work, "weight_grad_stats", None)
        result = StepResult(list(self.actions), self._peak, self._calls, self._events,
                            weight_grads=stats() if callable(stats) else None)
        self._finish_memory(result)
        return result

    def _input_of(self, i: int, action: Action):
        """Receive (or take over locally) what ``action`` needs."""
        plan = self.plans[i]
        if plan.recv is not None:
            incoming = self._take(plan.recv, action)
            if plan.recv.carries == ACTIVATION and incoming.is_floating_point():
                incoming.requires_grad_(True)
        else:
            incoming = self._local.pop(self._local_key(action), None)
        if action.kind == FORWARD and self._memory is not None:
            self._memory.note_input(incoming)
        if action.kind != FORWARD:
            # Megatron's backward wants the sent output already deallocated.
            self._settle_output_of(action)
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

    def _emit(self, i: int, action: Action, produced) -> None:
        """Hand the output over locally, or send it in one call with the next receive."""
        plan = self.plans[i]
        if plan.send is None and produced is not None:
            self._hand_over(action, produced)
        send = (produced, plan.send.peer) if plan.send is not None else None
        if send is not None:
            self._check_outgoing(produced, plan.send, action)
        if self.lockstep is not None:
            handle = self._post(send, plan.send, self.lockstep.after.get(i, []))
            if handle is not None:
                self._unsent.append((handle, produced, plan.send))
            self._reap()
            return
        # As Megatron: a send fuses with the next action's receive when they go opposite
        # ways (send_forward_recv_backward, send_backward_recv_forward); any other receive
        # is posted when its action starts.
        next_recv = self.plans[i + 1].recv if i + 1 < len(self.actions) else None
        to_post = None
        if send is not None and next_recv is not None and next_recv.carries != plan.send.carries:
            to_post = self._inbox.to_post(next_recv)
        handle = self._post(send, plan.send, [to_post] if to_post is not None else [])
        if handle is not None:
            self._unsent.append((handle, produced, plan.send))
        if to_post is None and next_recv is not None and self.prefetch:
            # Post the next receive now: a gloo send completes only once its receive is
            # posted, so the peer is not held up while this rank finishes its bookkeeping.
            early = self._inbox.to_post(next_recv)
            if early is not None:
                self._post(None, None, [early])
        self._reap()

    def _post_next_receive(self, i: int) -> None:
        """Post action i+1's receive now, unless it will go fused with action i's send."""
        if i + 1 >= len(self.actions):
            return
        needed, send = self.plans[i + 1].recv, self.plans[i].send
        if needed is None or (send is not None and send.carries != needed.carries):
            return
        early = self._inbox.to_post(needed)
        if early is not None:
            self._post(None, None, [early], time_post_only=True)

    def _can_overlap(self, i: int) -> bool:
        if not self.overlap or i + 1 >= len(self.actions):
            return False
        if self.lockstep is not None and self.lockstep.before.get(i + 1):
            return False  # the pair would post a later round's receives before this send
        first, second = self.actions[i], self.actions[i + 1]
        if first.kind != FORWARD or second.kind not in (BACKWARD, BACKWARD_INPUT) \
                or first.stage == second.stage:
            return False
        needed = self.plans[i + 1].recv
        if needed is not None:
            return needed in self._inbox.stash
        return (second.stage == self.schedule.num_stages - 1
                or self._local_key(second) in self._local)

    # ------------------------------------------------------------------ helpers
    def _local_key(self, action: Action):
        kind = ACTIVATION if action.kind == FORWARD else GRADIENT
        return (kind, action.stage, action.microbatch)

    def _hand_over(self, action: Action, produced) -> None:
        """A tensor for a stage on this same rank: detach it so each stage has its own graph."""
        last = self.schedule.num_stages - 1
        if action.kind == FORWARD and action.stage < last:
            self._local[(ACTIVATION, action.stage + 1, action.microbatch)] = (
                produced.detach().requires_grad_(produced.is_floating_point()))
            self.work.deallocate(produced)
        elif action.kind != FORWARD and action.stage > 0:
            self._local[(GRADIENT, action.stage - 1, action.microbatch)] = produced
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

    def _post(self, send, send_message: Message | None, recvs: list[Message],
              time_post_only: bool = False):
        """One call (one batch) for a send and/or receives; returns the send's handle."""
        if send is None and not recvs:
            return None
        name = call_name(send_message if send is not None else None, *recvs)
        self._calls[name] += 1
        timer = MEGATRON_TIMERS.get(name) if self.timers is not None else None
        # Megatron's timer of a call runs until its receive is waited on; a lockstep program
        # posts the next call of the same name before that, so there only the post is timed.
        time_post_only = time_post_only or self.lockstep is not None
        if timer is not None:
            self.timers(timer, log_level=2).start()
        requests = [RecvRequest(m.peer, self.recv_shape, self.dtype, self.device)
                    for m in recvs]
        try:
            if len(requests) <= 1:
                send_handle, recv_handle = self.transport.exchange(
                    send, requests[0] if requests else None, self.variable_shapes)
                recv_handles = [recv_handle] if requests else []
            else:
                send_handle, recv_handles = self.transport.exchange_many(
                    send, requests, self.variable_shapes)
        except RuntimeError as exc:
            peer = recvs[0].peer if recvs else send[1]
            self._raise_if_lost(exc, peer, f"posting {name} (rank {peer})", 0.0)
            raise
        for message, handle in zip(recvs, recv_handles):
            self._inbox.posted(message, handle)
            if timer is not None and not time_post_only:
                self.open_timers[message] = timer
        if timer is not None and (time_post_only or not recvs):
            self.timers(timer).stop()
        return send_handle

    def _take(self, needed: Message, action: Action):
        """The tensor ``action`` needs; earlier messages from the same peer land in the stash."""
        inbox = self._inbox
        while needed not in inbox.stash:
            if not inbox.in_flight[needed.peer]:
                self._post(None, None, [inbox.next_from(needed.peer)])
            message, handle = inbox.oldest_in_flight(needed.peer)
            inbox.stash[message] = self._wait(handle, message, action)
            if message != needed:  # an early arrival: it waits, held, for a later action
                self._sample_memory()
            if message in self.open_timers:
                self.timers(self.open_timers.pop(message)).stop()
        return inbox.stash.pop(needed)

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

    def _settle_output_of(self, action: Action) -> None:
        still = []
        for handle, output, message in self._unsent:
            if (message.carries == ACTIVATION and message.microbatch == action.microbatch
                    and message.stage == action.stage + 1):
                self._finish_send(handle, message)
                self.work.deallocate(output)
            else:
                still.append((handle, output, message))
        self._unsent = still

    def _reap(self) -> None:
        """Free outputs whose sends completed (Megatron's deallocate_output_tensor)."""
        still = []
        for handle, output, message in self._unsent:
            if handle.done():
                handle.wait(self.timeout_s, self.transport.poll)
                self._release(output, message)
            else:
                still.append((handle, output, message))
        self._unsent = still

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
                            (self._inbox.stash_tensors(), list(self._local.values())))

    def _finish_memory(self, result: StepResult) -> None:
        if self._memory is None:
            return
        result.peak_bytes = int(self._memory.peak_bytes)
        result.peak_bytes_parts = dict(self._memory.peak_parts)
        result.saved_bytes_per_stage = self._memory.saved_bytes_per_stage()
        self._memory.release_all()
        if self._device_probe is not None:
            result.device_peak_bytes = device_helper.allocator_peak_bytes(self.device)
