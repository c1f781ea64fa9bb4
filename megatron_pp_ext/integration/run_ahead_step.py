"""Megatron-LM's ``train_step``, run ahead: each pipeline rank starts step k+1 as soon as its
own part of step k is done, without waiting for the other ranks' grad norm and found-inf.

``install(..., run_ahead=True)`` (Megatron-LM: ``--pp-run-ahead``) replaces
``megatron.training.training.train_step`` with :class:`RunAheadTrainStep`. Megatron's own
``train_step`` cannot run ahead: right after ``optimizer.step()`` it all-reduces the success
flag and the grad norm over the model-parallel group (pipeline ranks included) and steps the
learning-rate scheduler on the result, so every rank waits there for the last one.

Each call does, with :class:`RunAhead` (below, usable in a loop of your own):

1. step k's forward-backward on the optimistic weights of step k-1 (DDP's grad buffers zeroed
   without settling; the microbatches recorded);
2. step k-1 settles (its reductions arrived long ago): kept, or rolled back and redone
   clipped, or skipped; if so, or if its loss-scale update changed the scale step k was
   scaled with, step k runs again on the settled weights with the same microbatches;
3. the learning-rate scheduler steps for step k-1 when it succeeded (as Megatron's
   ``train_step`` does right after the step), so step k's optimizer uses Megatron's rate;
4. step k's post-validated optimizer step begins (returns without waiting);
5. when the loop reads the weights or the optimizer state after this iteration (evaluation,
   a checkpoint, the last iteration, ``--exit-interval``), step k settles here too.

Parameters, optimizer state, losses and grad norms are those of Megatron's synchronous loop,
bit for bit (``tests/test_post_validation.py``). What the loop *logs* lags one iteration:
iteration k reports step k-1's loss, skipped flag and grad norm (step k's are not known yet);
:attr:`RunAheadTrainStep.reports` holds the last 1000 steps', and the last step's is printed
once it settles. Flags that read the weights or synchronise every iteration without this step's
knowledge are refused before the first step (:data:`REFUSED_FLAGS`).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Any, Optional

import torch

from .. import megatron_compat
from .post_validation import StepOutcome, post_validated

REPORTS_KEPT = 1000

# (argument, what makes it set, why run-ahead cannot have it)
REFUSED_FLAGS = (
    ("log_params_norm", "--log-params-norm",
     "the loop reads every rank's weights after each step, before it settles"),
    ("overlap_param_gather", "--overlap-param-gather",
     "the parameter all-gather is started by the optimizer step and finished by the next "
     "forward's hooks; run ahead, that step may still be rolled back"),
    ("exit_duration_in_mins", "--exit-duration-in-mins",
     "the loop decides to save and exit on the clock, after the step, with no notice"),
    ("exit_signal_handler", "--exit-signal-handler",
     "the loop decides to save and exit on a signal, after the step, with no notice"),
    ("non_persistent_save_interval", "--non-persistent-save-interval",
     "a checkpoint this train_step does not settle before"),
    ("check_weight_hash_across_dp_replicas_interval",
     "--check-weight-hash-across-dp-replicas-interval",
     "the loop hashes the weights after the step, before it settles"),
    ("save_params_interval", "--save-params-interval", "Megatron's own train_step feature"),
    ("save_activations_interval", "--save-activations-interval",
     "Megatron's own train_step feature"),
    ("save_tokens_per_expert_interval", "--save-tokens-per-expert-interval",
     "Megatron's own train_step feature"),
    ("save_wgrads_interval", "--save-wgrads-interval", "Megatron's own train_step feature"),
    ("save_dgrads_interval", "--save-dgrads-interval", "Megatron's own train_step feature"),
    ("vision_pretraining", "--vision-pretraining", "Megatron's own train_step feature"),
    ("qk_clip", "--qk-clip", "reads the attention logits of the step, then clips weights"),
    ("log_max_attention_logit", "--log-max-attention-logit", "Megatron's own train_step "
     "feature"),
    ("perform_rl_step", "--perform-rl-step", "Megatron's RL loop"),
)


@dataclass(frozen=True)
class StepReport:
    """One settled step as Megatron's ``train_step`` returns it."""

    iteration: int  # 0-based, as train_step's ``iteration``
    loss: dict  # the reduced losses (empty off the last pipeline rank)
    skipped: int
    grad_norm: Any
    num_zeros_in_grad: Any
    replayed: bool  # this step's forward-backward ran twice (the previous one was undone)


def refused_flags(args) -> list[str]:
    """The flags set in ``args`` that run-ahead refuses, each with its reason."""
    return [f"{flag} ({why})" for name, flag, why in REFUSED_FLAGS if getattr(args, name, None)]


def synchronising_flags(args) -> list[str]:
    """Settings with which the ranks still wait for each other every step (correct, but the
    pipeline cannot run ahead past them), each with the fix."""
    found = []
    if getattr(args, "rerun_mode", "disabled") not in ("disabled", None):
        found.append(f"--rerun-mode {args.rerun_mode} all-reduces a flag over every rank after "
                     "each forward-backward (add --rerun-mode disabled)")
    return found


def _is_last(args, iteration: int) -> bool:
    return args.train_iters is not None and iteration + 1 >= args.train_iters


def _settles_after(args, iteration: int) -> bool:
    """Whether the loop reads the weights or the optimizer state after train_step(iteration)
    returns: evaluation, a checkpoint, an exit, the end of training."""
    done = iteration + 1
    return bool(
        _is_last(args, iteration)
        or (args.eval_interval and getattr(args, "do_valid", False)
            and done % args.eval_interval == 0)
        or (args.save and args.save_interval and done % args.save_interval == 0)
        or (getattr(args, "exit_interval", None) and done % args.exit_interval == 0))


def _as_train_step_reports(stat):
    """A grad norm or zeros count as Megatron-LM's train_step returns it: a float32 (it
    all-reduces the MAX over the model-parallel group in float32). The post-validated value is
    already global, so no reduction is needed, only the rounding; a rank without parameters
    keeps None where Megatron's reduction would give it the others' value."""
    return None if stat is None else torch.tensor([stat], dtype=torch.float32).item()


def _reduced_losses(losses_reduced, dp_cp_group) -> dict:
    """The step's losses averaged as Megatron-LM's train_step averages them: per key, either
    (sum, tokens) pairs summed over microbatches and the data-parallel group, or one value
    per microbatch averaged."""
    reduced = {}
    for key in losses_reduced[0].keys():
        values = [x[key].view(-1) for x in losses_reduced]
        if values[0].numel() == 2:
            total = torch.vstack(values).sum(dim=0)
            torch.distributed.all_reduce(total, group=dp_cp_group)
            reduced[key] = total[0] / total[1]
        elif values[0].numel() == 1:
            reduced[key] = torch.cat(values).mean()
        else:
            raise ValueError(f"loss {key!r} has {values[0].numel()} values per microbatch: "
                             "train_step averages 1 (the loss) or 2 (sum, tokens)")
    return reduced


class LocalMaxStat:
    """Stands in for ``reduce_max_stat_across_model_parallel_group`` in
    ``megatron.training.training`` while run-ahead is on. Megatron-LM's ``training_log``
    all-reduces the learning rate over the model-parallel group every iteration (blocking: the
    first pipeline rank waits there for the last one to finish the step), only because a rank
    without trainable parameters has none. Once :class:`RunAheadTrainStep` has checked, with
    one reduction at its first step, that every rank of the group has trainable parameters
    (so every rank steps the same scheduler to the same rate), the MAX of equal values is each
    rank's own value: this returns it rounded as the reduction would, without waiting."""

    def __init__(self, original):
        self.original = original
        self.local = False  # set by RunAheadTrainStep's first step

    def __call__(self, stat, group=None):
        if self.local and stat is not None:
            return _as_train_step_reports(stat)
        return megatron_compat.call_max_stat(self.original, stat, group)


class RunAheadTrainStep:
    """Drop-in for ``megatron.training.training.train_step`` (same arguments, same eight
    return values) that runs ahead; see the module's docstring. ``max_stat``: the
    :class:`LocalMaxStat` the installation put in ``training_log``'s way, if any."""

    def __init__(self, max_stat: Optional[LocalMaxStat] = None):
        self.max_stat = max_stat
        self.run: Optional[RunAhead] = None
        # the settled steps, in order (the last REPORTS_KEPT: a run has millions of steps)
        self.reports: collections.deque[StepReport] = collections.deque(maxlen=REPORTS_KEPT)
        self._unreported = 0  # reports not yet returned to the loop
        # (iteration, loss, replayed, samples): the step whose optimizer step is in flight;
        # samples is its scheduler increment, kept with it (batch-size rampup changes it)
        self._pending: Optional[tuple[int, dict, bool, int]] = None

    def __call__(self, forward_step_func, data_iterator, model, optimizer, opt_param_scheduler,
                 config, forward_backward_func, iteration=None, pg_collection=None,
                 p2p_communicator=None):
        from megatron.core.num_microbatches_calculator import get_num_microbatches
        from megatron.core.pipeline_parallel.utils import is_pp_last_stage
        from megatron.core.process_groups_config import ProcessGroupCollection
        from megatron.core.rerun_state_machine import get_rerun_state_machine
        from megatron.core.utils import get_attr_wrapped_model
        from megatron.training import get_args

        args = get_args()
        if self.run is None:
            refused = refused_flags(args)
            if refused:
                raise ValueError("--pp-run-ahead (install(run_ahead=True)) cannot run with "
                                 + "; ".join(refused) + ": drop those flags or --pp-run-ahead")
            self.run = RunAhead(optimizer, model)
            self._check_every_rank_has_parameters(model)
            for line in synchronising_flags(args):
                from megatron.training.utils import print_rank_0

                print_rank_0(f"megatron-pp-ext run-ahead: the ranks still wait for each other "
                             f"every step: {line}")
        samples = (get_num_microbatches() * args.micro_batch_size * args.data_parallel_size
                   * getattr(args, "gtp_weight_remat_size", 1))

        rerun_state_machine = get_rerun_state_machine()
        losses, replayed = None, False
        # once, unless --rerun-mode asks for a rerun (the previous step settles in the first)
        while rerun_state_machine.should_run_forward_backward(data_iterator):
            losses, previous, replayed = self.run.forward_backward(
                forward_backward_func, data_iterator,
                forward_step_func=forward_step_func, num_microbatches=get_num_microbatches(),
                seq_length=args.seq_length, micro_batch_size=args.micro_batch_size,
                decoder_seq_length=args.decoder_seq_length, forward_only=False,
                adjust_tensor_shapes_fn=None, force_all_reduce=False,
                p2p_communicator=p2p_communicator, pg_collection=pg_collection)
            if previous is not None:
                self._settled(previous, opt_param_scheduler, args)
        should_checkpoint, should_exit, exit_code = (
            rerun_state_machine.should_checkpoint_and_exit())

        groups = (get_attr_wrapped_model(model[0], "pg_collection")
                  or ProcessGroupCollection.use_mpu_process_groups())
        dp_cp_group = getattr(groups, "dp_cp_gtp_remat", None) or groups.dp_cp
        loss = (_reduced_losses(losses, dp_cp_group)
                if is_pp_last_stage(groups.pp) and losses else {})
        self._pending = (iteration, loss, replayed, samples)
        if should_exit:  # Megatron's train_step returns before its optimizer step here too
            return {}, True, should_checkpoint, should_exit, exit_code, None, None, 0

        self.run.optimizer_step()
        if _settles_after(args, iteration):
            self._settled(self.run.finish(), opt_param_scheduler, args)
        return self._report(should_checkpoint, should_exit, exit_code)

    def _check_every_rank_has_parameters(self, model) -> None:
        """One MIN reduction over the model-parallel group (at the first step): whether the
        learning-rate reduction of ``training_log`` can be local (:class:`LocalMaxStat`)."""
        if self.max_stat is None:
            return
        from megatron.core import parallel_state

        has = any(p.requires_grad for chunk in model for p in chunk.parameters())
        flag = torch.tensor([1 if has else 0], dtype=torch.int32)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN,
                                     group=parallel_state.get_model_parallel_group())
        self.max_stat.local = bool(flag.item())
        if not self.max_stat.local:
            from megatron.training.utils import print_rank_0

            print_rank_0("megatron-pp-ext run-ahead: a model-parallel rank has no trainable "
                         "parameters, so training_log's learning-rate all-reduce stays: the "
                         "ranks still wait for each other every step")

    def _settled(self, outcome, opt_param_scheduler, args) -> None:
        """The pending step's outcome is known: step the scheduler as Megatron would, and
        keep its report."""
        iteration, loss, replayed, samples = self._pending
        self._pending = None
        if outcome.success:
            opt_param_scheduler.step(increment=samples)
        self.reports.append(StepReport(
            iteration, loss, 0 if outcome.success else 1,
            _as_train_step_reports(outcome.grad_norm),
            _as_train_step_reports(outcome.num_zeros_in_grad), replayed))
        self._unreported += 1
        if _is_last(args, iteration):  # the loop ends before it would log this one
            from megatron.training.utils import print_rank_last

            report = self.reports[-1]
            print_rank_last(f"megatron-pp-ext run-ahead: step {iteration + 1} settled | "
                            f"loss {({k: float(v) for k, v in report.loss.items()})} | "
                            f"grad norm {report.grad_norm} | skipped {report.skipped}")

    def _report(self, should_checkpoint, should_exit, exit_code):
        """What the loop logs for this iteration: the oldest settled step not yet returned
        (the previous one; nothing on the first iteration). One per call, so the lag stays one
        iteration even after a step settled at once (before an evaluation or a checkpoint)."""
        if self._unreported == 0:
            return {}, 0, should_checkpoint, should_exit, exit_code, None, None, 0
        report = self.reports[len(self.reports) - self._unreported]
        self._unreported -= 1
        return (report.loss, report.skipped, should_checkpoint, should_exit, exit_code,
                report.grad_norm, report.num_zeros_in_grad, 0)


# --------------------------------------------------------------------------------------------
# Running ahead: the next step on the optimistic weights, replayed when validation fails
# --------------------------------------------------------------------------------------------


class _Recording:
    """An iterator that keeps what it hands out, so the step can be replayed."""

    def __init__(self, iterator):
        self.iterator, self.items = iterator, []

    def __iter__(self):
        return self

    def __next__(self):
        item = next(self.iterator)
        self.items.append(item)
        return item


def _record(data_iterator):
    if isinstance(data_iterator, list):
        return [_record(it) for it in data_iterator]
    return None if data_iterator is None else _Recording(data_iterator)


def _replay(recorded):
    if isinstance(recorded, list):
        return [_replay(r) for r in recorded]
    return None if recorded is None else iter(list(recorded.items))


class RunAhead:
    """A training loop whose ranks start step k+1 before step k is validated, still
    bit-identical to Megatron's synchronous loop.

    Each step: :meth:`forward_backward` runs the step on the optimistic weights of the previous
    step (every rank starts as soon as its own previous step is done: nothing waits for the
    other ranks' gradients), *then* settles the previous step (its reductions have long
    arrived). When the previous step was rolled back (inf, clipped, skipped) or its loss-scale
    update changed the scale this step's loss was scaled with, the step's gradients are
    discarded and it runs again on the settled weights with the same microbatches (recorded
    from ``data_iterator``): a *replay*, one more forward-backward. :meth:`optimizer_step` then
    starts this step's post-validated optimizer step. Memory: the post-validated snapshot plus
    a copy of the main gradients (4 bytes per main parameter), since this step's backward
    writes into them before the previous step may need them for its clipped redo.

    ::

        run = RunAhead(optimizer, model_chunks)
        for batch_iterator in data:
            output, previous, replayed = run.forward_backward(
                forward_backward_func, batch_iterator, num_microbatches=m, seq_length=s,
                micro_batch_size=b, forward_step_func=forward_step)
            run.optimizer_step()
        last = run.finish()

    Use it in a loop of your own: Megatron-LM's ``train_step`` reads each step's result
    right after ``optimizer.step()`` and cannot run ahead. It calls DDP's
    ``zero_grad_buffer()`` itself; do not call ``optimizer.zero_grad()`` in between (it
    settles)."""

    def __init__(self, optimizer, model):
        self.optimizer = post_validated(optimizer)
        object.__setattr__(self.optimizer, "run_ahead", True)
        self.model = list(model) if isinstance(model, (list, tuple)) else [model]
        self.replays = 0

    def _zero_grad_buffers(self) -> None:
        """What ``optimizer.zero_grad()`` and DDP's ``zero_grad_buffer()`` do for the model
        before a step, without settling: DDP's buffers zeroed, ``param.grad`` dropped (the
        FP32 optimizer points it at the buffer; autograd would accumulate into it). The main
        gradients a pending step may still need are in its snapshot."""
        for chunk in self.model:
            chunk.zero_grad_buffer()
            for param in chunk.parameters():
                param.grad = None

    def forward_backward(self, forward_backward_func, data_iterator, **kwargs):
        """This step's forward-backward (``forward_backward_func(data_iterator=...,
        model=..., **kwargs)``), run ahead; returns (its output, the previous step's
        :class:`StepOutcome` or None, whether the step was replayed)."""
        optimizer = self.optimizer
        scale_used = optimizer._loss_scale()
        model = self.model if len(self.model) > 1 else self.model[0]
        self._zero_grad_buffers()
        recorded = _record(data_iterator)
        output = forward_backward_func(data_iterator=recorded, model=model, **kwargs)
        outcome = optimizer.settle()
        scale_now = optimizer._loss_scale()
        scale_changed = scale_used is not None and not torch.equal(scale_used, scale_now)
        replayed = outcome is not None and (outcome.rolled_back or scale_changed)
        if replayed:
            self.replays += 1
            self._zero_grad_buffers()
            output = forward_backward_func(data_iterator=_replay(recorded), model=model,
                                           **kwargs)
        return output, outcome, replayed

    def optimizer_step(self) -> None:
        """This step's optimizer step, post-validated (returns without waiting)."""
        self.optimizer.begin_step()

    def finish(self) -> Optional[StepOutcome]:
        """Settle the last step (at the end of training, before saving)."""
        return self.optimizer.settle()
