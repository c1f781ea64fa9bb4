"""Megatron-LM's own ``pretrain_gpt.py`` (with ``model_provider.py`` and ``gpt_builders.py``), the
script users launch, for the megatron-core release this process runs.

The files are NVIDIA's, unchanged, one folder per release of the supported window, in the
project's shared folder (``shared/megatron-lm/<version>/``, beside the checkout); they are test
fixtures and are not copied into the project. :func:`scripts_folder` finds the release's folder
(``$MEGATRON_LM_SCRIPTS`` first), :func:`run_pretrain_gpt_pp` runs what
``scripts/pretrain_gpt_pp.py`` runs (the plugin's flag around that script,
``integration.pretrain_gpt_script``) in this process, as ``python scripts/pretrain_gpt_pp.py
<argv>`` would under torchrun.
"""

from __future__ import annotations

import os
import sys
import types
from pathlib import Path
from typing import Sequence

ROOT = Path(__file__).resolve().parents[2]
#: a folder holding <version>/pretrain_gpt.py for each release (else the shared folder is
#: looked for beside the checkout and above it)
SCRIPTS_ENV = "MEGATRON_LM_SCRIPTS"
#: a Megatron-LM checkout's root, whose own scripts serve whatever its megatron-core is
#: (scripts/check_megatron_tree.sh sets it: main has no copy in the shared folder)
CHECKOUT_ENV = "MEGATRON_LM_SCRIPT_DIR"
_FILES = ("pretrain_gpt.py", "model_provider.py", "gpt_builders.py")


def _candidates() -> list[Path]:
    if os.environ.get(SCRIPTS_ENV):
        return [Path(os.environ[SCRIPTS_ENV])]
    # the checkout's shared folder (../shared), or one above a clone made inside the workplace
    found = [parent / "shared" / "megatron-lm" for parent in ROOT.parents]
    return found + [Path("/work/shared/megatron-lm")]


def release_line_version() -> str:
    """The megatron-core release this process imports, without a local suffix (0.19.2)."""
    from megatron_pp_ext.megatron_compat import megatron_core_version

    return megatron_core_version().split("+")[0]


def scripts_folder(version: str | None = None) -> Path:
    """``shared/megatron-lm/<version>/`` for ``version`` (default: the imported release);
    raises, naming where it looked, when there is none (a test then fails, saying so)."""
    checkout = os.environ.get(CHECKOUT_ENV)
    if checkout and version is None:
        if all((Path(checkout) / name).is_file() for name in _FILES):
            return Path(checkout)
        raise FileNotFoundError(f"{CHECKOUT_ENV}={checkout} has no {' / '.join(_FILES)}")
    version = version or release_line_version()
    looked = []
    for base in _candidates():
        folder = base / version
        if all((folder / name).is_file() for name in _FILES):
            return folder
        looked.append(str(folder))
    raise FileNotFoundError(
        f"Megatron-LM's pretrain_gpt.py for megatron-core {version} is in none of {looked}: "
        f"set {SCRIPTS_ENV} to the folder that holds <version>/pretrain_gpt.py "
        "(the project's shared/megatron-lm)")


def _legacy_model_stand_in() -> None:
    """0.17's ``model_provider.py`` and ``gpt_builders.py`` import ``megatron.legacy.model``
    (used only with --use-legacy-models), which is in Megatron-LM's repository but not in the
    0.17 wheel: a stand-in module, whose GPTModel refuses to be built, lets them import."""
    try:
        import megatron.legacy.model  # noqa: F401
        return
    except ImportError:
        pass

    class GPTModel:  # noqa: D401 - a stand-in
        def __init__(self, *args, **kwargs):
            raise RuntimeError("megatron.legacy.model is a test stand-in: --use-legacy-models "
                               "needs Megatron-LM's repository")

    import megatron

    legacy = sys.modules.setdefault("megatron.legacy", types.ModuleType("megatron.legacy"))
    model = types.ModuleType("megatron.legacy.model")
    model.GPTModel = GPTModel
    legacy.model, megatron.legacy = model, legacy
    sys.modules["megatron.legacy.model"] = model


def put_scripts_on_path(version: str | None = None) -> Path:
    """The release's ``pretrain_gpt.py`` importable as ``pretrain_gpt`` (as PYTHONPATH would
    make it); returns its folder."""
    folder = scripts_folder(version)
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
    _legacy_model_stand_in()
    return folder


def run_pretrain_gpt_pp(argv: Sequence[str], on_args=None) -> None:
    """``python scripts/pretrain_gpt_pp.py <argv>`` in this process (a rank of a gloo launch:
    RANK, WORLD_SIZE and the rendezvous in its environment), over the imported release's own
    ``pretrain_gpt.py``; ``on_args(args)`` once the arguments are validated."""
    from megatron_pp_ext.integration.pretrain_gpt_script import run_pretrain_gpt

    put_scripts_on_path()
    sys.argv = ["pretrain_gpt_pp.py", *argv]
    run_pretrain_gpt(on_args=on_args)
