"""Imported once by the tests' process server (``conftest.py`` preloads it), before it forks
any rank: work that every rank of a Megatron-LM loop run would otherwise repeat, done once and
inherited by the forked ranks. Nothing here changes what a run computes.

- The modules a rank imports after the fork (Megatron's loop, its dataset builder and
  tokenizer, the plugin's argument handling; the drop-in and the MIMO model come with
  ``train.processes._PRELOAD``): ~0.6 s of CPU per rank otherwise.
- Megatron-LM's own ``pretrain_gpt.py`` of this release (``support.megatron_lm_scripts``), which
  every loop run imports, with what it imports (~0.15 s of CPU per rank otherwise). Where the
  script is not found, nothing is imported here: the run that needs it fails, saying where it
  looked.
- Megatron-LM's argument parser reads each config dataclass's field docstrings for the help
  text by parsing the class's source (``ArgumentGroupFactory._get_field_docstrings``:
  ``inspect.getsource`` + ``ast.parse``, ~0.25 s of CPU per ``parse_args``, and a loop run
  parses twice per rank). The docstrings are a pure function of the class, so they are
  memoized per class here and the memo is filled by building Megatron's parser once.
- TorchInductor's config: Megatron-LM's ``validate_args`` under ``--deterministic-mode`` (every
  loop run here) calls ``torch.use_deterministic_algorithms``, which imports
  ``torch._inductor.config``: a share of the ~2.5 s of CPU per rank that it and TorchDynamo
  (the server preloads it: ``train.processes._PRELOAD``) cost a loop run's rank otherwise.
"""

from __future__ import annotations

import argparse
import importlib

from megatron.training import argument_utils, arguments

# (beside train.processes._PRELOAD, which this server imports first: the drop-in, MIMO's model)
for _module in ("megatron.core.datasets.blended_megatron_dataset_builder",
                "megatron.core.datasets.gpt_dataset", "megatron.training.training",
                # imported when called: the tokenizer's models (build_tokenizer)
                "megatron.core.tokenizers.text.models",
                "megatron_pp_ext.integration.megatron_args"):
    importlib.import_module(_module)
try:
    from support.megatron_lm_scripts import put_scripts_on_path

    put_scripts_on_path()
    importlib.import_module("pretrain_gpt")
except FileNotFoundError:
    pass

_read_docstrings = argument_utils.ArgumentGroupFactory._get_field_docstrings
_docstrings: dict[type, dict[str, str]] = {}


def _memoized_docstrings(self, src_cfg_class: type) -> dict[str, str]:
    if src_cfg_class not in _docstrings:  # (it recurses on the base class through self)
        _docstrings[src_cfg_class] = _read_docstrings(self, src_cfg_class)
    return dict(_docstrings[src_cfg_class])  # a copy: the caller may update it


argument_utils.ArgumentGroupFactory._get_field_docstrings = _memoized_docstrings
arguments.add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))

importlib.import_module("torch._inductor.config")  # last: see the module docstring
