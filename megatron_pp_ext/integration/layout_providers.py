"""Which model provider a training script hands ``pretrain()``: as it is (the loop layout),
or wrapped for the schedule's layout (``v_layout_models``: zb-v, dualpipev, v-half, v-min,
zb-auto on two chunks; ``dual_layout_models``: dualpipe), from ``--pipeline-schedule``."""

from __future__ import annotations

from typing import Any

from .dual_layout_models import dual_layout_model_provider, uses_dual_layout
from .v_layout_models import model_provider_from_config, uses_v_layout, v_layout_model_provider


def model_provider_for_args(model_provider, args: Any):
    """``model_provider`` as it is, or wrapped by :func:`v_layout_model_provider` when
    ``--pipeline-schedule`` is a V-layout schedule (:func:`dual_layout_model_provider` for
    dualpipe): what a training script passes to ``pretrain()`` so every schedule works from
    the same command line."""
    if model_provider is not None and uses_dual_layout(args):
        return dual_layout_model_provider(model_provider)
    if model_provider is None or not uses_v_layout(args):
        return model_provider
    return v_layout_model_provider(model_provider)


def pretrain_model_for_args(cfg_container, args: Any):
    """``(cfg_container, model_provider)`` to pass to ``pretrain()``. Unchanged (Megatron builds
    from ``cfg_container.model``, no provider) unless ``--pipeline-schedule`` is a V-layout
    schedule: then the provider builds V-layout chunks from the same model config
    (:func:`v_layout_model_provider` over :func:`model_provider_from_config`; dualpipe's,
    which sets the model config to one chunk per rank) and ``cfg_container.model`` is set to
    None, so ``pretrain()`` takes the provider."""
    model = getattr(cfg_container, "model", None)
    if model is not None and uses_dual_layout(args):
        provider = dual_layout_model_provider(model_provider_from_config(model),
                                              transformer_config=model.transformer)
        cfg_container.model = None
        return cfg_container, provider
    if not uses_v_layout(args) or model is None:
        return cfg_container, None
    provider = v_layout_model_provider(model_provider_from_config(cfg_container.model))
    cfg_container.model = None
    return cfg_container, provider
