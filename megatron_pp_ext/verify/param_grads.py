"""Every parameter's gradient norm, as Megatron's optimizer is about to use it, under a name that
is the same whichever layout holds the parameter.

When: just before the optimizer's ``prepare_grads`` (Megatron's ``train_step`` calls it first
in ``optimizer.step()``): the step's gradients are in each parameter's ``main_grad``, reduced
over data parallelism by ``finalize_model_grads`` (and summed over dualpipe's two copies of a
part), not yet unscaled (divided here by the loss scale) or clipped.

What: with the distributed optimizer each data-parallel rank holds the reduced values of its
shard of a parameter (``_get_model_param_range_map``), so a rank records the squares of its
shard and the ranks' squares are summed when the results are merged (``sharded``); without it
every replica holds the whole reduced gradient (``sharded`` False: one replica's counts).

Names: the chunk's own name with the decoder layer renumbered to its global position
(``layer_number``: chunk 0's ``decoder.layers.0`` on pipeline rank 1 is the model's layer 4),
so a parameter has one name under 1F1B, the V layout and dualpipe; the tensor-parallel and
expert-parallel ranks are part of the key (each holds its own shard or experts).
"""

from __future__ import annotations

import re

import torch

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


def global_names(model_chunks, stage_of_chunk) -> dict[int, tuple[str, int]]:
    """{id(param): (global name, stage)} for every parameter of this rank's chunks;
    ``stage_of_chunk(index, inner_model)`` gives a chunk's pipeline stage."""
    from megatron.core.utils import get_attr_wrapped_model

    names: dict[int, tuple[str, int]] = {}
    for index, chunk in enumerate(model_chunks):
        inner = get_attr_wrapped_model(chunk, "pre_process", return_model_obj=True)
        layers = getattr(getattr(inner, "decoder", None), "layers", None) or []
        numbers = [int(layer.layer_number) - 1 for layer in layers]
        stage = stage_of_chunk(index, inner)
        for name, param in inner.named_parameters():
            match = _LAYER.match(name)
            if match and int(match.group(1)) < len(numbers):
                name = f"decoder.layers.{numbers[int(match.group(1))]}.{name[match.end():]}"
            names[id(param)] = (name, stage)
    return names


def _leaves(optimizer) -> list:
    """The optimizers inside a ``ChainedOptimizer`` (or the optimizer itself)."""
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


def _model_params(optimizer) -> list:
    """The model parameters a Megatron optimizer steps (its groups of model params)."""
    for groups in (("model_float16_groups", "model_fp32_groups"),
                   ("float16_groups", "fp32_from_fp32_groups")):
        if hasattr(optimizer, groups[0]):
            return [p for name in groups for group in getattr(optimizer, name) for p in group]
    return [p for group in optimizer.param_groups for p in group["params"]]  # FP32Optimizer


def _owned_grad(optimizer, param) -> torch.Tensor | None:
    grad = getattr(param, "main_grad", None)
    if grad is None:
        grad = param.grad
    if grad is None:
        return None
    if hasattr(optimizer, "_get_model_param_range_map"):  # distributed: this rank's shard
        owned = optimizer._get_model_param_range_map(param)["param"]
        return grad.view(-1)[owned.start:owned.end]
    return grad


def local_squares(optimizer, names: dict[int, tuple[str, int]]) -> list[tuple]:
    """[(global name, stage, sum of squares of this rank's unscaled gradient, sharded,
    expert)] of every parameter ``optimizer`` steps (an expert's weights: Megatron marks them
    ``allreduce = False``; each expert-parallel rank holds its own)."""
    out = []
    for leaf in _leaves(optimizer):
        scale = float(leaf.get_loss_scale()) if hasattr(leaf, "get_loss_scale") else 1.0
        sharded = hasattr(leaf, "_get_model_param_range_map")
        for param in _model_params(leaf):
            grad = _owned_grad(leaf, param)
            if grad is None or id(param) not in names:
                continue
            name, stage = names[id(param)]
            square = float(grad.detach().float().pow(2).sum()) / (scale * scale)
            expert = not getattr(param, "allreduce", True)
            out.append((name, stage, square, sharded, expert))
    return out


def merge_norms(records) -> dict[str, dict]:
    """{"name@tp<t>[@ep<e>]": {"name", "tp", "ep", "copies": [[pipeline rank, stage, norm]]}}
    (JSON's keys) from every rank's
    ``(pp, tp, ep, [local_squares])`` of one step: a sharded parameter's squares summed over
    the data-parallel ranks that hold its shards, an unsharded one taken from one replica.
    dualpipe's two copies of a part are two entries (two pipeline ranks)."""
    sums: dict[tuple, float] = {}
    for pp, tp, ep, squares in records:
        for name, stage, square, sharded, expert in squares:
            key = (name, tp, ep if expert else 0, pp, stage)
            if sharded:
                sums[key] = sums.get(key, 0.0) + square
            else:
                sums.setdefault(key, square)
    merged: dict[str, dict] = {}
    for (name, tp, ep, pp, stage), square in sorted(sums.items()):
        key = f"{name}@tp{tp}" + (f"@ep{ep}" if ep else "")
        entry = merged.setdefault(key, {"name": name, "tp": tp, "ep": ep, "copies": []})
        entry["copies"].append([pp, stage, square ** 0.5])
    return merged
