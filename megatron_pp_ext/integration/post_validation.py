"""Post-validated optimizer step (Zero Bubble, Qi et al. 2024, section 4) for Megatron's
optimizers: each rank steps as soon as its own gradients are ready, assuming the global checks
pass, and puts the step right once the global result arrives.

Megatron's synchronous ``optimizer.step()`` makes every rank of the grad-stats group (the
model-parallel group, or the whole world under the distributed optimizer) wait twice before it
may update a single weight: the fp16 loss scaler's found-inf all-reduce (MAX) and, with
``--clip-grad``, the global grad-norm all-reduce (SUM). In a pipeline the ranks finish their
backward passes at different times, so the ranks that finish early wait for the last one, and
only then run their optimizer. :class:`PostValidatedOptimizer` reorders that:

1. *local*: copy the gradients into the main gradients, unscale them and check them for inf/nan
   (``torch._amp_foreach_non_finite_check_and_unscale_``, as Megatron does), compute this rank's
   part of the squared 2-norm exactly as ``clip_grads.get_grad_norm_fp32`` does, and start both
   all-reduces *asynchronously* (same ops, same groups, same order as Megatron's);
2. *optimistic*: snapshot what a step changes, then run the optimizer's own
   ``step_with_ready_grads()`` on the unclipped gradients, as if no inf was found and the norm
   were below the clip threshold;
3. *validate* (:meth:`PostValidatedOptimizer.settle`): wait for the two reductions; update the
   loss scaler with the global flag; then

   * inf/nan anywhere: restore the snapshot (the step is skipped, the scaler backs off);
   * global norm above the clip (Megatron's own test: ``clip / (norm + 1e-6) < 1``): restore
     the snapshot, clip the main gradients with the global norm
     (``clip_grad_by_total_norm_fp32``), run ``step_with_ready_grads()`` again;
   * otherwise keep the optimistic step: it is the step Megatron would have made.

Rollback is a restore from copies, never an algebraic undo: undoing Adam
(``p += lr * m_hat / (sqrt(v_hat) + eps)``, then ``m = (m - (1 - b1) g) / b1`` ...) is not
exact in floating point, and the acceptance test is bit-identity with Megatron's step. What is
copied, per rank, before each optimistic step (see :meth:`snapshot_bytes`):

* the main parameters the inner torch optimizer updates (fp32; the local shard under the
  distributed optimizer),
* the inner optimizer's state (Adam: ``exp_avg``, ``exp_avg_sq``, ``step``; fp32, sharded under
  the distributed optimizer), and which parameters had no state yet (the first step),
* the model parameters when they are not the main parameters (fp16/bf16 copies): all of
  this rank's, also under the distributed optimizer, whose optimistic step all-gathers every
  shard into the whole parameter buffer over the data-parallel group.

For mixed precision Adam that is 12 bytes per main parameter plus 2 per model parameter: about
as much again as the optimizer state itself. The grad scaler is not copied: it is updated only
once the global flag is known. Nothing is copied when there is nothing to validate (no grad
scaler, no clipping, no grad-norm skip threshold).

Where the result is needed at once (Megatron-LM's ``train_step`` reads the success flag and the
grad norm right after ``optimizer.step()``), :meth:`~PostValidatedOptimizer.step` settles
before it returns: the optimistic step then runs while the reductions wait for the last rank,
so only that rank's optimizer is on the critical path. A loop of its own can go further:
:meth:`~PostValidatedOptimizer.begin_step` returns at once, and the step settles before
anything reads the parameters or the gradients again (``zero_grad()``, the next step,
``state_dict()``, the loss scale, or :meth:`~PostValidatedOptimizer.settle` itself): the ranks
then start their next step while the reductions travel, and a rank waits only where its next
forward needs the settled weights.

Supported: Megatron's ``FP32Optimizer``, ``Float16OptimizerWithFloat16Params`` (fp16 with the
dynamic or constant scaler, bf16) and ``DistributedOptimizer``, bare or in a ``ChainedOptimizer``
of one (what ``get_megatron_optimizer`` returns for a dense model), with a torch optimizer whose
state is a per-parameter dict of tensors (Adam, AdamW, SGD). Refused with the reason:
several chained optimizers (MoE), separate grad-norm groups, precision-aware optimizers
(decoupled gradients), Megatron-FSDP, a non-2 norm type.
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from .. import device as device_helper
from .. import megatron_compat


HISTORY = 1024  # StepOutcome's kept per optimizer


@dataclass
class StepOutcome:
    """What the step did once validated, in Megatron's terms, and how it got there."""

    success: bool  # False: the step was skipped (inf/nan, or the grad-norm skip threshold)
    grad_norm: Any  # as Megatron's step returns it (float, 0.0 or None)
    num_zeros_in_grad: Any
    rolled_back: bool  # the optimistic step was undone
    redone: bool  # ... and redone with clipped gradients
    found_inf: bool
    clipped: bool

    def as_megatron(self):
        return self.success, self.grad_norm, self.num_zeros_in_grad


class _Snapshot:
    """Copies of everything one optimistic ``step_with_ready_grads()`` changes on this rank."""

    def __init__(self, leaf, model_params: list[torch.Tensor], keep_grads: bool = False):
        inner = leaf.optimizer
        seen = set()
        # run ahead: the next step's backward may write into the main gradients (views of
        # DDP's buffer for fp32 gradients) before this step is validated and perhaps redone
        self.grads = [(p, p.grad.detach().clone()) for g in inner.param_groups
                      for p in g["params"] if p.grad is not None] if keep_grads else []
        self.tensors: list[tuple[torch.Tensor, torch.Tensor]] = []
        for param in [p for g in inner.param_groups for p in g["params"]] + model_params:
            key = (param.data_ptr(), param.numel(), param.dtype)
            if key in seen:
                continue
            seen.add(key)
            self.tensors.append((param, param.detach().clone()))
        self.states: list[tuple[torch.Tensor, Optional[dict]]] = []
        for group in inner.param_groups:
            for param in group["params"]:
                state = inner.state.get(param)
                self.states.append((param, None if state is None else {
                    k: (v.detach().clone() if torch.is_tensor(v) else v)
                    for k, v in state.items()}))
        # optimizers that count steps per group (apex's FusedAdam) keep them in the group
        self.group_steps = [group.get("step") for group in inner.param_groups]

    @property
    def nbytes(self) -> int:
        total = sum(copy.numel() * copy.element_size()
                    for _, copy in self.tensors + self.grads)
        for _, state in self.states:
            for value in (state or {}).values():
                if torch.is_tensor(value):
                    total += value.numel() * value.element_size()
        return total

    @torch.no_grad()
    def restore(self, leaf) -> None:
        inner = leaf.optimizer
        for param, copy in self.tensors:
            param.data.copy_(copy)
        for param, saved in self.states:
            if saved is None:
                inner.state.pop(param, None)
                continue
            state = inner.state[param]
            for key in [k for k in state if k not in saved]:
                del state[key]
            for key, value in saved.items():
                current = state.get(key)
                if torch.is_tensor(value) and torch.is_tensor(current) and \
                        current.shape == value.shape and current.dtype == value.dtype:
                    current.copy_(value)
                else:
                    state[key] = value.clone() if torch.is_tensor(value) else value
        for group, step in zip(inner.param_groups, self.group_steps):
            if step is None:
                group.pop("step", None)
            else:
                group["step"] = step
        for param, grad in self.grads:  # the step's own gradients, for its redo
            param.grad = grad


def _leaf_of(optimizer):
    """(the one Megatron optimizer that owns the parameters, whether it sits in a chain)."""
    from megatron.core.optimizer.optimizer import ChainedOptimizer

    if isinstance(optimizer, ChainedOptimizer):
        if len(optimizer.chained_optimizers) != 1:
            raise ValueError(
                f"post-validation supports one optimizer per rank; this ChainedOptimizer holds "
                f"{len(optimizer.chained_optimizers)} (an MoE model's expert and dense "
                "optimizers): turn post-validation off for this model")
        return optimizer.chained_optimizers[0], True
    return optimizer, False


def _check_supported(leaf) -> None:
    from megatron.core.optimizer.optimizer import FP32Optimizer, MixedPrecisionOptimizer

    if not isinstance(leaf, (FP32Optimizer, MixedPrecisionOptimizer)):
        raise ValueError(f"post-validation wraps Megatron's FP32Optimizer, Float16Optimizer or "
                         f"DistributedOptimizer, not {type(leaf).__name__}")
    config = leaf.config
    if getattr(config, "use_precision_aware_optimizer", False):
        raise ValueError("post-validation does not support --use-precision-aware-optimizer "
                         "(its optimizer keeps state outside torch's per-parameter dict)")
    ddp_config = getattr(leaf, "ddp_config", None)
    if ddp_config is not None and getattr(ddp_config, "use_megatron_fsdp", False):
        raise ValueError("post-validation does not support Megatron-FSDP")
    if any(megatron_compat.has_separate_grad_norm_group(p) for p in leaf.get_parameters()):
        raise ValueError("post-validation does not support separate grad-norm groups")


def _model_params(leaf) -> list[torch.Tensor]:
    """The model parameters a step writes besides the main parameters: the fp16/bf16 copies,
    and under the distributed optimizer every parameter of its model chunks (its step
    all-gathers the updated shards into the whole parameter buffer, not only this rank's)."""
    params = []
    for name in ("float16_groups", "model_float16_groups", "model_fp32_groups"):
        for group in getattr(leaf, name, None) or []:
            params.extend(group)
    if hasattr(leaf, "shard_fp32_from_float16_groups"):  # DistributedOptimizer
        for chunk in getattr(leaf, "model_chunks", None) or []:
            params.extend(p for p in chunk.parameters() if p.requires_grad)
    return params


def _device(leaf) -> torch.device:
    """Where this rank's reductions live: its parameters' device (a rank without parameters:
    the current CUDA device, else the CPU)."""
    for param in leaf.get_parameters():
        return param.device

    if device_helper.cuda_available():
        return device_helper.current_cuda_device()
    return torch.device("cpu")


def _local_norm_squared(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """This rank's part of ``get_grad_norm_fp32`` (norm type 2): the same kernels in the same
    order, before its all-reduce."""
    from megatron.core.optimizer import clip_grads

    if not grads:
        return torch.zeros(1, dtype=torch.float, device=device)
    overflow = torch.zeros(1, dtype=torch.int, device=device)
    norm, _ = clip_grads.multi_tensor_applier(clip_grads.l2_norm_impl, overflow, [grads], False)
    return norm ** 2.0


def _global_norm(total: torch.Tensor):
    from megatron.core.optimizer import clip_grads

    if clip_grads.multi_tensor_scale_tensor_impl is not None:
        return total.pow(1.0 / 2.0)
    return total.item() ** (1.0 / 2.0)


def _clip_triggers(clip_grad: float, grad_norm) -> bool:
    """Megatron's own test in ``clip_grad_by_total_norm_fp32``: the gradients are scaled
    when ``clip / (norm + 1e-6) < 1`` (a tensor coefficient is clamped to 1 and always
    applied; scaling by exactly 1 changes no bit, so it is the same test)."""
    coeff = clip_grad / (grad_norm + 1.0e-6)
    if torch.is_tensor(coeff):
        return bool((coeff < 1.0).item())
    return coeff < 1.0


class PostValidatedOptimizer:
    """Wraps a Megatron optimizer; ``step()`` is post-validated, everything else is the
    wrapped optimizer's (attributes are forwarded; what reads parameters, gradients or the loss
    scale settles a pending step first). See the module's docstring."""

    _SETTLING = ("zero_grad", "state_dict", "load_state_dict", "sharded_state_dict",
                 "get_loss_scale", "scale_loss", "reload_model_params", "save_parameter_state",
                 "load_parameter_state", "offload_to_cpu", "restore_from_cpu", "count_zeros",
                 "get_grad_norm", "clip_grad_norm", "prepare_grads", "step_with_ready_grads")

    def __init__(self, optimizer):
        leaf, chained = _leaf_of(optimizer)
        _check_supported(leaf)
        object.__setattr__(self, "_wrapped", optimizer)
        object.__setattr__(self, "_leaf", leaf)
        object.__setattr__(self, "_chained", chained)
        object.__setattr__(self, "_pending", None)
        # the outcomes of the last steps (bounded: a run has millions of steps)
        object.__setattr__(self, "history", collections.deque(maxlen=HISTORY))
        object.__setattr__(self, "last_snapshot_bytes", 0)
        object.__setattr__(self, "run_ahead", False)  # set by RunAhead

    # ---- forwarding
    @property
    def wrapped(self):
        return self._wrapped

    def __getattr__(self, name):
        value = getattr(self._wrapped, name)
        if name in PostValidatedOptimizer._SETTLING and callable(value):
            # decided per call: Megatron binds scale_loss once (config.grad_scale_func),
            # before RunAhead switches run_ahead on
            def settled(*args, **kwargs):
                if not (self.run_ahead and name in ("get_loss_scale", "scale_loss")):
                    self.settle()  # run ahead, the next step scales with the current scale
                return value(*args, **kwargs)
            return settled
        return value

    def __setattr__(self, name, value):
        if name in type(self).__dict__ or name in self.__dict__:
            object.__setattr__(self, name, value)
        else:
            setattr(self._wrapped, name, value)

    @property
    def param_groups(self):
        return self._wrapped.param_groups

    @param_groups.setter
    def param_groups(self, value):
        self._wrapped.param_groups = value

    # ---- the step
    @property
    def pending(self) -> bool:
        return self._pending is not None

    def step(self):
        """Megatron's ``step()`` contract: (success, grad_norm, num_zeros_in_grad), bit for
        bit; the optimistic step runs while the reductions are in flight."""
        self.begin_step()
        return self.settle().as_megatron()

    @torch.no_grad()
    def begin_step(self) -> None:
        """Steps 1 and 2: local checks, both reductions started, the optimistic step. Returns
        without waiting for any other rank; :meth:`settle` finishes the step."""
        self.settle()  # a previous step first
        leaf, config = self._leaf, self._leaf.config
        stub = getattr(leaf, "is_stub_optimizer", False)
        group = leaf.get_grad_stats_parallel_group()
        leaf.grad_norms_by_group = {}
        if self._chained:
            self._wrapped.grad_norms_by_group = {}
        scaler = getattr(leaf, "grad_scaler", None)
        # 1. local: main grads, unscale + inf check, local squared norm; async reductions
        if not megatron_compat.copies_model_grads(leaf):
            leaf.prepare_grads()  # FP32Optimizer: local only (param.grad = param.main_grad)
        elif not stub:
            megatron_compat.copy_model_grads_to_main_grads(leaf)
        inf_work = None
        if scaler is not None:
            leaf.found_inf.fill_(0.0)
            if not stub:
                torch._amp_foreach_non_finite_check_and_unscale_(
                    megatron_compat.main_grad_data_for_unscaling(leaf), leaf.found_inf,
                    scaler.inv_scale)
            inf_work = dist.all_reduce(leaf.found_inf, op=dist.ReduceOp.MAX, group=group,
                                       async_op=True)
        need_norm = self._chained or config.clip_grad > 0.0
        norm_total, norm_work = None, None
        if need_norm:
            grads = megatron_compat.grads_for_grad_norm(leaf) if leaf.get_parameters() else []
            norm_total = _local_norm_squared(grads, _device(leaf))
            norm_work = dist.all_reduce(norm_total, op=dist.ReduceOp.SUM, group=group,
                                        async_op=True)
        skip_threshold = getattr(config, "grad_norm_skip_threshold", math.inf)
        validate = (scaler is not None or config.clip_grad > 0.0
                    or (self._chained and math.isfinite(skip_threshold)))
        # 2. optimistic: snapshot, then the optimizer's own step on the unclipped gradients
        snapshot = None
        if validate and not stub:
            snapshot = _Snapshot(leaf, _model_params(leaf), keep_grads=self.run_ahead)
            object.__setattr__(self, "last_snapshot_bytes", snapshot.nbytes)
        if not stub:
            self._step_with_ready_grads()
        object.__setattr__(self, "_pending", (inf_work, norm_work, norm_total, snapshot))

    def _loss_scale(self):
        leaf = self._leaf
        scaler = getattr(leaf, "grad_scaler", None)
        return None if scaler is None else scaler.scale.detach().clone()

    def _step_with_ready_grads(self) -> bool:
        return self._wrapped.step_with_ready_grads()

    @torch.no_grad()
    def settle(self) -> Optional[StepOutcome]:
        """Step 3: wait for the global found-inf and grad norm, keep the optimistic step or
        roll it back (and redo it clipped). The outcome (None when no step was pending)."""
        if self._pending is None:
            return None
        inf_work, norm_work, norm_total, snapshot = self._pending
        object.__setattr__(self, "_pending", None)
        leaf, config = self._leaf, self._leaf.config
        stub = getattr(leaf, "is_stub_optimizer", False)
        scaler = getattr(leaf, "grad_scaler", None)
        found_inf = False
        if inf_work is not None:
            inf_work.wait()
            found_inf = leaf.found_inf.item() > 0
            scaler.update(found_inf)
        if norm_work is not None:
            norm_work.wait()  # always: the reduction was posted on every rank
        if found_inf:
            if snapshot is not None:
                snapshot.restore(leaf)
            outcome = StepOutcome(False, None, None, snapshot is not None, False, True, False)
            self.history.append(outcome)
            return outcome
        grad_norm = _global_norm(norm_total) if norm_total is not None else None
        clip = config.clip_grad > 0.0 and grad_norm is not None and not stub and \
            bool(leaf.get_parameters()) and _clip_triggers(config.clip_grad, grad_norm)
        skip_threshold = getattr(config, "grad_norm_skip_threshold", math.inf)
        skip = (self._chained and bool(leaf.get_parameters()) and math.isfinite(skip_threshold)
                and grad_norm > skip_threshold)
        rolled_back = (clip or skip) and snapshot is not None
        if rolled_back:
            snapshot.restore(leaf)
        if clip:
            from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

            clip_grad_by_total_norm_fp32(leaf.get_parameters(), config.clip_grad, grad_norm,
                                         use_decoupled_grad=False)
        if config.log_num_zeros_in_grad:
            zeros = self._wrapped.count_zeros()
        else:
            zeros = None if (self._chained or not hasattr(leaf, "grad_scaler")) else 0
        if clip and not skip:
            self._step_with_ready_grads()
        if self._chained:
            reported = grad_norm
        elif config.clip_grad > 0.0:
            reported = grad_norm
        else:
            reported = None if not hasattr(leaf, "grad_scaler") else 0.0
        outcome = StepOutcome(not skip, reported, zeros, rolled_back, clip and not skip, False,
                              clip)
        self.history.append(outcome)
        return outcome

    def snapshot_bytes(self) -> int:
        """Bytes the last optimistic step copied on this rank (0 when nothing needed it)."""
        return self.last_snapshot_bytes

    def __repr__(self) -> str:
        return f"PostValidatedOptimizer({type(self._wrapped).__name__})"


def post_validated(optimizer):
    """``optimizer`` wrapped in a :class:`PostValidatedOptimizer` (once: a wrapped one is
    returned as it is)."""
    if isinstance(optimizer, PostValidatedOptimizer):
        return optimizer
    return PostValidatedOptimizer(optimizer)
