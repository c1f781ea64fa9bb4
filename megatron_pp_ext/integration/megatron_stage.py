"""The StageWork that computes with Megatron-Core: its own ``forward_step`` and
``backward_step`` (they carry the loss-scaling contract, MoE/MTP auxiliary losses and the
timers), ``deallocate_output_tensor``, and the grad-sync hooks in Megatron's order."""

from __future__ import annotations

import contextlib

import torch
from megatron.core.pipeline_parallel.schedules import (
    backward_step,
    check_first_val_step,
    deallocate_output_tensor,
    forward_step,
)

from ..ir import BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, Action, Schedule
from . import moe_overlap
from .direction_data import select_microbatch


def relearn_grad_ready_counts(model_chunks) -> None:
    """Megatron DDP (--overlap-grad-reduce) records in its first step how many grad-ready
    calls each parameter gets while sync is on, and from then on starts a bucket's reduction
    as soon as those counts are met. Another action order gives other counts: a schedule with
    more W's after its last I meets the old counts before its last W, and the reduction would
    read ``main_grad`` while later W's still add to it. So each bucket group is put back in
    its first-step state: it counts without starting, reduces at the end of the step, and
    keeps the counts of the new order (Megatron's own ``reset`` records them)."""
    for chunk in model_chunks:
        for name in ("bucket_groups", "expert_parallel_bucket_groups"):
            for bucket_group in getattr(chunk, name, None) or ():
                bucket_group.is_first_batch = True
                bucket_group.golden_per_param_grad_ready_counts = {}


class GradSync:
    """Megatron's no_sync / grad_sync_func / param_sync_func protocol, driven by actions.

    One chunk: as ``forward_backward_pipelining_without_interleaving`` (grad sync enabled
    before the last backward, B or I, when there is no grad_sync_func or this is the first
    stage; the rest at the end). With the I/W split the parameters whose gradients I computes
    (biases, norms, embeddings) get their last microbatch's gradient there, so sync must be on
    from that I: Megatron DDP counts each parameter's grad-ready calls in the first step and
    expects the same counts after (the W's that follow count too). Several chunks: as the interleaved schedule (each
    chunk's sync at its last weight-gradient action, no_sync re-entered after every one).
    """

    def __init__(self, config, model_chunks, schedule: Schedule, rank: int, forward_only: bool):
        self.config, self.chunks, self.forward_only = config, model_chunks, forward_only
        self.schedule, self.rank = schedule, rank
        self.multi = len(model_chunks) > 1
        no_sync = config.no_sync_func
        if isinstance(no_sync, list):
            funcs = no_sync

            def no_sync():
                stack = contextlib.ExitStack()
                for func in funcs:
                    stack.enter_context(func())
                return stack

        self.no_sync_func = no_sync or contextlib.nullcontext
        self.context = None
        self.grad_sync = None if forward_only else self._per_chunk(config.grad_sync_func)
        self.param_sync = None if forward_only else self._per_chunk(config.param_sync_func)
        self.synced: set[int] = set()
        # the actions that accumulate weight gradients, and the last one of each chunk
        self.weight_actions = [a for a in schedule.actions[rank]
                               if a.kind not in (FORWARD, BACKWARD_INPUT)]
        self.last_weight_action: dict[int, Action] = {}
        for action in self.weight_actions:
            self.last_weight_action[schedule.chunk_of(action.stage)] = action
        # one chunk: where grad sync is turned on (the last B or I; see the class docstring)
        self.last_backward_action: Action | None = None
        for action in schedule.actions[rank]:
            if action.kind in (BACKWARD, BACKWARD_INPUT):
                self.last_backward_action = action
        self.weight_done = 0
        self.first_forward_seen: set[int] = set()

    def _per_chunk(self, func):
        if func is None:
            return None
        return func if isinstance(func, list) else [func for _ in self.chunks]

    def disable(self) -> None:
        if self.context is None:
            self.context = self.no_sync_func()
            self.context.__enter__()

    def enable(self) -> None:
        if self.context is not None:
            self.context.__exit__(None, None, None)
            self.context = None

    def start(self, learned_under: tuple | None = None) -> tuple | None:
        """Enter the step: no_sync, the first chunks' param sync. ``learned_under``: this
        rank's action order that Megatron DDP learned its grad-ready counts in (None: none
        yet); when this step's differs (``auto`` switched schedules), DDP learns afresh
        (:func:`relearn_grad_ready_counts`). Returns the order DDP's counts now follow."""
        order = None if self.forward_only else tuple(self.schedule.actions[self.rank])
        if order is not None and learned_under is not None and order != learned_under:
            relearn_grad_ready_counts(self.chunks)
        self.disable()
        if self.multi and self.param_sync is not None:
            for chunk in range(min(2, len(self.chunks))):  # Megatron syncs the first two up front
                self.param_sync[chunk](self.chunks[chunk].parameters())
                self.first_forward_seen.add(chunk)
        return learned_under if order is None else order

    def before(self, action: Action) -> None:
        chunk = self.schedule.chunk_of(action.stage)
        if action.kind == FORWARD:
            if self.multi and self.param_sync is not None and chunk not in self.first_forward_seen:
                self.first_forward_seen.add(chunk)
                self.param_sync[chunk](self.chunks[chunk].parameters())
            return
        if not self.multi:
            if action == self.last_backward_action and (self.grad_sync is None
                                                        or action.stage == 0):
                self.enable()
            return
        if self.last_weight_action.get(chunk) != action:
            return
        if self.grad_sync is None:
            self.enable()
            self.synced.add(chunk)

    def after(self, action: Action) -> None:
        if not self.multi or action.kind in (FORWARD, BACKWARD_INPUT):
            return
        # As Megatron's interleaved schedule: chunk c's grad_sync_func is launched pp_rank
        # weight-gradient actions after its last one, so ranks launch it at about one time.
        delayed = self.weight_done - self.rank
        self.weight_done += 1
        if self.grad_sync is not None and delayed >= 0:
            earlier = self.weight_actions[delayed]
            chunk = self.schedule.chunk_of(earlier.stage)
            if self.last_weight_action[chunk] == earlier:
                self.enable()
                self.grad_sync[chunk](self.chunks[chunk].parameters())
                self.synced.add(chunk)
        self.disable()

    def finish(self) -> None:
        if self.forward_only:
            self.enable()
            return
        if not self.multi:
            if self.context is not None:
                self.enable()
                if self.grad_sync is not None:
                    self.grad_sync[0](self.chunks[0].parameters())
            return
        self.enable()
        if self.grad_sync is not None:
            for chunk, model in enumerate(self.chunks):
                if chunk not in self.synced:
                    self.grad_sync[chunk](model.parameters())


def _overlap_hook(chunk):
    return getattr(_unwrapped(chunk), "overlapped_forward_backward", None)


def offers_overlapped_pairs(model_chunks, config=None) -> bool:
    """Whether DualPipe's F&B pairs are computed in one call: a model chunk's hook
    ``overlapped_forward_backward``, or Megatron's per-layer plan (``config`` asks for
    --overlap-moe-expert-parallel-comm: ``moe_overlap``); then the program runs the pairs so."""
    return (moe_overlap.requested(config)
            or any(callable(_overlap_hook(chunk)) for chunk in model_chunks))


def _unwrapped(module):
    """The model inside DDP / Float16Module wrappers."""
    while hasattr(module, "module"):
        module = module.module
    return module


class MegatronStageWork:
    """Computes this rank's actions on its Megatron model chunks."""

    def __init__(self, *, schedule: Schedule, rank: int, forward_step_func, data_iterators,
                 model_chunks, num_microbatches: int, config, cp_size, collect_non_loss_data,
                 first_val_step, forward_only: bool, token_device: torch.device,
                 grad_sync: GradSync, weight_split=None):
        self.schedule, self.rank = schedule, rank
        self.forward_step_func, self.data_iterators = forward_step_func, data_iterators
        self.chunks, self.num_microbatches, self.config = model_chunks, num_microbatches, config
        self.cp_size, self.collect_non_loss_data = cp_size, collect_non_loss_data
        self.first_val_step, self.forward_only = first_val_step, forward_only
        self.grad_sync, self.weight_split = grad_sync, weight_split
        if weight_split is not None and getattr(weight_split, "schedule_name", None) is None:
            weight_split.schedule_name = schedule.name  # named in its warning
        self.forward_data_store: list = []
        self.total_num_tokens = torch.zeros([], dtype=torch.int, device=token_device)
        self.saved: dict[tuple, tuple] = {}  # (stage, mb) -> (input, output)
        self.num_forwards = 0
        self.max_outstanding = None
        if config.num_microbatches_with_partial_activation_checkpoints is not None:
            # Megatron's window: the forwards a rank runs before its first backward.
            actions = schedule.actions[rank]
            first_backward = next((i for i, a in enumerate(actions) if a.kind != FORWARD),
                                  len(actions))
            self.max_outstanding = max(1, sum(a.kind == FORWARD for a in actions[:first_backward]))

        # --overlap-moe-expert-parallel-comm: every F and B (I) through Megatron's per-layer
        # plan, DualPipeV's F&B pairs in one combined call (moe_overlap)
        self.combined = None
        if moe_overlap.requested(config) and not forward_only:
            moe_overlap.check_supported(model_chunks, config)
            self.combined = moe_overlap.CombinedSteps(self)
        # DualPipeV's overlapped F&B pairs: offered to the executor only when they are
        # computed in one call: Megatron's combined step, or the model's hook
        # ``overlapped_forward_backward(run_forward, run_backward) -> (out, grad)``, which may
        # run the two thunks concurrently (e.g. one's compute under the other's all-to-all);
        # without either the pair runs one action after the other.
        if self.combined is not None or offers_overlapped_pairs(model_chunks):
            self._overlap_hooks = [_overlap_hook(chunk) for chunk in model_chunks]
            self.overlapped_forward_backward = self._overlapped

    def _overlapped(self, f_action: Action, f_input, b_action: Action, b_grad):
        if self.combined is not None:
            return self.combined.pair(f_action, f_input, b_action, b_grad)
        hook = self._overlap_hooks[self._chunk(f_action.stage)]
        if not callable(hook):
            return self.forward(f_action, f_input), self.backward(b_action, b_grad)
        return hook(lambda: self.forward(f_action, f_input),
                    lambda: self.backward(b_action, b_grad))

    def _chunk(self, stage: int) -> int:
        return self.schedule.chunk_of(stage)

    def iterator_for(self, action: Action):
        """The data iterator ``action``'s forward step reads (dualpipe: positioned at its
        microbatch, ``direction_data``)."""
        iterator = self.data_iterators[self._chunk(action.stage)]
        select_microbatch(iterator, action.microbatch)
        return iterator

    def chunk_of(self, action: Action) -> int:
        """The index of the model chunk that computes ``action``."""
        return self._chunk(action.stage)

    def is_first_microbatch(self, action: Action) -> bool:
        """Megatron's ``is_first_microbatch`` for an F (the first of a validation step)."""
        return check_first_val_step(self.first_val_step, self.forward_only,
                                    action.microbatch == 0)

    def overlapped_pairs(self) -> int | None:
        """F&B pairs run through Megatron's combined step this step (None: no overlap asked)."""
        return None if self.combined is None else self.combined.pairs

    def begin(self, action: Action) -> None:
        self.grad_sync.before(action)

    def forward(self, action: Action, input_tensor):
        if self.combined is not None:
            return self.combined.forward(action, input_tensor)
        chunk, mb = self._chunk(action.stage), action.microbatch
        checkpoint = None
        if self.max_outstanding is not None:
            checkpoint = (self.num_forwards % self.max_outstanding
                          >= self.config.num_microbatches_with_partial_activation_checkpoints)
        self.num_forwards += 1
        output, num_tokens = forward_step(
            self.forward_step_func,
            self.iterator_for(action),
            self.chunks[chunk],
            self.num_microbatches,
            input_tensor,
            self.forward_data_store,
            self.config,
            cp_group_size=self.cp_size,
            collect_non_loss_data=self.collect_non_loss_data,
            checkpoint_activations_microbatch=checkpoint,
            is_first_microbatch=self.is_first_microbatch(action),
            current_microbatch=mb,
            vp_stage=chunk if len(self.chunks) > 1 else None,
            is_last_stage=self.schedule.is_exit(action.stage),
        )
        self.total_num_tokens += num_tokens
        if not self.forward_only:
            self.saved[(action.stage, mb)] = (input_tensor, output)
        return output

    def backward(self, action: Action, output_grad):
        if self.combined is not None:
            return self.combined.backward(action, output_grad)
        input_tensor, output = self.saved.pop((action.stage, action.microbatch))
        if action.kind == BACKWARD_INPUT:
            if self.weight_split is None:
                raise ValueError(
                    f"schedule {self.schedule.name!r} splits the backward into I and W, which "
                    "needs the I/W split of megatron_pp_ext.runtime.wgrad (not enabled here)")
            grad = self.weight_split.backward_input(action, input_tensor, output, output_grad,
                                                    self.config, chunk=self._chunk(action.stage))
        elif self.weight_split is not None:  # a full B inside a split step (DualPipeV)
            grad = self.weight_split.backward_full(action, input_tensor, output, output_grad,
                                                   self.config, chunk=self._chunk(action.stage))
        else:
            grad = backward_step(input_tensor, output, output_grad, self.config)
        self.grad_sync.after(action)
        return grad

    def weight(self, action: Action) -> None:
        assert action.kind == BACKWARD_WEIGHT
        self.weight_split.backward_weight(action, self._chunk(action.stage))
        self.grad_sync.after(action)

    def weight_grad_stats(self) -> dict | None:
        """This step's weight-gradient GEMMs on this rank: how many I queued and W ran, and
        W's time on them (``runtime.wgrad.WeightGradStats``); None without an I/W split."""
        return None if self.weight_split is None else self.weight_split.stats.as_dict()

    def held_tensors(self) -> list:
        """The W queue's tensors (inputs and output gradients of pending weight GEMMs): the
        executor counts their bytes as held activations (runtime/memory.py)."""
        return [] if self.weight_split is None else self.weight_split.held_tensors()

    def deallocate(self, output) -> None:
        deallocate_output_tensor(output, self.config.deallocate_pipeline_outputs)
