"""F and B through Megatron's per-layer schedule plan: the MoE all-to-all of one microbatch
hidden behind another's compute (``--overlap-moe-expert-parallel-comm``).

Megatron-Core 0.19.2 splits each transformer layer of a forward or a backward into nodes
(attention and router, dispatch all-to-all, experts, combine all-to-all:
``models/common/model_chunk_schedule_plan.py``), and
``pipeline_parallel/combined_1f1b.combined_forward_backward_step`` runs one microbatch's
forward and another's backward layer by layer, the all-to-alls on a communication stream under
the other half's compute. With that flag set, :class:`CombinedSteps` runs every F and every B
(or I) of the model chunks through that function (imported, never copied): a schedule's F&B
pair (DualPipeV's) in one call, a lone F or B with the other half empty, as Megatron's own
combined 1F1B runs its first F and its last B. A forward's output carries its plan to the
backward (Megatron's convention), so once a chunk's F took this path its B must too.

* The I/W split: a B half that the schedule makes an I runs under the W queue's capture
  (``runtime.wgrad``), so its linears' weight GEMMs wait for the W as everywhere else.
* The V layout: the combined step asks Megatron's parallel state whether the forward's chunk is
  the last stage (to apply the loss there); in the V layout that is rank 0's second chunk,
  which the parallel state cannot know. While a combined step runs,
  ``schedules.forward_step_calc_loss`` takes the answer from the schedule instead (a wrapper
  entered and left by each call, per thread, like the W split's patch of the linear backward).
"""

from __future__ import annotations

import contextlib
import threading

from megatron.core.pipeline_parallel import schedules
from megatron.core.pipeline_parallel.combined_1f1b import combined_forward_backward_step
from megatron.core.utils import get_attr_wrapped_model

from ..ir import BACKWARD_INPUT, Action

_local = threading.local()  # the running combined step's (is_last_stage, cp size), per thread
_lock = threading.Lock()
_users = 0
_original_calc_loss = None


def requested(config) -> bool:
    """Whether Megatron's config asks for the all-to-all overlap."""
    return bool(getattr(config, "overlap_moe_expert_parallel_comm", False))


def check_supported(model_chunks, config) -> None:
    """``ValueError`` (before the step communicates) where Megatron's per-layer plan cannot
    run, with Megatron's rule."""
    for chunk in model_chunks:
        try:
            get_attr_wrapped_model(chunk, "build_schedule_plan")
        except (AttributeError, RuntimeError):
            raise ValueError(
                f"--overlap-moe-expert-parallel-comm runs each forward and backward through "
                f"Megatron's per-layer schedule plan, which this model chunk "
                f"({type(chunk).__name__}) cannot build (no build_schedule_plan: Megatron's "
                "GPTModel has one); drop the flag for this model") from None
    if config.num_microbatches_with_partial_activation_checkpoints is not None:
        raise ValueError(
            "--overlap-moe-expert-parallel-comm does not take "
            "num_microbatches_with_partial_activation_checkpoints (Megatron's combined step "
            "asserts checkpoint_activations_microbatch is None); drop one of them")


def _calc_loss(*args, **kwargs):
    known = getattr(_local, "last_stage", None)
    if known is not None and kwargs.get("is_last_stage") is None:
        kwargs["is_last_stage"], kwargs["cp_group_size"] = known
    return _original_calc_loss(*args, **kwargs)


@contextlib.contextmanager
def _last_stage_known(is_last_stage: bool, cp_size: int):
    """While entered on this thread, Megatron's ``forward_step_calc_loss`` (which the combined
    step calls without ``is_last_stage``) is told whether the forward's stage is the last."""
    global _users, _original_calc_loss
    with _lock:
        if _users == 0:
            _original_calc_loss = schedules.forward_step_calc_loss
            schedules.forward_step_calc_loss = _calc_loss
        _users += 1
    _local.last_stage = (is_last_stage, cp_size)
    try:
        yield
    finally:
        _local.last_stage = None
        with _lock:
            _users -= 1
            if _users == 0:
                schedules.forward_step_calc_loss = _original_calc_loss


class CombinedSteps:
    """Runs a :class:`~megatron_stage.MegatronStageWork`'s F, B, I and F&B pairs through
    Megatron's ``combined_forward_backward_step``; ``pairs`` counts the pairs of a step."""

    def __init__(self, work):
        self.work = work
        self.pairs = 0  # reset by each step: a work object lives one step

    def forward(self, action: Action, input_tensor):
        output, _ = self._run(action, input_tensor, None, None)
        return output

    def backward(self, action: Action, output_grad):
        _, grad = self._run(None, None, action, output_grad)
        return grad

    def pair(self, f_action: Action, f_input, b_action: Action, b_grad):
        self.pairs += 1
        return self._run(f_action, f_input, b_action, b_grad)

    def _run(self, f_action, f_input, b_action, b_grad):
        work = self.work
        f_chunk = b_chunk = None
        f_kwargs: dict = {}
        if f_action is not None:
            f_chunk = work.chunk_of(f_action)
            f_kwargs = dict(
                f_model_chunk_id=f_chunk if len(work.chunks) > 1 else None,
                is_first_microbatch=work.is_first_microbatch(f_action),
                current_microbatch=f_action.microbatch)
        b_input = b_output = None
        if b_action is not None:
            b_chunk = work.chunk_of(b_action)
            b_input, b_output = work.saved.pop((b_action.stage, b_action.microbatch))
        last = f_action is not None and work.schedule.is_exit(f_action.stage)
        with _last_stage_known(last, work.cp_size), self._capture(b_action, b_chunk):
            output, num_tokens, grad = combined_forward_backward_step(
                work.forward_step_func,
                work.iterator_for(f_action) if f_chunk is not None else None,
                work.chunks[f_chunk] if f_chunk is not None else None,
                work.num_microbatches, f_input, work.forward_data_store,
                work.chunks[b_chunk] if b_chunk is not None else None,
                b_input, b_output, b_grad, work.config,
                collect_non_loss_data=work.collect_non_loss_data, **f_kwargs)
        if f_action is not None:
            work.num_forwards += 1
            work.total_num_tokens += num_tokens
            work.saved[(f_action.stage, f_action.microbatch)] = (f_input, output)
        if b_action is not None:
            work.grad_sync.after(b_action)
        return output, grad

    def _capture(self, b_action, chunk):
        """An I's linears queue their weight GEMMs for its W; a B's compute them now (TE's,
        deferred for a split step, right after it), as MegatronStageWork.backward does."""
        split = self.work.weight_split
        if b_action is None:
            return contextlib.nullcontext()
        if b_action.kind != BACKWARD_INPUT:
            return contextlib.nullcontext() if split is None else split.full_gradient(
                b_action, chunk=chunk)
        if split is None:
            raise ValueError(
                f"schedule {self.work.schedule.name!r} splits the backward into I and W, which "
                "needs the I/W split of megatron_pp_ext.runtime.wgrad (not enabled here)")
        return split.input_gradient(b_action, chunk=chunk)
