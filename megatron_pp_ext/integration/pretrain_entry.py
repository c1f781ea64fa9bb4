"""Megatron-LM's ``pretrain()`` with the plugin's schedule, in the form each release takes it.

A training script (``scripts/pretrain_gpt_pp.py``, the tests' Megatron-LM loop) calls
:func:`run_pretrain` the way Megatron-LM's own ``pretrain_gpt.py`` calls ``pretrain()``; this
module parses the arguments with the plugin's group (``--pipeline-schedule`` ...), installs
the schedule on every rank before the model is built, and gives ``pretrain()`` a V-layout
model provider when the schedule needs one. The three forms (``megatron_compat.pretrain_form``):

- "config" (0.19+, main): arguments parsed and validated first, the model built from
  ``gpt_config_from_args(args)`` in the config container (or from a provider built from
  that config, for the V layout or when the caller wraps the provider);
- "provider" (0.18): arguments parsed first, the container from the arguments alone, the model
  from the script's provider (``pretrain_gpt.py``'s ``partial(model_provider, gpt_builder)``);
- "args" (0.17): ``pretrain()`` parses the arguments itself; the schedule is installed by the
  model provider's first call (``get_model`` calls it on every rank after the arguments are
  set and before the optimizer, the first step, or anything the installation patches runs).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

from .. import megatron_compat
from .megatron_args import add_pipeline_schedule_args, chain_args_providers, install_from_args
from .layout_providers import model_provider_for_args, pretrain_model_for_args
from .v_layout_models import model_provider_from_config


def run_pretrain(datasets_provider, forward_step, *, model_provider=None,
                 extra_args_provider=None, args_defaults: Optional[dict] = None,
                 on_args: Optional[Callable[[Any], None]] = None,
                 model_config: Optional[Callable[[Any], Any]] = None,
                 wrap_provider: Optional[Callable] = None, pretrain=None, **pretrain_kwargs):
    """Run Megatron-LM's ``pretrain()`` (``pretrain``: a wrapped one, e.g. in-process
    restart's; default ``megatron.training.pretrain``) with the plugin's argument group added
    to ``extra_args_provider``.

    ``model_provider``: the loop-layout provider (``pre_process, post_process, vp_stage,
    config, pg_collection``) for releases whose ``pretrain()`` takes one (0.17, 0.18); on
    0.19+ the model comes from ``model_config(args)`` (default ``gpt_config_from_args``).
    ``on_args(args)``: called once on every rank as soon as the arguments are validated
    (after the schedule is installed, before the model is built). ``wrap_provider(provider)``:
    wraps the provider ``pretrain()`` is given (on 0.19+ a provider is then built from the
    config). ``pretrain_kwargs``: passed on (``store``, ``get_embedding_ranks``, ...)."""
    from megatron.core.enums import ModelType
    from megatron.training import pretrain as megatron_pretrain

    pretrain = pretrain or megatron_pretrain
    extra = chain_args_providers(extra_args_provider, add_pipeline_schedule_args)
    form = megatron_compat.pretrain_form()
    model_type = pretrain_kwargs.pop("model_type", ModelType.encoder_or_decoder)
    if form in ("args", "provider") and model_provider is None:
        raise ValueError(
            f"megatron-core {megatron_compat.megatron_core_version()}'s pretrain() takes a "
            "model provider: pass model_provider= (pretrain_gpt.py's "
            "partial(model_provider, gpt_builder))")

    def prepared(args):
        install_from_args(args)  # --pipeline-schedule / $MEGATRON_PP_SCHEDULE, else a no-op
        if on_args is not None:
            on_args(args)
        return args

    if form == "args":
        provider = _installing_provider(model_provider, prepared)
        return pretrain(datasets_provider, _wrapped(provider, wrap_provider), model_type,
                        forward_step, extra_args_provider=extra,
                        args_defaults=dict(args_defaults or {}), **pretrain_kwargs)

    args = prepared(megatron_compat.parse_and_validate_args(extra, args_defaults))
    if form == "provider":
        provider = model_provider_for_args(model_provider, args)
        return pretrain(megatron_compat.pretrain_config_container(args), datasets_provider,
                        _wrapped(provider, wrap_provider), model_type, forward_step,
                        **pretrain_kwargs)
    config = (model_config or megatron_compat.gpt_model_config)(args)
    cfg, provider = pretrain_model_for_args(
        megatron_compat.pretrain_config_container(args, config), args)
    if wrap_provider is not None:
        if provider is None:
            provider, cfg.model = model_provider_from_config(cfg.model), None
        provider = wrap_provider(provider)
    return pretrain(cfg, datasets_provider, model_type, forward_step, model_provider=provider,
                    **pretrain_kwargs)


def _wrapped(provider, wrap_provider):
    return provider if wrap_provider is None else wrap_provider(provider)


def _installing_provider(model_provider, prepare: Callable[[Any], Any]):
    """``model_provider`` whose first call reads Megatron-LM's arguments (set by then),
    ``prepare``s them (installs the schedule) and chooses the V-layout provider if the
    schedule needs one; later calls go to that choice."""
    chosen: list = []

    @functools.wraps(model_provider)
    def provider(*args, **kwargs):
        if not chosen:
            from megatron.training import get_args

            megatron_args = prepare(get_args())
            chosen.append(model_provider_for_args(model_provider, megatron_args))
        return chosen[0](*args, **kwargs)

    return provider
