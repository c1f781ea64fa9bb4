"""Keep Megatron-Core's warnings out of ``train``'s output, under every launcher.

Importing Megatron-Core on a machine without apex or Transformer Engine (every CPU) makes each
process warn a dozen times that they are missing, and Megatron logs deprecations at WARNING;
none of it is about the run. ``hide_megatron_warnings()`` drops Python warnings raised in
Megatron's modules (``megatron.*``; the plugin's own, ``megatron_pp_ext.*``, still show) and
raises the ``megatron.core`` logger to ERROR in this process, and sets ``PYTHONWARNINGS`` for the
processes started from it (the local launcher's forkserver imports Megatron before any rank's
code runs; that variable can only name warning categories, so those ranks ignore UserWarning
and FutureWarning at import). The launcher calls it first thing, so a torchrun or srun rank
(one process each) hides them before it imports Megatron; each rank calls it again.

A ``PYTHONWARNINGS`` of the user's own (e.g. ``PYTHONWARNINGS=default``) shows everything again.
"""

from __future__ import annotations

import logging
import os
import warnings
from typing import MutableMapping

#: what the local launcher's ranks inherit (set here; any other value is the user's)
INHERITED = "ignore::UserWarning,ignore::FutureWarning"
MEGATRON_MODULES = r"megatron\."  # megatron.core..., megatron.training...; not megatron_pp_ext
MEGATRON_LOGGER = "megatron.core"


def hide_megatron_warnings(environ: MutableMapping[str, str] | None = None) -> bool:
    """Hide Megatron's warnings here and in processes started from here; False (nothing
    changed) when ``PYTHONWARNINGS`` holds a value of the user's own."""
    env = os.environ if environ is None else environ
    if env.get("PYTHONWARNINGS", INHERITED) != INHERITED:
        return False
    env["PYTHONWARNINGS"] = INHERITED
    warnings.filterwarnings("ignore", module=MEGATRON_MODULES)
    logging.getLogger(MEGATRON_LOGGER).setLevel(logging.ERROR)
    return True
