"""Shared pytest setup. Keep it small."""

import os
import shutil
import tempfile

import pytest


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "megatron_cpu: multi-process gloo test that trains the tiny Megatron-Core GPT on the CPU",
    )
    config.addinivalue_line(
        "markers", "release_window: run on every megatron-core release of the supported window "
        "(conftest.RELEASE_WINDOW; scripts/test.sh)")
    _share_runs_across_workers(config)
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):
        return  # pytest-xdist's controller: its workers run the tests (and import torch)
    # The ranks of the tests' Megatron-LM loop runs import megatron.training (~0.5 s each) and
    # repeat work that support.forkserver_warmup does once: the tests' process server imports
    # both before forking them, and pytest, which a rank running a test module's function
    # imports with it. (The `train` command's own server does not: its ranks never import them.)
    from megatron_pp_ext.train import processes

    processes.preload("megatron.training", "pytest", "support.forkserver_warmup")
    # One index cache of the mock dataset for the session's Megatron-LM loop runs (ranks fork
    # from the server, which is started later and inherits this environment).
    from support.megatron_loop import MOCK_CACHE_ENV

    cache = tempfile.mkdtemp(prefix="megatron-pp-mock-cache-")
    os.environ[MOCK_CACHE_ENV] = cache
    config.add_cleanup(lambda: shutil.rmtree(cache, ignore_errors=True))


def _share_runs_across_workers(config) -> None:
    """One folder a session for ``support.shared_runs``: made by the process that configures
    first (pytest-xdist's controller, whose workers inherit its environment, or the only
    process) and removed by it at the end."""
    from support.shared_runs import SHARED_RUNS_ENV

    if os.environ.get(SHARED_RUNS_ENV):
        return  # a worker: the controller's folder
    folder = tempfile.mkdtemp(prefix="megatron-pp-shared-runs-")
    os.environ[SHARED_RUNS_ENV] = folder
    config.add_cleanup(lambda: shutil.rmtree(folder, ignore_errors=True))
    config.add_cleanup(lambda: os.environ.pop(SHARED_RUNS_ENV, None))


#: test modules by their total time, most first (measured with -n 2 on 2 cores, 2026-12-02
#: 23:00), except that the CPU-heavy multi-process ones come right after test_slurm, whose
#: worker mostly waits on SLURM (single-process modules that sleep beside it left a core idle):
#: the suite's xdist workers take whole modules in collection order (--dist loadscope
#: --no-loadscope-reorder; xdist's default reorder is by number of tests), so the long ones go
#: out first (and test_pretrain_loop's runs are there for the later modules that share them:
#: support.shared_runs) and the last minute is made of short modules that both workers share
#: (rather than one worker finishing a 60 s module while the other waits); a module's fixtures
#: are built once, on its worker. Others keep their order.
LONGEST_FIRST = (
    "test_slurm", "test_pretrain_loop", "test_verify", "test_pretrain_gpt_script",
    "test_post_validation", "test_nccl_rules",
    "test_train_cli", "test_nccl_rules_gloo", "test_memory_train",
    "test_megatron_cpu_reference", "test_moe", "test_failures", "test_checkpoint_resume",
    "test_lowering_pass", "test_wgrad_layers", "test_pipedream_train", "test_model_costs",
    "test_runtime_megatron", "test_fuzz", "test_executor_inmemory", "test_plan", "test_install",
    "test_html_browser", "test_validate", "test_render_cli", "test_gpu_check", "test_layout",
    "test_auto", "test_controllable_memory",
)


#: what the release matrix runs on the window's other releases (scripts/test.sh: ``pytest -m
#: release_window`` with that release's wheel first on PYTHONPATH,
#: support.megatron_releases): (a module, or ``module::test`` and a prefix of its parameters;
#: the release lines it runs on, None for all). The drop-in against that release's own 1F1B
#: and interleaved, install/uninstall and the arguments, the compatibility layer, and the
#: Megatron-LM loop cases through that release's own pretrain_gpt.py: every schedule of the
#: flag against its own schedule, dualpipe with the flags users combine (TP 2 + SP and
#: evaluation, recompute, fp16, tied embeddings with per-token loss, MoE with the overlap flag,
#: MTP, a 1F1B checkpoint resumed), post-validation, MTP under zb-v and zb-h1; DDP's
#: grad-ready counts relearned. Megatron's own interleaved schedule gives NaN gradients at the
#: third step of the loop on 0.17 (docs/megatron-versions.md), so the loop's interleaved
#: baseline is not run there.
RELEASE_WINDOW = (
    ("test_megatron_compat", None),
    ("test_install", None),
    ("test_runtime_megatron", None),
    ("test_megatron_peer_regressions", None),
    ("test_megatron_args", None),
    ("test_pretrain_loop::test_megatron_own_schedules_train", ("0.18", "0.19", "0.20")),
    # every schedule the flag offers, through the release's own pretrain_gpt.py, against its
    # own schedule (issue 59: pp 2, one replica); interleaved against Megatron's own
    # interleaved, whose baseline 0.17 does not train
    *((f"test_pretrain_gpt_script::test_every_schedule_trains_as_megatrons_own_schedule"
       f"[{case}]", ("0.18", "0.19", "0.20") if case == "interleaved" else None)
      for case in ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2", "zb-v", "v-half",
                   "v-min", "zb-auto", "dualpipev", "dualpipe")),
    ("test_pretrain_loop::test_dualpipe_trains_as_megatrons_1f1b", None),
    ("test_pretrain_loop::test_dualpipe_with_tied_embeddings_and_per_token_loss", None),
    *((f"test_pretrain_gpt_script::test_entry_and_exit_ranks_train_as_megatrons_1f1b"
       f"[{combo}-dualpipe]", None)
      for combo in ("tp2-sp-eval", "full-recompute-fp16", "selective-recompute")),
    ("test_checkpoint_resume::test_a_1f1b_checkpoint_resumes_under_dualpipe", None),
    ("test_moe::test_zb_v_with_the_flag_runs_every_f_and_i_through_the_plan_bit_identical",
     None),
    ("test_post_validation::test_pretrain_flag_bit_identical_to_megatron_step", None),
    # MTP (issue 41): the V layout's model and the W's one sum per weight on each release
    ("test_pretrain_loop::test_mtp_trains_as_megatrons_1f1b[zb-v-1]", None),
    ("test_pretrain_loop::test_mtp_trains_as_megatrons_1f1b[zb-h1-1]", None),
    # dualpipe: 0.17 and 0.18 pass the provider no config (a builder makes it from the
    # arguments) and track MTP losses under other keys
    ("test_pretrain_loop::test_mtp_trains_as_megatrons_1f1b[dualpipe-1]", None),
    ("test_moe::test_dualpipe_trains_the_moe_gpt_as_megatrons_1f1b_with_and_without_the_flag",
     None),
    ("test_auto::test_a_schedule_switch_relearns_megatron_ddps_grad_ready_counts", None),
)


def _in_release_window(item, line: str) -> bool:
    name = f"{item.path.stem}::{item.name}"
    every_case = f"{item.path.stem}::{getattr(item, 'originalname', item.name)}"
    for selector, lines in RELEASE_WINDOW:
        if selector in (name, every_case, item.path.stem) and (lines is None or line in lines):
            return True
    return False


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))  # stable
    if config.getoption("-m") and "release_window" in config.getoption("-m"):
        from megatron_pp_ext.megatron_compat import megatron_core_version

        line = ".".join(megatron_core_version().split(".")[:2])
        for item in items:
            if _in_release_window(item, line):
                item.add_marker(pytest.mark.release_window)


@pytest.fixture(scope="session")
def megatron_reference():
    """``get(**run_step_kwargs)``: the pp=1 result of Megatron's ``forward_backward_no_pipelining``
    on the full tiny GPT ({"losses", "grads"} by global parameter name), computed once per
    distinct keyword set in the session (on any worker). Compare other runs with
    ``support.reference.assert_same``."""
    from megatron_pp_ext.train.processes import spawn
    from support.reference import merge_results, run_step
    from support.shared_runs import computed_once

    cache = {}

    def get(**kwargs):
        key = tuple(sorted((k, repr(v)) for k, v in kwargs.items()))
        if key not in cache:  # and once a session across workers (support.shared_runs)
            cache[key] = computed_once(("no_pipelining", key), lambda: merge_results(
                spawn(1, run_step, "no_pipelining", pp=1, timeout_s=120, **kwargs)))
        return cache[key]

    return get
