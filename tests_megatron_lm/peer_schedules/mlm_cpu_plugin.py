"""A pytest plugin that runs Megatron-LM's own pipeline schedule tests on the CPU, each rank
one pytest process under torchrun (gloo), optionally with megatron_pp_ext installed.

Loaded by ``run_peer_tests.py`` as ``pytest --noconftest -p mlm_cpu_plugin`` (Megatron-LM's
``tests/unit_tests/conftest.py`` is left out: it downloads test data to /opt/data and sets
NCCL variables; the two fixtures of it these tests rely on are re-created below).

Environment:
  MEGATRON_PP_SCHEDULE  when set (e.g. ``1f1b``, ``interleaved``, ``zb-h1``), the plugin's
                        ``megatron_pp_ext.install(schedule=...)`` runs before any test.
  MLM_PEER_FIX_NEW_GROUP=1
                        replace the test file's helper ``_populate_embedding_and_position_groups``
                        by one that creates the same groups the way torch requires (see
                        ``_embedding_groups_every_rank``); off by default: the tests run as they
                        are written.
  MLM_PEER_OUT          a directory: each rank writes ``rank<R>.json`` with every test's
                        outcome (and the error text of failures) there.

Every patch is for the CPU only and has its reason on its line. None of it is Megatron-LM
code; the tests themselves are imported unchanged from the checkout.
"""

from __future__ import annotations

import datetime
import faulthandler
import json
import os
import signal
import sys

import pytest
import torch
import torch.distributed as dist

_RESULTS: dict[str, dict] = {}
_STACKS = None
_SCHEDULE = os.environ.get("MEGATRON_PP_SCHEDULE") or None


def _cpu_patches() -> None:
    # Utils.initialize_distributed calls torch.cuda.set_device(rank % device_count()): with 0
    # devices that is a ZeroDivisionError, so the CPU counts as one device ...
    torch.cuda.device_count = lambda: 1
    # ... and "setting" it does nothing.
    torch.cuda.set_device = lambda device: None
    # The tests make their activations with torch.rand(...).cuda(): keep them on the CPU.
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    # Utils.initialize_distributed asks for backend='nccl'; gloo is the CPU's backend. A
    # bounded timeout turns a hang into an error that names the operation.
    original_init = dist.init_process_group

    def init_process_group(*args, **kwargs):
        if kwargs.get("backend") == "nccl":
            kwargs["backend"] = "gloo"
        kwargs.setdefault("timeout", datetime.timedelta(
            seconds=float(os.environ.get("MLM_PEER_PG_TIMEOUT_S", "120"))))
        return original_init(*args, **kwargs)

    dist.init_process_group = init_process_group
    # torch.cuda.current_device / synchronize / current_stream, the CUDA RNG tracker and the
    # schedules' torch.zeros(..., device="cuda") for total_num_tokens: the package's own CPU
    # shims (megatron_pp_ext/train/cpu_shims.py, reasons there).
    from megatron_pp_ext.train.cpu_shims import apply_cpu_shims

    assert apply_cpu_shims(), "the CPU shims did not apply (is there a GPU?)"


def pytest_configure(config):
    out = os.environ.get("MLM_PEER_OUT")
    if out:  # the runner dumps every thread's stack on a hang (a file: pytest captures fd 2)
        global _STACKS
        _STACKS = open(os.path.join(out, f"rank{os.environ.get('RANK', '0')}.stacks"), "w")
        faulthandler.register(signal.SIGUSR1, file=_STACKS, all_threads=True)
    _cpu_patches()
    import megatron.core.pipeline_parallel.schedules  # noqa: F401  (install patches its names)

    if _SCHEDULE:
        import megatron_pp_ext

        megatron_pp_ext.install(schedule=_SCHEDULE)
    import megatron.core

    print(f"[mlm_cpu_plugin] rank {os.environ.get('RANK')}: megatron.core from "
          f"{os.path.dirname(megatron.core.__file__)}; schedule {_SCHEDULE or 'Megatron'}",
          file=sys.stderr)


@pytest.fixture(autouse=True)
def experimental():
    """Megatron-LM's conftest fixture of the same name: the experimental flag off."""
    from megatron.core import config

    config.ENABLE_EXPERIMENTAL = False


@pytest.fixture(scope="session", autouse=True)
def cleanup():
    """Megatron-LM's conftest fixture of the same name: leave the process group at the end."""
    yield
    if dist.is_initialized():
        try:
            dist.barrier()
        except Exception:
            return
        dist.destroy_process_group()


def _embedding_groups_every_rank(pp_group):
    """The groups of the test helper ``_populate_embedding_and_position_groups`` (this rank's
    pipeline: [first] and [first, last]), created the way ``dist.new_group`` requires: every
    rank creates every pipeline's groups, in the same order. The helper as written has each
    pipeline pass its own ranks, so at tp=2 the two pipelines' groups get the same name (torch
    counts groups per process) and gloo's rendezvous keys in the store collide: a rank may
    connect to the other pipeline (new_group_race.py reproduces it with torch alone)."""
    mine = sorted(dist.get_process_group_ranks(pp_group))
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    pipelines = list(dict.fromkeys(tuple(ranks) for ranks in everyone))
    pos_embd_pg = embd_pg = None
    for ranks in pipelines:
        embd_ranks = [ranks[0]] + ([ranks[-1]] if ranks[-1] != ranks[0] else [])
        pos, embd = dist.new_group(ranks=[ranks[0]]), dist.new_group(ranks=embd_ranks)
        if list(ranks) == mine:
            pos_embd_pg, embd_pg = pos, embd
    return pos_embd_pg, embd_pg


def pytest_collection_finish(session):
    if os.environ.get("MLM_PEER_FIX_NEW_GROUP") == "1":
        for module in list(sys.modules.values()):
            if hasattr(module, "_populate_embedding_and_position_groups"):
                module._populate_embedding_and_position_groups = _embedding_groups_every_rank


def pytest_runtest_logreport(report):
    entry = _RESULTS.setdefault(report.nodeid, {"outcome": "passed"})
    if report.failed:
        entry["outcome"] = "failed" if report.when == "call" else "error"
        entry["error"] = (report.longreprtext or "")[-3000:]
    elif report.skipped and report.when in ("setup", "call"):
        entry["outcome"] = "skipped"
    if report.when == "teardown":
        _write_results()  # after every test: a run killed later keeps what finished


def pytest_sessionfinish(session, exitstatus):
    _write_results()


def _write_results():
    out = os.environ.get("MLM_PEER_OUT")
    if out:
        rank = os.environ.get("RANK", "0")
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump({"schedule": _SCHEDULE, "results": _RESULTS}, f, indent=1)
