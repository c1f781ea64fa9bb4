"""The compatibility layer (``megatron_pp_ext.megatron_compat``): the one module that reaches
Megatron's private names and the names that differ between the supported releases.

The import check reads the package and ``scripts/`` with the AST (nothing imported) and fails
on a private Megatron name anywhere but the compatibility module: imported (``from megatron.x
import _y``), read off an imported Megatron module (``parallel_state._X``), or named to
``getattr`` / ``setattr`` / ``hasattr`` on one. The other tests hold the entries to the
installed release (``scripts/test.sh`` runs this module on each release of the window)."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import megatron_pp_ext
from megatron_pp_ext import megatron_compat

PACKAGE = Path(megatron_pp_ext.__file__).parent
SCRIPTS = PACKAGE.parent / "scripts"
COMPAT = PACKAGE / "megatron_compat.py"


def _private_megatron_names(source: str) -> list[tuple[int, str]]:
    tree = ast.parse(source)
    megatron_aliases: set[str] = set()
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and (
                node.module == "megatron" or node.module.startswith("megatron.")):
            for alias in node.names:
                if alias.name.startswith("_"):
                    found.append((node.lineno, f"from {node.module} import {alias.name}"))
                megatron_aliases.add(alias.asname or alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "megatron" or alias.name.startswith("megatron."):
                    megatron_aliases.add(alias.asname or alias.name.split(".")[0])
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                and node.value.id in megatron_aliases and node.attr.startswith("_") \
                and not node.attr.startswith("__"):
            found.append((node.lineno, f"{node.value.id}.{node.attr}"))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                and node.func.id in ("getattr", "setattr", "hasattr", "delattr") \
                and len(node.args) >= 2 and isinstance(node.args[0], ast.Name) \
                and node.args[0].id in megatron_aliases \
                and isinstance(node.args[1], ast.Constant) \
                and isinstance(node.args[1].value, str) and node.args[1].value.startswith("_"):
            found.append((node.lineno, f"{node.func.id}({node.args[0].id}, "
                                       f"{node.args[1].value!r})"))
    return sorted(found)


def test_private_megatron_names_only_in_the_compatibility_module():
    offenders = []
    for path in sorted([*PACKAGE.rglob("*.py"), *SCRIPTS.rglob("*.py")]):
        if path == COMPAT:
            continue
        for line, what in _private_megatron_names(path.read_text()):
            offenders.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {what}")
    assert not offenders, ("private Megatron names outside megatron_pp_ext/megatron_compat.py "
                           "(add an entry there):\n  " + "\n  ".join(offenders))
    # and the compatibility module does reach them (the check is not vacuous there)
    assert len(_private_megatron_names(COMPAT.read_text())) >= 3


def test_the_check_finds_each_form():
    source = ("from megatron.core.pipeline_parallel.schedules import _build, forward_step\n"
              "from megatron.core import parallel_state\n"
              "import megatron.core.utils as mutils\n"
              "def f(x):\n"
              "    a = parallel_state._MPU_RANK\n"
              "    b = getattr(parallel_state, '_MPU_RANK', None)\n"
              "    c = x._private  # not a Megatron module: an object's attribute\n"
              "    setattr(mutils, '_y', 1)\n"
              "    return parallel_state.get_rank(), mutils.__name__\n")
    assert _private_megatron_names(source) == [
        (1, "from megatron.core.pipeline_parallel.schedules import _build"),
        (5, "parallel_state._MPU_RANK"),
        (6, "getattr(parallel_state, '_MPU_RANK')"),
        (8, "setattr(mutils, '_y')"),
    ]


#: the form of megatron.training.pretrain() by release line (docs/megatron-versions.md)
PRETRAIN_FORM = {"0.17": "args", "0.18": "provider", "0.19": "config", "0.20": "config"}


def _release_line() -> str:
    return ".".join(megatron_compat.megatron_core_version().split(".")[:2])


def test_the_installed_release_is_in_the_window_and_its_forms_are_detected():
    megatron_compat.check_supported()  # raises outside the window
    line = _release_line()
    assert line in PRETRAIN_FORM, f"megatron-core {line} is not a release of the window"
    assert megatron_compat.pretrain_form() == PRETRAIN_FORM[line]
    from megatron.training import argument_utils, arguments

    # 0.17's pretrain() parses its own arguments: no parse_and_validate_args, no container
    if line == "0.17":
        with pytest.raises(megatron_compat.UnsupportedMegatronError, match="parses its own"):
            megatron_compat.parse_and_validate_args()
        with pytest.raises(megatron_compat.UnsupportedMegatronError, match="first appears"):
            megatron_compat.pretrain_config_container(None)
    else:
        assert hasattr(arguments, "parse_and_validate_args")
    assert hasattr(argument_utils, "gpt_config_from_args") == (line >= "0.19")


def test_padded_vocab_size_is_megatrons_on_every_release():
    # 50257 tokens, divisible by 128 x tp 2: Megatron pads to the next multiple of 256
    assert megatron_compat.padded_vocab_size(50257, 128, 2) == 50432
    assert megatron_compat.padded_vocab_size(128, 128, 1) == 128


def test_max_stat_passes_a_group_only_where_the_original_takes_one():
    calls = []

    def old(stat):  # 0.17 / 0.18
        calls.append(("old", stat))
        return stat

    def new(stat, group=None):  # 0.19+
        calls.append(("new", stat, group))
        return stat

    megatron_compat.call_max_stat(old, 1.5)
    megatron_compat.call_max_stat(new, 2.5)
    megatron_compat.call_max_stat(new, 3.5, "g")
    assert calls == [("old", 1.5), ("new", 2.5, None), ("new", 3.5, "g")]


def test_whole_batch_keywords_follow_the_batch_helpers_signature():
    def helper_018(data_iterator, *, pipeline_model_parallel_size=None, mtp_on_this_rank=False):
        pass

    def helper_017(data_iterator, mtp_on_this_rank=False):
        pass

    assert megatron_compat.whole_batch_kwargs(helper_018) == {"pipeline_model_parallel_size": 1}
    assert megatron_compat.whole_batch_kwargs(helper_017) == {"mtp_on_this_rank": True}
    # the helper pretrain_gpt.py imports: megatron.training.utils in 0.17, megatron.core.utils
    # from 0.18 on
    if _release_line() == "0.17":
        from megatron.training.utils import get_batch_on_this_tp_rank

        expected = {"mtp_on_this_rank": True}
    else:
        from megatron.core.utils import get_batch_on_this_tp_rank

        expected = {"pipeline_model_parallel_size": 1}
    assert megatron_compat.whole_batch_kwargs(get_batch_on_this_tp_rank) == expected


def test_install_outside_the_window_names_the_supported_releases():
    """megatron-core 0.16.1 (its wheel put first on the path, support.megatron_releases):
    ``import megatron_pp_ext`` works and ``install()`` refuses before patching anything, naming
    the window."""
    from support.megatron_releases import overlay

    code = ("import megatron_pp_ext\n"
            "from megatron.core.pipeline_parallel import schedules\n"
            "before = schedules.forward_backward_pipelining_without_interleaving\n"
            "try:\n"
            "    megatron_pp_ext.install('1f1b')\n"
            "except RuntimeError as error:\n"
            "    print('REFUSED', type(error).__name__, error)\n"
            "assert schedules.forward_backward_pipelining_without_interleaving is before\n"
            "from megatron_pp_ext.integration.install import installed\n"
            "assert not installed()\n")
    env = {"PYTHONPATH": str(overlay("0.16.1")), "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True,
                          text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    refusal = [line for line in proc.stdout.splitlines() if line.startswith("REFUSED")]
    assert refusal == [
        "REFUSED UnsupportedMegatronError megatron-core 0.16.1 is not supported: "
        "megatron_pp_ext supports " + megatron_compat.SUPPORTED_WINDOW + " (this release's "
        "backward_step takes (input_tensor, output_tensor, output_tensor_grad, model_type, "
        "config); 0.17 dropped model_type). Install one of them, e.g. "
        "`pip install 'megatron-core>=0.17,<0.20'`."]
