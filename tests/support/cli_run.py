"""A ``python -m megatron_pp_ext`` command run in this process: what it prints, its exit status.

A fresh interpreter costs 1.5-6 s of CPU per call (Python, the package, numpy, for some
commands Megatron's parser), which dozens of calls in the suite paid for nothing: the commands
that only build, simulate and print (simulate, demo, compare, select, plan) do the same here.
What a fresh process does on top (no torch loaded for the commands that predict, Megatron's
import warnings kept out) is held by tests/test_layers.py and test_plan.py's
``test_cli_plan_prints_the_plan_and_writes_the_timeline``, which keep a process of their own.
"""

from __future__ import annotations

import contextlib
import io
import subprocess


def cli_in_process(*args, cwd=None) -> subprocess.CompletedProcess:
    """``python -m megatron_pp_ext *args`` here (in ``cwd``, default this process's)."""
    from megatron_pp_ext.cli import main

    out, err = io.StringIO(), io.StringIO()
    folder = contextlib.chdir(cwd) if cwd is not None else contextlib.nullcontext()
    with folder, contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main([str(a) for a in args])
        except SystemExit as exited:  # argparse's usage errors
            code = exited.code if isinstance(exited.code, int) else 2
    return subprocess.CompletedProcess(["megatron_pp_ext", *args], code, out.getvalue(),
                                       err.getvalue())
