"""Imported once by the tests' process server (``conftest.py`` preloads it), before it forks
any rank: work that every rank of a Megatron-LM loop run would otherwise repeat, done once and
inherited by the forked ranks. Nothing here changes what a run computes.

- The modules a rank imports after the fork (the plugin's install path, Megatron's loop and
  its dataset builder): ~0.3 s of CPU per rank otherwise.
- Megatron-LM's argument parser reads each config dataclass's field docstrings for the help
  text by parsing the class's source (``ArgumentGroupFactory._get_field_docstrings``:
  ``inspect.getsource`` + ``ast.parse``, ~0.25 s of CPU per ``parse_args``, and a loop run
  parses twice per rank). The docstrings are a pure function of the class, so they are
  memoized per class here and the memo is filled by building Megatron's parser once.
- TorchInductor's config, and with it TorchDynamo: Megatron-LM's ``validate_args`` under
  ``--deterministic-mode`` (every loop run here) calls ``torch.use_deterministic_algorithms``,
  which imports ``torch._inductor.config`` (its package imports TorchDynamo): ~2.5 s of CPU per
  rank otherwise, a third of a short loop run's. Imported last, after Megatron, so that
  Megatron's own import is the one the ``train`` command's ranks get (no TorchDynamo, fusions
  not compiled): ``DYNAMO_BEFORE_WARMUP`` records it for the test that checks this.
"""

from __future__ import annotations

import argparse
import importlib
import sys

#: whether TorchDynamo was loaded by what the server imported before this module (torch, the
#: plugin's ``train.preload``, Megatron): test_layout asserts it was not
DYNAMO_BEFORE_WARMUP = "torch._dynamo" in sys.modules

from megatron.training import argument_utils, arguments

for _module in ("megatron.core.datasets.blended_megatron_dataset_builder",
                "megatron.core.datasets.gpt_dataset", "megatron.training.training",
                "megatron_pp_ext.integration.forward_backward",
                "megatron_pp_ext.integration.install", "megatron_pp_ext.integration.megatron_args"):
    importlib.import_module(_module)

_read_docstrings = argument_utils.ArgumentGroupFactory._get_field_docstrings
_docstrings: dict[type, dict[str, str]] = {}


def _memoized_docstrings(self, src_cfg_class: type) -> dict[str, str]:
    if src_cfg_class not in _docstrings:  # (it recurses on the base class through self)
        _docstrings[src_cfg_class] = _read_docstrings(self, src_cfg_class)
    return dict(_docstrings[src_cfg_class])  # a copy: the caller may update it


argument_utils.ArgumentGroupFactory._get_field_docstrings = _memoized_docstrings
arguments.add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))

importlib.import_module("torch._inductor.config")  # last: see the module docstring
