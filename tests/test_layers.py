"""The package's layers import one way: ir <- schedules <- analysis <- runtime <- integration (the
drop-in) <- planner <- commands / train / models (docs/architecture.md): the planner uses the
drop-in's modules, the drop-in never the planner. The test reads every module's imports
(those inside functions too, with the AST, without importing anything) and fails on one that
reaches a higher layer, and on an import of the package's own modules inside a function that
is not one of the listed start-up costs. Pure: no torch."""

import ast
from pathlib import Path

import megatron_pp_ext

PACKAGE = Path(megatron_pp_ext.__file__).parent

#: the layer of each top-level module or folder of the package (the package root, which
#: re-exports the public names, sits above everything)
LAYERS = {
    "ir": 0, "timeline": 0, "program": 0, "units": 0,
    "schedules": 1,
    "analysis": 2,
    "runtime": 3, "device": 3, "megatron_compat": 3,
    "integration": 4,
    "planner": 5,
    "models": 6, "train": 6, "verify": 6, "commands": 6, "cli": 6, "__main__": 6, "run": 6,
}
ROOT_LAYER = 7

#: upward imports still there, each with the reason and what removes it (none today); the test
#: fails when one of them disappears too, so the list only shrinks
KNOWN_UPWARD: dict[tuple[str, str], str] = {}


#: the package's own modules imported inside a function, each to keep a start-up cost off the
#: path that does not need it; the test fails on a new one and on one that disappears
_RANK_ONLY = "imported in a rank's process (torch, Megatron), not by the parent that loads this"
DEFERRED: dict[tuple[str, str], str] = {
    ("commands.plan", "planner.pretrain_plan"):
        "Megatron-LM's argument parser (seconds to import): only `plan` reads it",
    ("commands.simulate", "planner.pretrain_plan"):
        "Megatron-LM's argument parser: only `simulate -- <pretrain_gpt.py args>` reads it",
    ("commands.common", "planner.pretrain_select"):
        "Megatron-LM's argument parser: only `select/compare -- <pretrain_gpt.py args>` read it",
    ("commands.select", "planner.parallel_search"):
        "Megatron-LM's argument parser: only `select --search-parallelism` reads it",
    ("commands.select", "planner.parallel_search_report"):
        "Megatron-LM's argument parser: only `select --search-parallelism` reads it",
    ("commands.train", "train.launcher"): "torch and Megatron: only `train` runs them",
    ("commands.verify", "verify.launch"): "torch and Megatron: only `verify` runs them",
    ("integration.megatron_args", "integration.install"):
        "install() patches megatron.training; the argument group is read without it",
    ("train.async_loop", "models.tiny_gpt"): _RANK_ONLY,
    ("train.async_loop", "runtime.pipedream"): _RANK_ONLY,
    ("train.async_loop", "runtime.transport"): _RANK_ONLY,
    ("train.async_loop", "train.data"): _RANK_ONLY,
    ("train.async_loop", "train.processes"): _RANK_ONLY,
    ("train.launcher", "device"): "the launcher's process starts ranks, no torch",
    ("train.loop", "models.tiny_gpt"): "Megatron, imported once its warnings are hidden",
    ("train.loop", "train.cpu_shims"): "Megatron, imported once its warnings are hidden",
    ("train.loop", "train.processes"): "Megatron, imported once its warnings are hidden",
    ("train.loop", "integration.install"): "Megatron, imported once its warnings are hidden",
    ("train.processes", "train.cpu_shims"): "torch: the parent process that spawns imports none",
    ("run", "integration.install"): "Megatron: `python -m megatron_pp_ext.run` loads it to run",
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _imports(path: Path, module: str, is_package: bool, inside_functions: bool = False):
    """(imported module relative to the package, line) for every import of the package (only
    those inside functions with ``inside_functions``)."""
    tree = ast.parse(path.read_text())
    nodes = ast.walk(tree)
    if inside_functions:
        nodes = (node for fn in ast.walk(tree)
                 if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
                 for node in fn.body for node in ast.walk(node))
    for node in nodes:
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if module else []
                if not is_package:
                    base = base[:-1]
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            elif node.module and node.module.startswith("megatron_pp_ext"):
                target = node.module[len("megatron_pp_ext"):].lstrip(".")
            else:
                continue
            for alias in node.names:  # `from . import install` names a module
                sub = f"{target}.{alias.name}" if target else alias.name
                yield (sub if (PACKAGE / (sub.replace(".", "/") + ".py")).exists()
                       or (PACKAGE / sub.replace(".", "/")).is_dir() else target), node.lineno
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("megatron_pp_ext"):
                    yield alias.name[len("megatron_pp_ext"):].lstrip("."), node.lineno


def _layer(module: str) -> int:
    if not module:
        return ROOT_LAYER
    top = module.split(".")[0]
    assert top in LAYERS, f"megatron_pp_ext.{top} has no layer: add it to LAYERS"
    return LAYERS[top]


def _upward() -> dict[tuple[str, str], list[str]]:
    found: dict[tuple[str, str], list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        module = _module_name(path)
        for target, line in _imports(path, module, path.name == "__init__.py"):
            if _layer(target) > _layer(module):
                found.setdefault((module, target), []).append(
                    f"megatron_pp_ext/{path.relative_to(PACKAGE)}:{line}")
    return found


def test_no_module_imports_a_higher_layer():
    upward = _upward()
    new = {edge: where for edge, where in upward.items() if edge not in KNOWN_UPWARD}
    assert not new, "upward imports (move the shared piece down instead):\n" + "\n".join(
        f"  {a} -> {b} at {', '.join(where)}" for (a, b), where in sorted(new.items()))
    gone = set(KNOWN_UPWARD) - set(upward)
    assert not gone, f"no longer imported upward, remove from KNOWN_UPWARD: {sorted(gone)}"


def test_imports_inside_functions_are_the_listed_start_up_costs():
    found: dict[tuple[str, str], list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        module = _module_name(path)
        for target, line in _imports(path, module, path.name == "__init__.py", True):
            found.setdefault((module, target), []).append(f"megatron_pp_ext/{path.relative_to(PACKAGE)}:{line}")
    new = {edge: where for edge, where in found.items() if edge not in DEFERRED}
    assert not new, "imports inside functions (import at the top, or list the start-up cost):\n" \
        + "\n".join(f"  {a} -> {b} at {', '.join(w)}" for (a, b), w in sorted(new.items()))
    assert not set(DEFERRED) - set(found), sorted(set(DEFERRED) - set(found))


def test_the_walk_sees_function_level_and_relative_imports(tmp_path):
    """The checker itself: a relative import inside a function is found and resolved."""
    source = tmp_path / "probe.py"
    source.write_text("def f():\n    from ..runtime.executor import Executor\n"
                      "from .. import install\nfrom ..ir import Action\n")
    found = sorted(_imports(source, "analysis.probe", False), key=lambda item: item[1])
    assert found == [("runtime.executor", 2), ("", 3), ("ir", 4)]  # "": the package root
    assert list(_imports(source, "analysis.probe", False, True)) == [("runtime.executor", 2)]
    assert _layer("runtime.executor") > _layer("analysis.probe")
    assert _layer("") == ROOT_LAYER


def test_the_commands_that_only_predict_load_no_torch():
    """simulate, select and compare draw and rank schedules from the IR alone, and PipeDream's
    builders and version plan are pure: none loads torch or Megatron (`plan` and `select --
    ARGS` read Megatron's parser, and load it then, inside the command)."""
    import subprocess
    import sys

    code = ("import contextlib, io, sys\n"
            "from megatron_pp_ext.cli import main\n"
            "from megatron_pp_ext.schedules import build_async_schedule\n"
            "from megatron_pp_ext.schedules.pipedream import plan_versions\n"
            "plan_versions(build_async_schedule('pipedream', 4, 8, vertical_sync=True))\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            "    main(['simulate', '--schedule', 'zb-v', '-p', '2', '-m', '4'])\n"
            "    main(['select', '-p', '2', '-m', '4', '--memory-budget', '1GiB',\n"
            "          '--activation', '1MiB'])\n"
            "    main(['compare', '-p', '2', '-m', '4'])\n"
            "loaded = [m for m in ('torch', 'megatron') if m in sys.modules]\n"
            "assert not loaded, loaded\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
