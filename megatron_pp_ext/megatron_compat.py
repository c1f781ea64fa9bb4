"""The one place that knows how Megatron differs between the releases we support.

Every Megatron name the package uses that is private (a leading underscore) or that differs
between supported releases (a signature that changed, a function that moved or appeared) is
reached through this module. Each entry detects the capability itself (a name that exists, a
parameter a function takes), never a version string, and says which releases have which form.
``tests/test_megatron_compat.py`` fails on a private Megatron name used anywhere else in the
package.

The supported window (``SUPPORTED_WINDOW``): megatron-core 0.17.x, 0.18.x, 0.19.x and
Megatron-LM main (0.20 dev); :func:`check_supported` refuses any other at ``install()``. No
feature of the plugin is missing on a release of the window today (docs/megatron-versions.md):
one that is must be refused there, at ``install()`` or argument time, naming the feature and the
first release that has it.

Nothing here imports ``megatron.training`` at import time (the drop-in runs with
``megatron.core`` alone): the trainer's entries import it when called.
"""

from __future__ import annotations

import importlib
import inspect
import sys

SUPPORTED_WINDOW = "megatron-core 0.17.x, 0.18.x and 0.19.x, and Megatron-LM main (0.20 dev)"


class UnsupportedMegatronError(RuntimeError):
    """The Megatron found is outside the supported window, or lacks a feature asked for."""


def megatron_core_version() -> str:
    """The installed megatron-core's version string (for messages only: entries below detect
    capabilities, not versions)."""
    try:
        from megatron.core import package_info
    except ImportError:
        return "unknown"
    return str(getattr(package_info, "__version__", "unknown"))


def _parameters(function) -> tuple[str, ...]:
    try:
        return tuple(inspect.signature(function).parameters)
    except (TypeError, ValueError):
        return ()


# --------------------------------------------------------------------------------------------
# The window
# --------------------------------------------------------------------------------------------

def check_supported() -> None:
    """Raise :class:`UnsupportedMegatronError` naming the window unless the installed
    Megatron-Core is in it. The floor is 0.17's ``backward_step(input_tensor, output_tensor,
    output_tensor_grad, config)``: 0.16 and older take ``model_type`` before ``config``, and
    the package calls it without."""
    try:
        from megatron.core.pipeline_parallel import schedules
    except ImportError as error:
        raise UnsupportedMegatronError(
            f"megatron_pp_ext needs Megatron-Core ({SUPPORTED_WINDOW}); importing "
            f"megatron.core.pipeline_parallel failed: {error}") from error
    params = _parameters(schedules.backward_step)
    if "model_type" in params or "config" not in params:
        raise UnsupportedMegatronError(
            f"megatron-core {megatron_core_version()} is not supported: megatron_pp_ext "
            f"supports {SUPPORTED_WINDOW} (this release's backward_step takes "
            f"({', '.join(params)}); 0.17 dropped model_type). Install one of them, e.g. "
            "`pip install 'megatron-core>=0.17,<0.20'`.")


# --------------------------------------------------------------------------------------------
# megatron.core
# --------------------------------------------------------------------------------------------

def default_pg_collection():
    """The ``ProcessGroupCollection`` Megatron's schedules fall back to when the caller passes
    none. 0.19+: ``schedules._build_default_pg_collection()``. 0.17/0.18: each schedule built
    the same collection inline from ``parallel_state`` (tp, cp, embd, pos_embd, pp, dp_cp,
    tp_dp_cp); built the same way here, with dp as 0.19 adds it."""
    from megatron.core.pipeline_parallel import schedules

    build = getattr(schedules, "_build_default_pg_collection", None)
    if build is not None:
        return build()
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection

    pgs = ProcessGroupCollection()
    pgs.tp = parallel_state.get_tensor_model_parallel_group()
    pgs.cp = parallel_state.get_context_parallel_group()
    pgs.embd = parallel_state.get_embedding_group(check_initialized=False)
    pgs.pos_embd = parallel_state.get_position_embedding_group(check_initialized=False)
    pgs.pp = parallel_state.get_pipeline_model_parallel_group()
    pgs.dp_cp = parallel_state.get_data_parallel_group(
        with_context_parallel=True, partial_data_parallel=False)
    pgs.tp_dp_cp = parallel_state.get_tensor_and_data_parallel_group(with_context_parallel=True)
    pgs.dp = parallel_state.get_data_parallel_group(
        with_context_parallel=False, partial_data_parallel=False)
    return pgs


def has_separate_grad_norm_group(param) -> bool:
    """Whether the optimizer computes a separate gradient norm for ``param``. 0.19+ tags such
    parameters (``optimizer._get_param_grad_norm_group`` / ``_is_separate_grad_norm_group``);
    0.17/0.18 have no separate groups: always False."""
    from megatron.core.optimizer import optimizer

    if not hasattr(optimizer, "_is_separate_grad_norm_group"):
        return False
    return optimizer._is_separate_grad_norm_group(optimizer._get_param_grad_norm_group(param))


def copies_model_grads(leaf) -> bool:
    """Whether the optimizer copies the model's gradients into main gradients of its own
    (mixed-precision and distributed optimizers: a private ``_copy_model_grads_to_main_grads``,
    0.17-0.19), rather than using them in place (``FP32Optimizer``)."""
    return hasattr(leaf, "_copy_model_grads_to_main_grads")


def copy_model_grads_to_main_grads(leaf) -> None:
    """That copy (see :func:`copies_model_grads`)."""
    leaf._copy_model_grads_to_main_grads()


def grads_for_grad_norm(leaf) -> list:
    """The gradients the optimizer's grad norm reads (duplicates and TP replicas filtered):
    0.19+ ``get_grads_for_grad_norm()``; 0.17/0.18 ``get_main_grads_for_grad_norm()``."""
    method = getattr(leaf, "get_grads_for_grad_norm", None)
    if method is None:
        method = leaf.get_main_grads_for_grad_norm
    return method()


def main_grad_data_for_unscaling(leaf):
    """The main-gradient tensors the optimizer unscales and checks for inf/nan (its private
    ``_collect_main_grad_data_for_unscaling``, 0.17-0.19)."""
    return leaf._collect_main_grad_data_for_unscaling()


def finalize_grads_module():
    """``megatron.core.distributed.finalize_model_grads`` the module (the package exports a
    function of the same name), whose ``_allreduce_word_embedding_grads`` (0.17-0.19, same
    signature) the V layout replaces: see :func:`word_embedding_grads_hook`."""
    return importlib.import_module("megatron.core.distributed.finalize_model_grads")


WORD_EMBEDDING_GRADS = "_allreduce_word_embedding_grads"


def pipeline_rank_override():
    """The pipeline rank ``parallel_state.set_pipeline_model_parallel_rank`` set, or None (its
    private ``_MPU_PIPELINE_MODEL_PARALLEL_RANK``, 0.17-0.19)."""
    from megatron.core import parallel_state

    return getattr(parallel_state, "_MPU_PIPELINE_MODEL_PARALLEL_RANK", None)


def model_parallel_rng_tracker_name() -> str:
    """The CUDA RNG tracker's name for the model-parallel state (private
    ``tensor_parallel.random._MODEL_PARALLEL_RNG_TRACKER_NAME``, 0.17-0.19)."""
    from megatron.core.tensor_parallel import random as mp_random

    return mp_random._MODEL_PARALLEL_RNG_TRACKER_NAME


def grad_accum_fusion_kernel():
    """apex's ``fused_weight_gradient_mlp_cuda`` as Megatron's linear layers imported it, or
    None (``tensor_parallel.layers._grad_accum_fusion_available``, 0.17-0.19)."""
    from megatron.core.tensor_parallel import layers

    if not getattr(layers, "_grad_accum_fusion_available", False):
        return None
    return getattr(layers, "fused_weight_gradient_mlp_cuda", None)


# --------------------------------------------------------------------------------------------
# megatron.training (Megatron-LM's trainer: imported when an entry is called)
# --------------------------------------------------------------------------------------------

def loaded_global_args():
    """megatron.training's parsed arguments when it is loaded and initialized here, else
    None; never imports it (private ``global_vars._GLOBAL_ARGS``, 0.17-0.19)."""
    global_vars = sys.modules.get("megatron.training.global_vars")
    return None if global_vars is None else getattr(global_vars, "_GLOBAL_ARGS", None)


def set_random_seed_as_pipeline_rank(args, pp_rank: int, pipeline_rank_as) -> None:
    """Seed every generator as Megatron-LM's start-up seeds pipeline rank ``pp_rank``
    (``megatron.training.initialize._set_random_seed`` with the run's arguments). 0.19+ takes
    the pipeline group (``pp_group=``, of which it reads ``rank()``); 0.17/0.18 read
    ``parallel_state.get_pipeline_model_parallel_rank()``, so the call runs inside
    ``pipeline_rank_as(pp_rank)`` (a context that overrides that rank)."""
    from megatron.training.initialize import _set_random_seed

    positional = (args.seed, args.data_parallel_random_init, args.te_rng_tracker,
                  args.inference_rng_tracker)
    cudagraph = getattr(args, "enable_cuda_graph", False)
    if "pp_group" in _parameters(_set_random_seed):
        _set_random_seed(*positional, use_cudagraphable_rng=cudagraph, pp_group=_RankOf(pp_rank))
        return
    with pipeline_rank_as(pp_rank):
        _set_random_seed(*positional, use_cudagraphable_rng=cudagraph)


class _RankOf:
    """A stand-in group for 0.19's ``_set_random_seed(pp_group=...)``, which reads only
    ``group.rank()``."""

    def __init__(self, rank: int):
        self._rank = rank

    def rank(self) -> int:
        return self._rank


def call_max_stat(original, stat, group=None):
    """Megatron-LM's ``reduce_max_stat_across_model_parallel_group``: 0.19+ takes ``group=``,
    0.17/0.18 only the stat (they reduce over the model-parallel group); a group is passed on
    only where the original takes one."""
    if group is not None or "group" in _parameters(original):
        return original(stat, group=group)
    return original(stat)


def padded_vocab_size(vocab: int, divisible_by: int, tensor_parallel: int) -> int:
    """The vocabulary padded as Megatron-LM pads it: 0.18+
    ``megatron.training.vocab_utils.calculate_padded_vocab_size``; 0.17
    ``megatron.core.tokenizers.utils.build_tokenizer.vocab_size_with_padding`` (which reads
    the two sizes from an argument namespace)."""
    try:
        from megatron.training.vocab_utils import calculate_padded_vocab_size
    except ImportError:
        from types import SimpleNamespace

        from megatron.core.tokenizers.utils.build_tokenizer import vocab_size_with_padding

        sizes = SimpleNamespace(make_vocab_size_divisible_by=divisible_by,
                                tensor_model_parallel_size=tensor_parallel, rank=0)
        return int(vocab_size_with_padding(vocab, sizes, logging_enabled=False))
    return int(calculate_padded_vocab_size(vocab, divisible_by, tensor_parallel,
                                           logging_enabled=False))


def whole_batch_kwargs(get_batch_on_this_tp_rank) -> dict:
    """Keywords that make ``megatron.training.utils.get_batch_on_this_tp_rank`` keep (and
    broadcast over TP) every tensor of the batch, as it does for a one-stage pipeline (the V
    layout's rank 0 holds the first and the last stage): 0.18+ take
    ``pipeline_model_parallel_size`` (1); 0.17 reads the run's pipeline size and keeps every
    tensor where ``mtp_on_this_rank`` is set."""
    if "pipeline_model_parallel_size" in _parameters(get_batch_on_this_tp_rank):
        return {"pipeline_model_parallel_size": 1}
    return {"mtp_on_this_rank": True}


#: how ``megatron.training.pretrain`` takes the model, by release:
#: "args" (0.17: pretrain(datasets, model_provider, model_type, forward_step, ...,
#: extra_args_provider=, args_defaults=) parses the arguments itself), "provider" (0.18:
#: pretrain(cfg_container, datasets, model_provider, model_type, forward_step, ...)),
#: "config" (0.19+: pretrain(cfg_container, datasets, model_type, forward_step,
#: model_provider=None, ...) builds from cfg_container.model unless given a provider)
PRETRAIN_FORMS = ("args", "provider", "config")


def pretrain_form() -> str:
    from megatron.training import training

    params = _parameters(training.pretrain)
    if params and params[0] != "cfg_container":
        return "args"
    if "model_provider" in params and params.index("model_provider") < params.index("model_type"):
        return "provider"
    return "config"


def parse_and_validate_args(extra_args_provider=None, args_defaults=None):
    """Megatron-LM's arguments parsed, validated and set as its globals, as its
    ``pretrain_gpt.py`` does before ``pretrain()`` (0.18+: ``arguments.parse_and_validate_args``).
    0.17's ``pretrain()`` parses them itself (form "args"): there this raises, and the caller
    hands ``extra_args_provider`` to ``pretrain()`` instead."""
    from megatron.training import arguments

    if not hasattr(arguments, "parse_and_validate_args"):
        raise UnsupportedMegatronError(
            f"megatron-core {megatron_core_version()}'s pretrain() parses its own arguments "
            "(no arguments.parse_and_validate_args before 0.18): pass extra_args_provider to "
            "pretrain() (pretrain_form() == 'args')")
    return arguments.parse_and_validate_args(extra_args_provider=extra_args_provider,
                                             args_defaults=dict(args_defaults or {}))


def pretrain_config_container(args, model_config=None):
    """``argument_utils.pretrain_cfg_container_from_args``: 0.19+ takes the model's config
    (``gpt_config_from_args(args)``) and builds the model from it; 0.18 takes the arguments
    alone (the model comes from a provider). 0.17 has no container (form "args")."""
    from megatron.training import argument_utils

    build = getattr(argument_utils, "pretrain_cfg_container_from_args", None)
    if build is None:
        raise UnsupportedMegatronError(
            f"megatron-core {megatron_core_version()} has no pretrain config container "
            "(argument_utils.pretrain_cfg_container_from_args first appears in 0.18)")
    if "model_cfg" in _parameters(build):
        return build(args, model_config)
    return build(args)


def gpt_model_config(args, **kwargs):
    """``argument_utils.gpt_config_from_args`` (0.19+): the GPT config ``pretrain()`` builds
    the model from; None before 0.19, whose ``pretrain()`` takes a model provider."""
    from megatron.training import argument_utils

    build = getattr(argument_utils, "gpt_config_from_args", None)
    return None if build is None else build(args, **kwargs)


def mtp_tracker_keys() -> tuple[str, ...]:
    """The per-layer sums ``MTPLossLoggingHelper.tracker`` keeps for logging: 0.19+ tracks
    loss, correct and total predictions (``save_metrics_to_tracker``); 0.17 and 0.18 the loss
    alone, as ``values`` (``save_loss_to_tracker``)."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    if hasattr(MTPLossLoggingHelper, "save_metrics_to_tracker"):
        return ("loss_values", "correct_values", "total_values")
    return ("values",)
