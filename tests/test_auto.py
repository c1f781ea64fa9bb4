"""schedule="auto" on the tiny Megatron GPT (multi-process gloo): measure, choose once,
agree across ranks, and keep the gradients of a fixed-schedule run."""

import pytest

from megatron_pp_ext.train.processes import spawn
from support.probes import auto_steps
from support.reference import assert_same, merge_results

pytestmark = pytest.mark.megatron_cpu


@pytest.mark.parametrize("pp,layout", [(4, "loop"), (2, "v")])
def test_auto_measures_then_switches_once_with_the_same_gradients(pp, layout):
    ranks = spawn(pp, auto_steps, pp=pp, steps=3, layout=layout, ddp=True, timeout_s=240)
    measured_with = "1f1b" if layout == "loop" else "zb-v"
    candidates = {"loop": {"gpipe", "1f1b", "zb-h1", "zb-h2", "zb-auto"},
                  "v": {"zb-v", "dualpipev", "v-half", "v-min", "zb-auto"}}
    choices = {r["choice"] for r in ranks}
    assert len(choices) == 1  # every rank runs the same schedule after the switch
    (choice,) = choices
    assert choice in candidates[layout]
    for r in ranks:
        assert r["schedules"] == [measured_with, choice, choice]
    assert "chose " + choice in ranks[0]["reason"] and "faster" in ranks[0]["reason"]
    reference = merge_results([r["reference"] for r in ranks])
    for step in range(3):
        got = merge_results([r["results"][step] for r in ranks])
        assert_same(got, reference, rtol=1e-5, atol=1e-6)
