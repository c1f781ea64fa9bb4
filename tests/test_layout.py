"""The package holds what production imports: no test helper under megatron_pp_ext/, the
plugin's schedule path (runtime, integration) loads no CPU shim, and torch.cuda is touched in
two files only (the device helper, and the shims `train` applies on a machine without a GPU)."""

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "megatron_pp_ext"


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def test_no_module_of_the_package_imports_test_code():
    offenders = {}
    for path in PACKAGE.rglob("*.py"):
        bad = {name for name in _imports(path)
               if name.split(".")[0] in ("pytest", "support", "tests", "conftest")}
        if bad:
            offenders[str(path.relative_to(PACKAGE))] = sorted(bad)
    assert offenders == {}


def test_torch_cuda_appears_in_the_device_helper_and_the_cpu_shims_only():
    """device.py calls it; the CPU shims stand in for it on the CPU only: Megatron-Core's model
    code's (cpu_shims) and Megatron-LM's loop's (megatron_lm_cpu, which verify and the tests
    apply to rank processes on the CPU)."""
    touching = sorted(str(path.relative_to(PACKAGE)) for path in PACKAGE.rglob("*.py")
                      if "torch.cuda" in path.read_text())
    assert touching == ["device.py", "train/cpu_shims.py", "train/megatron_lm_cpu.py"]


def test_the_schedule_path_loads_no_cpu_shim_and_leaves_torch_cuda_alone():
    code = (
        "import sys, torch\n"
        "before = {n: getattr(torch.cuda, n) for n in ('current_device', 'synchronize', "
        "'current_stream')}\n"
        "import megatron_pp_ext\n"
        "from megatron_pp_ext.integration import forward_backward, install, megatron_args, auto\n"
        "from megatron_pp_ext.runtime import executor, transport, wgrad, trace\n"
        "megatron_pp_ext.install('zb-h1').uninstall()\n"
        "loaded = sorted(m for m in sys.modules if m.startswith('megatron_pp_ext.'))\n"
        "assert 'megatron_pp_ext.train.cpu_shims' not in loaded, loaded\n"
        "assert not any(m.startswith(('megatron_pp_ext.train', 'megatron_pp_ext.models')) "
        "for m in loaded), loaded\n"
        "assert all(getattr(torch.cuda, n) is f for n, f in before.items())\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


def _compile_state(rank: int, world_size: int) -> dict:
    import megatron.core.jit
    import torch

    from megatron_pp_ext.integration import megatron_import

    return {"dynamo_loaded": "torch._dynamo" in sys.modules,
            "fusions_compiled": megatron.core.jit.jit_fuser is not megatron_import._compile_nothing,
            "torch_compile_restored": torch.compile is not megatron_import._compile_nothing}


def test_train_ranks_import_megatron_without_compiling_its_fusions_on_the_cpu():
    """A rank forked from the process server (which preloads ``train.preload`` before
    Megatron): Megatron's fusions are plain functions (not compiled: 2.8 s of CPU per process),
    ``torch.compile`` is torch's own again, and TorchDynamo, which torch.optim imports in every
    rank that builds an optimizer, came with the server (imported after Megatron)."""
    from megatron_pp_ext.train.processes import spawn

    (state,) = spawn(1, _compile_state, timeout_s=120)
    assert state == {"dynamo_loaded": True, "fusions_compiled": False,
                     "torch_compile_restored": True}
