"""install() / uninstall(): Megatron's own selector hands back our function at pp > 1."""

import os
import subprocess
import sys

import pytest

import megatron_pp_ext
from megatron_pp_ext.integration.forward_backward import ScheduleFunction
from megatron_pp_ext.integration.install import (
    Installation,
    current_installation,
    install,
    installed,
    uninstall,
)


@pytest.fixture
def clean_install():
    uninstall()
    yield
    uninstall()


def _selectors():
    from megatron.core import pipeline_parallel
    from megatron.core.pipeline_parallel import schedules
    import megatron.training.training as training

    return schedules, pipeline_parallel.get_forward_backward_func, training.get_forward_backward_func


def test_install_routes_every_bound_selector_to_our_function(clean_install):
    schedules, core_selector, training_selector = _selectors()
    originals = (schedules.forward_backward_pipelining_without_interleaving,
                 schedules.forward_backward_pipelining_with_interleaving)
    assert core_selector(pp_size=4, vp_size=None) is originals[0]

    installation = install("zb-h1", max_pending_backward=3)
    assert installed() and current_installation() is installation
    assert isinstance(installation.function, ScheduleFunction)
    for selector in (core_selector, training_selector, schedules.get_forward_backward_func):
        assert selector(pp_size=4, vp_size=None) is installation.function
        assert selector(pp_size=4, vp_size=2) is installation.function
        assert selector(pp_size=1, vp_size=None) is schedules.forward_backward_no_pipelining
    assert installation.options.schedule == "zb-h1"
    assert installation.state.options.max_pending_backward == 3

    uninstall()
    assert not installed() and not installation.active and current_installation() is None
    assert core_selector(pp_size=4, vp_size=None) is originals[0]
    assert training_selector(pp_size=4, vp_size=2) is originals[1]


def test_install_twice_switches_the_schedule_without_patching_twice(clean_install):
    first = install("gpipe")
    patched = len(first.replaced)
    second = install("interleaved")
    assert second is first and len(first.replaced) == patched
    assert first.state.options.schedule == "interleaved"
    first.uninstall()
    schedules, core_selector, _ = _selectors()
    assert core_selector(pp_size=2, vp_size=None) is \
        schedules.forward_backward_pipelining_without_interleaving
    assert not isinstance(core_selector(pp_size=2, vp_size=None), ScheduleFunction)


def test_unknown_schedule_names_the_closest(clean_install):
    with pytest.raises(ValueError, match=r"unknown schedule 'zbh1'.*Did you mean 'zb-h1'"):
        install("zbh1")
    assert not installed()


def test_bad_options_are_rejected_before_anything_is_patched(clean_install):
    with pytest.raises(ValueError, match="p2p_timeout_s=0 must be > 0"):
        install("1f1b", p2p_timeout_s=0)
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['max_pending'\]"):
        install("1f1b", max_pending=2)
    assert not installed()


def test_the_package_exports_install_lazily():
    assert megatron_pp_ext.install is install
    assert megatron_pp_ext.Installation is Installation
    assert megatron_pp_ext.ScheduleFunction is ScheduleFunction


def test_environment_variable_switches_an_unmodified_script(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(
        "from megatron.core.pipeline_parallel import get_forward_backward_func\n"
        "import megatron_pp_ext\n"
        "from megatron_pp_ext.integration.install import current_installation\n"
        "f = get_forward_backward_func(pp_size=4, vp_size=None)\n"
        "print(f is current_installation().function, f.options.schedule)\n"
    )
    env = dict(os.environ, MEGATRON_PP_SCHEDULE="gpipe")
    out = subprocess.run([sys.executable, "-m", "megatron_pp_ext.run", str(script)],
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "True gpipe"


def test_split_backward_patch_lives_only_while_a_step_runs():
    """The I/W split replaces Megatron's linear-layer backward only inside a split step:
    entered by each step, put back (the very same class attribute) when the last one leaves,
    and untouched by install()/uninstall()."""
    from megatron.core.tensor_parallel.layers import (
        LinearWithGradAccumulationAndAsyncCommunication as Linear,
    )

    from megatron_pp_ext.runtime import wgrad

    original = Linear.__dict__["backward"]
    installation = install("zb-h1")
    assert Linear.__dict__["backward"] is original  # installing patches no layer
    with wgrad.deferring_linear_backward():
        assert Linear.backward is wgrad._deferring_backward
        with wgrad.deferring_linear_backward():  # a second rank's thread, same process
            assert Linear.backward is wgrad._deferring_backward
        assert Linear.backward is wgrad._deferring_backward  # still one step running
    assert Linear.__dict__["backward"] is original
    installation.uninstall()
    assert Linear.__dict__["backward"] is original


def test_two_schedule_functions_share_no_state():
    one, two = ScheduleFunction("1f1b"), ScheduleFunction("zb-h1")
    one.state.steps_run = 3
    assert two.state.steps_run == 0 and two.state is not one.state
    import pickle

    copy = pickle.loads(pickle.dumps(one))
    assert copy.options == one.options and copy.state.steps_run == 0


@pytest.mark.parametrize("given, group_timeout, want", [
    ({}, None, (1800.0, 600.0)),  # torch does not say: 600 s, the first step 3x
    ({}, 600.0, (270.0, 270.0)),  # NCCL's default 10 min: both well inside the watchdog
    ({}, 1800.0, (810.0, 600.0)),  # gloo's default 30 min
    ({"p2p_timeout_s": 60.0}, 600.0, (180.0, 60.0)),
    ({"p2p_timeout_s": 60.0, "first_step_timeout_s": 500.0}, 600.0, (500.0, 60.0)),
])
def test_timeouts_are_derived_from_the_groups_timeout(given, group_timeout, want):
    options = ScheduleFunction("1f1b", **given).options
    assert options.timeouts(group_timeout) == want
    unsafe = options.unsafe_timeouts(group_timeout)
    assert unsafe == (["first_step_timeout_s=500"] if given.get("first_step_timeout_s") else [])


def test_the_group_timeout_is_read_from_torch_and_gloo_is_never_aborted():
    code = (
        "import datetime, os, torch.distributed as dist\n"
        "from megatron_pp_ext import device\n"
        "os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT=os.environ['PORT'])\n"
        "dist.init_process_group('gloo', rank=0, world_size=1, "
        "timeout=datetime.timedelta(seconds=77))\n"
        "group = dist.new_group([0], timeout=datetime.timedelta(seconds=33))\n"
        "print(device.group_timeout_s(), device.group_timeout_s(group), "
        "device.abort_group(group))\n"
    )
    from megatron_pp_ext.train.processes import free_port

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env=dict(os.environ, PORT=str(free_port())))
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["77.0", "33.0", "False"]


def test_install_takes_names_in_any_case_and_pytorchs(clean_install):
    assert install("ZB-H1").options.schedule == "zb-h1"
    assert install("ZBVZeroBubble").options.schedule == "zb-v"
    assert install("Auto").options.schedule == "auto"


def test_install_takes_a_schedule_file_checked_before_anything_is_patched(clean_install,
                                                                           tmp_path):
    from megatron_pp_ext.schedules import build_schedule

    path = tmp_path / "mine.csv"
    path.write_text(build_schedule("zb-h1", 2, 4).to_csv())
    installation = install(str(path))
    schedule = installation.options.file_schedule()
    assert installation.options.schedule == str(path) and schedule.name == "mine"
    assert schedule.text() == build_schedule("zb-h1", 2, 4).text()
    assert repr(installation.function) == f"ScheduleFunction({str(path)!r})"
    uninstall()
    path.write_text("0F0,0B0\n1B0,1F0\n")  # rank 1's backward before its forward: a deadlock
    with pytest.raises(ValueError, match=r"mine.csv cannot run"):
        install(str(path))
    assert not installed()
