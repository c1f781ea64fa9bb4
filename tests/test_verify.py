"""``verify`` (issue 60) through Megatron-LM's own ``pretrain_gpt.py`` on the CPU: the job under
Megatron's schedule and under the chosen one, every step's loss, grad norm and every
parameter's gradient norm compared, the verdict, the figures and the files.

Each case calls ``megatron_pp_ext.verify.launch.verify`` in this process, as ``python -m
megatron_pp_ext verify`` does without a launcher (local gloo processes, 2 or 4 per run). The
job is the tests' tiny GPT (support.megatron_loop.pretrain_argv: bf16, the distributed
optimizer, --clip-grad 1.0) given as ``pretrain_gpt.py <args>`` with the release's own script.
Its ranks run with the tests' CPU patches (support.verify_ranks: the loop's short-document mock
corpus, whose index cache they share); faults are injected by rank functions of the same
module (one W left out on one rank; a rank that stops answering), on the candidate run only. Not run here: NCCL, CUDA's peak memory
and Transformer Engine (bench/gpu_check.py runs verify where a GPU is at hand).
"""

import contextlib
import io
import json
import os

import pytest

from megatron_pp_ext.train.processes import RankFunction
from megatron_pp_ext.verify.compare import DIFFERENT, IDENTICAL, WITHIN
from megatron_pp_ext.verify.launch import verify
from megatron_pp_ext.verify.runs import VerifySettings, plan_verify
from support.megatron_lm_scripts import scripts_folder
from support.megatron_loop import MOCK_CACHE_ENV, pretrain_argv

pytestmark = pytest.mark.megatron_cpu
STEPS = 3
OVERLAP = "--overlap-grad-reduce"


def _job(pp=2, dp=1, extra=(), overlap=True):
    argv = pretrain_argv(pp=pp, dp=dp, iters=100, extra=list(extra))
    if not overlap:
        argv.remove(OVERLAP)
    if os.environ.get(MOCK_CACHE_ENV):  # the mock corpus's indices, built once a session
        argv += ["--data-cache-path", os.environ[MOCK_CACHE_ENV]]
    return [str(scripts_folder() / "pretrain_gpt.py"), *argv, "--save", "/nonexistent/ck",
            "--save-interval", "1"]


_RESULTS: dict = {}


AS_THE_TESTS_RUN = RankFunction("support.verify_ranks", "rank_as_the_tests_run")


def _verify(tmp_path_factory, schedule, job, candidate=AS_THE_TESTS_RUN, **settings):
    """(exit status, verify.json, the screen) of one verify, once per case a module; the
    candidate's ranks run ``candidate``."""
    targets = {"reference": AS_THE_TESTS_RUN, "candidate": candidate}
    key = (schedule, tuple(job), repr(candidate), tuple(sorted(settings.items())))
    if key not in _RESULTS:
        out = tmp_path_factory.mktemp("verify")
        screen = io.StringIO()
        with contextlib.redirect_stdout(screen):
            code = verify(VerifySettings(schedule=schedule, job_argv=job, out=str(out),
                                         steps=STEPS, **settings), targets=targets)
        _RESULTS[key] = (code, json.loads((out / "verify.json").read_text()),
                         screen.getvalue(), out)
    return _RESULTS[key]


# ------------------------------------------------------------------ refused before anything runs


@pytest.mark.parametrize("settings, words", [
    (dict(schedule="zb-v", steps=1), "--steps 1: verify times the steps after the first"),
    (dict(schedule="zb-v", against="interleaved"), "compare interleaved with --against "
                                                    "interleaved"),
    (dict(schedule="interleaved"), "--schedule interleaved needs the job's virtual stages"),
    (dict(schedule="auto"), "verify compares a named schedule"),
    (dict(schedule="zb-v", num_layers=4, extra=["--pipeline-model-parallel-layout",
                                                "Et*3|t*5L"]),
     "--num-layers 4 cannot shrink a model whose layers --pipeline-model-parallel-layout"),
    (dict(schedule="zb-v", extra=["--no-such-flag"]), "Megatron-LM's parser refuses the "
                                                       "arguments"),
    (dict(schedule="interleaved", extra=["--num-virtual-stages-per-pipeline-rank", "2",
                                         "--global-batch-size", "1"]),
     "--pipeline-schedule interleaved cannot run 1 microbatches per step"),
])
def test_bad_flags_are_refused_before_any_process_starts(settings, words):
    settings = dict(settings)
    job = _job(extra=settings.pop("extra", ()))
    with pytest.raises(ValueError) as refused:
        plan_verify(VerifySettings(job_argv=job, **settings))
    assert words in str(refused.value)


def test_the_runs_take_the_jobs_flags_but_save_nothing_and_say_so():
    plan = plan_verify(VerifySettings(schedule="zb-v", job_argv=_job(), num_layers=4))
    reference, candidate = (list(run.argv) for run in plan.runs)
    for argv in (reference, candidate):
        assert "--save" not in argv and "--save-interval" not in argv
        assert argv[argv.index("--train-iters") + 1] == "3"
        assert argv[argv.index("--num-layers") + 1] == "4"
        assert "--use-distributed-optimizer" in argv and OVERLAP in argv
    assert "--pipeline-schedule" not in reference
    assert candidate[candidate.index("--pipeline-schedule") + 1] == "zb-v"
    assert candidate[candidate.index("--num-virtual-stages-per-pipeline-rank") + 1] == "2"
    said = " ".join(plan.notes)
    assert "--save dropped" in said and "the model shrunk to --num-layers 4 (the job's: 8)" in said


# ------------------------------------------------------------------ verdicts

CASES = [("1f1b", IDENTICAL), ("zb-h1", IDENTICAL), ("zb-v", WITHIN), ("dualpipev", WITHIN),
         ("dualpipe", IDENTICAL)]


@pytest.mark.parametrize("schedule, expected", CASES, ids=[c[0] for c in CASES])
def test_the_verdict_of_each_schedule(tmp_path_factory, schedule, expected):
    """1f1b, zb-h1 and dualpipe keep Megatron's order of arithmetic (bit-identical); the V
    layouts sum the grad norm's per-rank parts in another order (its last bit)."""
    code, summary, screen, out = _verify(tmp_path_factory, schedule, _job())
    assert summary["verdict"] == expected and code == 0
    report = screen[screen.index("VERDICT"):].splitlines()  # after the progress lines
    assert report[0].startswith(f"VERDICT: {expected}: {schedule} against Megatron's 1F1B, "
                                "3 steps")
    assert report[1].startswith("  tolerance: gradients accumulated in fp32, parameters in bf16")
    assert summary["compared"] > STEPS * 100  # losses, grad norms, ~100 parameters a step
    if expected == WITHIN:
        # step 1 runs the same weights: only the grad norm's sum runs in another order (its
        # last bits); from step 2 the weights are what a clip factor one ulp apart rounded to
        # bf16, and one weight across a rounding boundary moves a parameter's gradient by up
        # to ~1e-3 (compare.py's bf16 tolerance; 2.3e-4 at step 3 here)
        worst = summary["worst_relative_difference"]
        assert 0 < max(worst) and worst[0] < 1e-6 and max(worst) <= 2e-3
    for name in ("reference", "candidate"):
        run = summary["runs"][name]
        assert [s["microbatches"] for s in run["steps"]] == [4] * STEPS
        stats = run["stats"]
        assert len(stats["bubble_per_rank"]) == len(stats["peak_bytes_per_rank"]) == 2
        assert all(0 <= b < 1 for b in stats["bubble_per_rank"])
        assert all(b > 0 for b in stats["peak_bytes_per_rank"])
        assert stats["median_step_s"] > 0 and stats["predicted_step_s"] > 0
        assert (out / f"costs-{name}.json").exists()
    assert (out / "verify.html").read_text().count("<svg") >= 2


def test_interleaved_against_megatrons_interleaved_is_identical(tmp_path_factory):
    code, summary, _, _ = _verify(tmp_path_factory, "interleaved", _job(
        extra=["--num-virtual-stages-per-pipeline-rank", "2"]))
    assert (summary["verdict"], code) == (IDENTICAL, 0)
    assert summary["runs"]["reference"]["title"] == "Megatron's interleaved"


def test_the_costs_file_calibrates_select(tmp_path_factory):
    """costs-candidate.json is the candidate's measured timeline: select --costs reads it."""
    from megatron_pp_ext.analysis.costs import load_costs

    *_, out = _verify(tmp_path_factory, "zb-h1", _job())
    costs = load_costs(str(out / "costs-candidate.json"))
    assert costs.num_ranks == 2 and costs.num_microbatches == 4
    assert all(t > 0 for t in costs.t_f + costs.t_i + costs.t_w)


FAULTY_W = RankFunction("support.verify_ranks", "rank_without_one_w")


def test_one_left_out_weight_gradient_is_named(tmp_path_factory):
    """zb-h1 with microbatch 0's W left out on pipeline rank 1 (its first step): DIFFERENT at
    step 1, a parameter of stage 1 named, exit status 1."""
    code, summary, screen, _ = _verify(tmp_path_factory, "zb-h1", _job(overlap=False),
                                       candidate=FAULTY_W)
    assert (summary["verdict"], code) == (DIFFERENT, 1)
    first = summary["first_difference"]
    assert first["step"] == 1 and first["what"].startswith("gradient of ")
    assert first["where"].startswith("pipeline rank 1 (stage 1), tp 0")
    assert "first difference: step 1: gradient of" in screen


HANGS = RankFunction("support.verify_ranks", "rank_that_stops_answering")


def test_a_rank_that_stops_answering_is_reported_as_a_hang(tmp_path_factory):
    """Pipeline rank 0 stops before its forward of microbatch 2 in the candidate run's second
    step: the plugin's wait on rank 1 gives up after --p2p-timeout-s and names rank 0 and the
    pending action; verify says HANG and exits 1. (Rank 0 is the one that stops: a failed
    global rank 0 serves the job's store and stays up for its peers' explanations, here for
    one that never comes, which would only make the test longer.)"""
    code, summary, screen, _ = _verify(tmp_path_factory, "1f1b", _job(),
                                       candidate=HANGS, p2p_timeout_s=2.0)
    assert (summary["verdict"], code) == ("HANG", 1)
    assert summary["run"] == "candidate"
    assert "pipeline rank 1 waited 2.0 s for rank 0 and gave up: pending 1F2" in summary["error"]
    assert "VERDICT: HANG: the candidate run did not finish: " in screen


# ------------------------------------------------------------------ configurations users run

CONFIGS = [
    ("tp2-mtp", "dualpipe", 4, dict(extra=["--tensor-model-parallel-size", "2",
                                           "--sequence-parallel", "--position-embedding-type",
                                           "rope", "--mtp-num-layers", "1"])),
    ("moe-ep2", "zb-v", 4, dict(dp=2, extra=["--num-experts", "4", "--moe-router-topk", "2",
                                             "--expert-model-parallel-size", "2",
                                             "--moe-token-dispatcher-type", "alltoall"])),
]


@pytest.mark.parametrize("name, schedule, world, job", CONFIGS, ids=[c[0] for c in CONFIGS])
def test_tensor_and_expert_parallel_jobs(tmp_path_factory, name, schedule, world, job):
    code, summary, _, _ = _verify(tmp_path_factory, schedule, _job(**job), world_size=world)
    assert summary["verdict"] in (IDENTICAL, WITHIN) and code == 0, summary.get("first_difference")
    norms = summary["runs"]["candidate"]["param_norms"][0]
    if name == "tp2-mtp":  # each TP rank's shard, and the MTP block's parameters
        assert {entry["tp"] for entry in norms.values()} == {0, 1}
        assert any(entry["name"].startswith("mtp.") for entry in norms.values())
    else:  # each expert-parallel rank's experts
        assert {entry["ep"] for entry in norms.values() if "experts" in entry["name"]} == {0, 1}


# ------------------------------------------------------------------ under a launcher


def test_a_launched_rank_runs_its_run_as_a_child_process(tmp_path_factory):
    """Under torchrun or srun each rank of the launch runs each run as a child process
    (``launch.run_child``: ``python -m megatron_pp_ext.verify.rank``, the launch's rank and
    world size, the run's own rendezvous port, gloo on the CPU here and NCCL on GPUs), and
    the child of rank 0 writes the merged record. Here the two ranks of a launch (as torchrun
    would export them) run zb-h1's run side by side; against Megatron's 1F1B run as local
    processes on the same arguments, the verdict is IDENTICAL. (torchrun itself: by hand,
    ``torchrun --nproc-per-node 2 -m megatron_pp_ext verify --schedule zb-h1 -- ...`` gave
    the same verdict; docs/verify.md.)"""
    import threading

    from megatron_pp_ext.train.launcher import Launch
    from megatron_pp_ext.train.processes import free_port
    from megatron_pp_ext.verify.compare import compare_runs, tolerance_for
    from megatron_pp_ext.verify.launch import run_child, run_local

    # the children run Megatron's own mock corpus: an index cache of their own
    job = [*_job(), "--data-cache-path", str(tmp_path_factory.mktemp("cache"))]
    plan = plan_verify(VerifySettings(schedule="zb-h1", job_argv=job, steps=STEPS),
                       launched_world=2)
    candidate = plan.runs[1]
    port = str(free_port())
    records = {}

    def rank(r):
        launch = Launch("torchrun", r, 2, r, "127.0.0.1", port)
        records[r] = run_child(plan, candidate, launch, index=1)

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=600)
    assert records[1] is None and records[0]["name"] == "candidate"
    assert [s["microbatches"] for s in records[0]["steps"]] == [4] * STEPS
    reference = run_local(plan, plan.runs[0])  # Megatron's own corpus too
    verdict = compare_runs(reference, records[0], tolerance_for(candidate.argv))
    assert verdict.verdict == IDENTICAL, verdict.first_difference
