"""``install()`` / ``uninstall()``: make Megatron-Core run our schedules.

Megatron picks its schedule in ``schedules.get_forward_backward_func`` by looking up
``forward_backward_pipelining_without_interleaving`` / ``..._with_interleaving`` among that
module's globals, and ``megatron.training.training`` binds ``get_forward_backward_func`` at
import time. So we replace the two pipelined schedule functions wherever they are bound
(every loaded ``megatron`` module) with the installation's ``ScheduleFunction``: every caller
of ``get_forward_backward_func()`` then gets ours whenever pp > 1, and Megatron's own
``forward_backward_no_pipelining`` at pp = 1.

Everything one installation changes or remembers lives on the ``Installation`` that
``install()`` returns: the function Megatron now calls (with its run state), and the
attributes it replaced, which ``uninstall()`` puts back. The only process-wide patch of the
split-backward schedules (Megatron's linear-layer backward) is entered and left by each step
itself (``runtime.wgrad.deferring_linear_backward``), so none outlives a step.

With ``post_validate=True`` the installation also replaces ``get_megatron_optimizer`` wherever
a ``megatron`` module bound it (``megatron.core.optimizer`` itself and ``megatron.training``), so
the optimizer ``setup_model_and_optimizer`` builds comes back wrapped in
``post_validation.PostValidatedOptimizer``; ``uninstall()`` (or installing again
without it) puts the factory back. With ``run_ahead=True`` (which needs ``post_validate``) it
also replaces Megatron-LM's ``train_step`` with ``run_ahead_step.RunAheadTrainStep``, in the
same way.
"""

from __future__ import annotations

import sys

from .. import megatron_compat
from .forward_backward import RunState, ScheduleFunction
from .options import ENV_SCHEDULE, PipelineOptions
from .post_validation import post_validated
from .run_ahead_step import LocalMaxStat, RunAheadTrainStep
from .v_layout_models import undo_patches

_REPLACED_NAMES = (
    "forward_backward_pipelining_without_interleaving",
    "forward_backward_pipelining_with_interleaving",
)


class Installation:
    """One ``install()``: ``function`` is what Megatron's selector returns at pp > 1."""

    def __init__(self, options: PipelineOptions):
        self.function = ScheduleFunction(None)
        self.function.set_options(options)
        self.replaced: list[tuple[object, str, object]] = []  # (module, attribute, original)
        self.optimizer_factory_replaced: list[tuple[object, str, object]] = []
        self.train_step_replaced: list[tuple[object, str, object]] = []
        self.train_step = None  # the RunAheadTrainStep Megatron-LM's loop calls, when on

    @property
    def options(self) -> PipelineOptions:
        return self.function.options

    @property
    def state(self) -> RunState:
        """What the plugin remembers between steps (last step, timeline, auto's choice)."""
        return self.function.state

    @property
    def active(self) -> bool:
        return bool(self.replaced)

    def patch_megatron(self) -> None:
        from megatron.core.pipeline_parallel import schedules

        originals = {getattr(schedules, name) for name in _REPLACED_NAMES}
        for module_name, module in list(sys.modules.items()):
            if module is None or not module_name.startswith("megatron"):
                continue
            for name, value in list(vars(module).items()):
                if callable(value) and any(value is original for original in originals):
                    self.replaced.append((module, name, value))
                    setattr(module, name, self.function)

    def patch_optimizer_factory(self, on: bool) -> None:
        """Wrap (on) or stop wrapping (off) what Megatron's ``get_megatron_optimizer`` returns,
        wherever a ``megatron`` module bound it, in a ``PostValidatedOptimizer``."""
        if not on:
            while self.optimizer_factory_replaced:
                module, name, original = self.optimizer_factory_replaced.pop()
                setattr(module, name, original)
            return
        if self.optimizer_factory_replaced:
            return
        import functools

        from megatron.core import optimizer as megatron_optimizer

        original = megatron_optimizer.get_megatron_optimizer

        @functools.wraps(original)
        def get_megatron_optimizer(*args, **kwargs):
            return post_validated(original(*args, **kwargs))

        get_megatron_optimizer.post_validated = True
        # every binding, the library's own name too: a module imported later binds the wrapper
        for module_name, module in list(sys.modules.items()):
            if module is None or not module_name.startswith("megatron"):
                continue
            for name, value in list(vars(module).items()):
                if value is original:
                    self.optimizer_factory_replaced.append((module, name, value))
                    setattr(module, name, get_megatron_optimizer)

    def patch_train_step(self, on: bool) -> None:
        """Replace (on) or put back (off) Megatron-LM's ``train_step`` in
        ``megatron.training.training`` with a fresh ``RunAheadTrainStep``, and the
        learning-rate reduction of its ``training_log`` with a ``LocalMaxStat``."""
        while self.train_step_replaced:
            module, name, original = self.train_step_replaced.pop()
            setattr(module, name, original)
        self.train_step = None
        if not on:
            return
        from megatron.training import training

        max_stat = None
        if hasattr(training, "reduce_max_stat_across_model_parallel_group"):  # training_log's
            max_stat = LocalMaxStat(training.reduce_max_stat_across_model_parallel_group)
            self.train_step_replaced.append(
                (training, "reduce_max_stat_across_model_parallel_group", max_stat.original))
            training.reduce_max_stat_across_model_parallel_group = max_stat
        self.train_step = RunAheadTrainStep(max_stat)
        self.train_step_replaced.append((training, "train_step", training.train_step))
        training.train_step = self.train_step

    def uninstall(self) -> None:
        """Put every replaced name back; this installation is then inactive."""
        global _current
        self.patch_train_step(False)
        self.patch_optimizer_factory(False)
        while self.replaced:
            module, name, original = self.replaced.pop()
            setattr(module, name, original)
        if _current is self:
            _current = None

    def __repr__(self) -> str:
        return (f"Installation({self.options.schedule!r}, "
                f"{'active' if self.active else 'inactive'})")


_current: Installation | None = None  # which installation Megatron's names point to now


def install(schedule: str | None = None, **options) -> Installation:
    """Run ``schedule`` (default: $MEGATRON_PP_SCHEDULE, else '1f1b') for every pipelined
    step of Megatron-Core. ``schedule`` is a name (any case; PyTorch's names such as
    'Interleaved1F1B' or 'ZBVZeroBubble' too), 'auto', or the path of a schedule file (.csv in
    PyTorch's compute-only format, or .json): the file is read and checked here (validator,
    loop or V layout, NCCL's rules), before anything is patched; each step then checks that
    its pipeline size, microbatch count and model chunks are the file's. Options: chunks,
    max_pending_backward, microbatch_group_size_per_vp_stage, p2p_timeout_s,
    first_step_timeout_s, trace, post_validate (``get_megatron_optimizer`` then returns its
    optimizer wrapped in ``post_validation.PostValidatedOptimizer``, for ``megatron.training``
    and any other caller), run_ahead (with post_validate: Megatron-LM's ``train_step`` runs
    each step before the previous one is validated, ``run_ahead_step``), warmup_forwards
    (zb-v). Installing again switches the active installation to the new options (a change
    starts afresh) and returns it."""
    global _current
    megatron_compat.check_supported()  # outside the window: say which releases, patch nothing
    active = PipelineOptions.from_kwargs(schedule, **options)  # bad input: nothing patched
    if _current is not None:
        _current.function.set_options(active)
        _current.patch_optimizer_factory(active.post_validate)
        _current.patch_train_step(active.run_ahead)
        return _current
    installation = Installation(active)
    installation.patch_megatron()
    installation.patch_optimizer_factory(active.post_validate)
    installation.patch_train_step(active.run_ahead)
    _current = installation
    return installation


def uninstall() -> None:
    """Undo the active installation completely (no-op when none is active), and the patches
    the V-layout model providers made (``v_layout_models.undo_patches``)."""
    if _current is not None:
        _current.uninstall()
    undo_patches()


def installed() -> bool:
    return _current is not None and _current.active


def current_installation() -> Installation | None:
    return _current


def install_from_env() -> bool:
    """Install when $MEGATRON_PP_SCHEDULE names a schedule (for unmodified scripts)."""
    import os

    if os.environ.get(ENV_SCHEDULE):
        install()
        return True
    return False
