"""install() / uninstall(): Megatron's own selector hands back our function at pp > 1."""

import os
import subprocess
import sys

import pytest

import megatron_pp_ext
from megatron_pp_ext.integration.forward_backward import STATE, forward_backward_pipelining
from megatron_pp_ext.integration.install import install, installed, uninstall


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

    install("zb-h1", max_pending_backward=3)
    assert installed()
    for selector in (core_selector, training_selector, schedules.get_forward_backward_func):
        assert selector(pp_size=4, vp_size=None) is forward_backward_pipelining
        assert selector(pp_size=4, vp_size=2) is forward_backward_pipelining
        assert selector(pp_size=1, vp_size=None) is schedules.forward_backward_no_pipelining
    assert STATE.options.schedule == "zb-h1" and STATE.options.max_pending_backward == 3

    uninstall()
    assert not installed()
    assert core_selector(pp_size=4, vp_size=None) is originals[0]
    assert training_selector(pp_size=4, vp_size=2) is originals[1]


def test_install_twice_switches_the_schedule_without_patching_twice(clean_install):
    install("gpipe")
    install("interleaved")
    assert STATE.options.schedule == "interleaved"
    uninstall()
    schedules, core_selector, _ = _selectors()
    assert core_selector(pp_size=2, vp_size=None) is not forward_backward_pipelining


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
    assert megatron_pp_ext.forward_backward_pipelining is forward_backward_pipelining


def test_environment_variable_switches_an_unmodified_script(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(
        "from megatron.core.pipeline_parallel import get_forward_backward_func\n"
        "import megatron_pp_ext\n"
        "from megatron_pp_ext.integration.forward_backward import STATE\n"
        "f = get_forward_backward_func(pp_size=4, vp_size=None)\n"
        "print(f is megatron_pp_ext.forward_backward_pipelining, STATE.options.schedule)\n"
    )
    env = dict(os.environ, MEGATRON_PP_SCHEDULE="gpipe")
    out = subprocess.run([sys.executable, "-m", "megatron_pp_ext.run", str(script)],
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "True gpipe"
