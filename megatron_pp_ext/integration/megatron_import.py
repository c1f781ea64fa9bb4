"""Megatron-Core imported without compiling its fusions, on a machine without a GPU.

Megatron-Core 0.19.2 sets ``megatron.core.jit.jit_fuser = torch.compile`` when it is imported
and applies it to its fusions as they import (``fusions/fused_bias_geglu.py`` and others):
that call imports TorchDynamo and Inductor, 2.8 s of CPU in every process that imports
Megatron here (of 8.3 s for torch and the Megatron modules a rank uses; 2 cores). A CPU run
never calls those functions (``models.tiny_gpt`` turns every fusion off), and compiling them
on the CPU would need a C++ compiler. So where there is no GPU, ``torch.compile`` compiles
nothing while these modules import (the fusions stay plain functions, and ``jit_fuser`` stays
the pass-through for Megatron's later imports), and is restored right after. With a GPU
nothing changes. (A training rank still needs TorchDynamo: torch.optim imports it when the
first optimizer is built. The ``train`` server preloads it once, after Megatron, for all its
ranks; the commands that only read arguments never load it.)

Who calls it: the ``train`` ranks' process server (it preloads ``train.preload``, which
does), a rank started on its own (srun: ``train.loop`` imports ``train.preload``), and the
commands that read Megatron-LM's arguments (``plan``, ``select``, ``simulate -- ARGS``:
``pretrain_args.parse_pretrain_args``), which never run a model. Where Megatron is imported
already (a training process, which imported it itself), it changes nothing.
"""

from __future__ import annotations

import importlib
import sys

import torch

from .. import device as device_helper

#: what a train rank uses (``train.processes._PRELOAD``)
RANK_MODULES = ("megatron.core.models.gpt", "megatron.core.pipeline_parallel.schedules",
                "megatron.core.distributed")


def _compile_nothing(model=None, **_options):
    """``torch.compile``'s two forms (``compile(fn)``, ``compile(**options)(fn)``), returning
    the function itself."""
    return model if model is not None else (lambda fn: fn)


def import_megatron(*modules: str) -> None:
    """Import ``modules`` (default ``RANK_MODULES``); without a GPU and before Megatron's first
    import, with ``torch.compile`` compiling nothing meanwhile."""
    modules = modules or RANK_MODULES
    if "megatron.core.jit" in sys.modules or device_helper.cuda_available():
        for name in modules:
            importlib.import_module(name)
        return
    original = torch.compile
    torch.compile = _compile_nothing
    try:
        for name in modules:
            importlib.import_module(name)
    finally:
        torch.compile = original


__all__ = ["RANK_MODULES", "import_megatron"]
