"""Schedule files that run: ``install(schedule="my.csv")`` runs a CSV (PyTorch's compute-only
format) through the real executor over gloo, checked before any byte moves (the validator and
NCCL's rules), at the pipeline size, microbatch count and chunks it was written for; names in
any case and PyTorch's names as aliases."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_pp_ext.integration.options import PipelineOptions
from megatron_pp_ext.ir import Schedule, ScheduleError
from megatron_pp_ext.schedules import (
    ALIASES,
    build_schedule,
    canonical_name,
    get_spec,
    load_schedule_file,
    schedule_layout,
)
from megatron_pp_ext.train.processes import SpawnError, spawn
from support.reference import assert_same, merge_results, run_step

# PyTorch's ZB1P test schedule (2 ranks, 2 stages each, 8 microbatches), in tests/data since
# the first analysis tests (byte-identical to the copy in /work/shared/peer-schedules, whose
# README gives its provenance: PyTorch's own test data; it states no licence of its own)
PEER_CSV = Path(__file__).parent / "data" / "torch_zb1p_2rank_2stagep_compute.csv"
FP32 = dict(rtol=1e-5, atol=1e-6)


def _export(tmp_path: Path, name: str, p: int, m: int, suffix: str = ".csv") -> Path:
    """A built-in schedule written with the IR's writer (``to_csv`` / ``to_json``)."""
    schedule = build_schedule(name, p, m)
    path = tmp_path / f"{name}_p{p}_m{m}{suffix}"
    path.write_text(schedule.to_csv() if suffix == ".csv" else schedule.to_json())
    return path


def _rows(schedule: Schedule) -> list[list[str]]:
    return schedule.text()


# ------------------------------------------------------------------------ runs over gloo


def _installed_runs(rank, world_size, runs):
    """Spawn target: for each run, ``install(schedule=...)`` then one step of the tiny GPT
    through Megatron's ``get_forward_backward_func()`` (for the V layout, which Megatron's
    selector does not know, the installation's function itself); the step's result with the
    actions this rank executed, in order."""
    import megatron_pp_ext

    results = []
    for schedule, kwargs in runs:
        installation = megatron_pp_ext.install(schedule=schedule)
        try:
            how = "megatron" if kwargs.get("layout", "loop") == "loop" else installation.function
            result = run_step(rank, world_size, how, **kwargs)
            result["executed"] = [str(a) for a in installation.state.last_step.executed]
            result["schedule_name"] = installation.state.last_schedule.name
        finally:
            megatron_pp_ext.uninstall()
        results.append(result)
    return results


def _split(per_rank, count):
    return [[ranks[i] for ranks in per_rank] for i in range(count)]


def test_exported_csvs_run_bit_identical_to_the_builtin_schedules(tmp_path, megatron_reference):
    """zb-h1 (loop layout) and zb-v (V layout: inferred from the CSV's stage-to-rank mapping)
    at p=2, m=4, exported to CSV and installed from the file: every rank executes exactly the
    file's row, and the losses and every gradient equal the built-in schedule's, bit for bit
    (and the pp=1 run's within fp32). A forward-only step (evaluation) runs the file's
    forwards."""
    zbh1, zbv = _export(tmp_path, "zb-h1", 2, 4), _export(tmp_path, "zb-v", 2, 4)
    common = dict(pp=2, num_microbatches=4, ddp=True)
    runs = [
        ("zb-h1", common),
        (str(zbh1), common),
        ("zb-v", dict(common, layout="v")),
        (str(zbv), dict(common, layout="v")),
        ("zb-h1", dict(common, forward_only=True)),
        (str(zbh1), dict(common, forward_only=True)),
    ]
    per_rank = spawn(2, _installed_runs, runs, timeout_s=240)
    results = _split(per_rank, len(runs))
    built_h1, csv_h1, built_v, csv_v, fwd_built, fwd_csv = results

    for csv_path, ranks in ((zbh1, csv_h1), (zbv, csv_v)):
        rows = Path(csv_path).read_text().splitlines()
        assert [",".join(r["executed"]) for r in sorted(ranks, key=lambda r: r["rank"])] == rows
        assert {r["schedule_name"] for r in ranks} == {Path(csv_path).stem}
    assert [r["stages"] for r in csv_v] == [[0, 3], [1, 2]]  # the V layout, from the file

    assert_same(merge_results(csv_h1), merge_results(built_h1))  # bit for bit
    assert_same(merge_results(csv_v), merge_results(built_v))
    reference = megatron_reference(num_microbatches=4, ddp=True)
    assert_same(merge_results(csv_h1), reference, **FP32)
    assert_same(merge_results(csv_v), reference, **FP32)

    assert [r["executed"] for r in fwd_csv] == [["0F0", "0F1", "0F2", "0F3"],
                                                 ["1F0", "1F1", "1F2", "1F3"]]
    assert_same(merge_results(fwd_csv), merge_results(fwd_built))


def test_pytorchs_zb1p_csv_runs_equal_to_pp1(megatron_reference):
    """PyTorch's own ZB1P schedule (v=2 loop layout, its I/W split written the older way, as
    B then W) runs as written: each rank's order is the file's, gradients equal the pp=1 run's
    within fp32."""
    per_rank = spawn(2, _installed_runs,
                     [(str(PEER_CSV), dict(pp=2, vp=2, num_microbatches=8, ddp=True))],
                     timeout_s=240)
    ranks = _split(per_rank, 1)[0]
    loaded = load_schedule_file(str(PEER_CSV))
    assert [r["executed"] for r in sorted(ranks, key=lambda r: r["rank"])] == _rows(loaded)
    assert [r["stages"] for r in sorted(ranks, key=lambda r: r["rank"])] == [[0, 2], [1, 3]]
    assert_same(merge_results(ranks), megatron_reference(num_microbatches=8, ddp=True), **FP32)


def test_a_step_at_another_microbatch_count_fails_before_any_communication(tmp_path):
    """The file says m=4; a step with 6 microbatches is a ValueError naming both, on the way
    in (the ranks never exchange a tensor: every rank raises the same error itself)."""
    zbh1 = _export(tmp_path, "zb-h1", 2, 4)
    with pytest.raises(SpawnError) as info:
        spawn(2, _installed_runs, [(str(zbh1), dict(pp=2, num_microbatches=6))], timeout_s=120)
    text = str(info.value)
    assert "ValueError" in text and "schedules m=4 microbatches" in text
    assert "num_microbatches=6" in text and "global_batch_size" in text
    assert "Connection" not in text  # the first error is the check, not a peer's failure


# ------------------------------------------------------------------- checks, without ranks


def test_the_run_time_checks_name_p_m_and_chunks(tmp_path):
    from megatron_pp_ext.integration.forward_backward import schedule_for

    options = PipelineOptions(schedule=str(_export(tmp_path, "zb-h1", 2, 4)))
    schedule = schedule_for(options, 2, 4, 1, False)
    assert schedule is options.file_schedule() and _rows(schedule) == _rows(
        build_schedule("zb-h1", 2, 4))
    with pytest.raises(ValueError, match=r"has 2 rows .* pipeline has p=4 ranks.*size to 2"):
        schedule_for(options, 4, 4, 1, False)
    with pytest.raises(ValueError, match=r"schedules m=4 microbatches \(0..3\), but this step "
                                         r"has num_microbatches=8"):
        schedule_for(options, 2, 8, 1, False)
    with pytest.raises(ValueError, match=r"places 1 stage\(s\) on each rank \(the loop layout"
                                         r".*`model` holds 2 chunk"):
        schedule_for(options, 2, 4, 2, False)
    forward = schedule_for(options, 2, 4, 1, True)
    assert _rows(forward) == [["0F0", "0F1", "0F2", "0F3"], ["1F0", "1F1", "1F2", "1F3"]]


def test_the_peer_csv_loads_and_passes_nccls_rules():
    """PyTorch's ZB1P CSV loads as a v=2 loop-layout schedule, validates, and a P2P program
    for it passes NCCL's rules."""
    from megatron_pp_ext.analysis.lowering import LOCKSTEP, MEGATRON, lower, nccl_posting
    from megatron_pp_ext.analysis.nccl_rules import check_nccl_rules

    options = PipelineOptions(schedule=str(PEER_CSV))  # raises unless both checks pass
    schedule = options.file_schedule()
    assert (schedule.num_ranks, schedule.num_microbatches, schedule.chunks) == (2, 8, 2)
    assert schedule_layout(schedule) == "loop" and schedule.stage_to_rank == (0, 1, 0, 1)
    assert schedule.uses_split_backward()  # its B's followed by W's are I's
    posting = nccl_posting(schedule)
    check_nccl_rules(lower(schedule, MEGATRON if posting is None else LOCKSTEP))
    assert options.to_dict()["schedule_sha256"] and "schedule_text" not in options.to_dict()


def test_a_csv_that_could_hang_on_nccl_is_refused_before_anything_is_patched(tmp_path,
                                                                              monkeypatch):
    """A schedule file is checked against NCCL's rules when it is installed: when no P2P
    program for it passes them, install() raises ScheduleError naming the file and patches
    nothing."""
    from megatron_pp_ext.integration import options as options_module
    from megatron_pp_ext.integration.install import installed, uninstall
    from megatron_pp_ext.analysis import lowering

    import megatron_pp_ext

    path = _export(tmp_path, "zb-h2", 2, 4)
    calls = []

    def failing(schedule, variable_shapes=False):
        calls.append(schedule.name)
        raise ScheduleError("ranks 0 and 1 each wait on a batch the other never posts")

    monkeypatch.setattr(lowering, "nccl_posting", failing)
    options_module._checked_file_schedule.cache_clear()
    uninstall()
    try:
        with pytest.raises(ScheduleError, match=rf"schedule file {path} could hang on NCCL.*"
                                                r"each wait on a batch"):
            megatron_pp_ext.install(schedule=str(path))
        assert calls == [path.stem] and not installed()
    finally:
        options_module._checked_file_schedule.cache_clear()


def test_a_csv_that_deadlocks_is_refused_by_the_validator(tmp_path):
    path = tmp_path / "swapped.csv"  # rank 1 runs its backward before the forward it needs
    path.write_text("0F0,0B0\n1B0,1F0\n")
    with pytest.raises(ScheduleError, match=rf"schedule file {path} cannot run"):
        PipelineOptions(schedule=str(path))


@pytest.mark.parametrize("text, words", [
    # stages 0, 1 on rank 0 and 2, 3 on rank 1: neither Megatron's loop layout nor the V
    ("0F0,1F0,1B0,0B0\n2F0,3F0,3B0,2B0\n", "built only for the loop layout"),
    # a CSV may bring its communication (analysis.user_program), but not a message to nowhere
    ("0F0,0SEND_F0\n", "P2P op '0SEND_F0' names stage 0, .* no neighbour stage 1"),
    ("", "holds no rows"),
])
def test_csvs_that_cannot_run_are_refused_with_the_reason(tmp_path, text, words):
    path = tmp_path / "bad.csv"
    path.write_text(text)
    with pytest.raises(ScheduleError, match=words):
        load_schedule_file(str(path))


def test_a_missing_file_and_builder_options_are_refused(tmp_path):
    with pytest.raises(ScheduleError, match="cannot read schedule file .*nope.csv"):
        PipelineOptions(schedule=str(tmp_path / "nope.csv"))
    path = str(_export(tmp_path, "zb-h1", 2, 4))
    with pytest.raises(ValueError, match="max_pending_backward shape a built schedule"):
        PipelineOptions(schedule=path, max_pending_backward=2)
    with pytest.raises(ValueError, match="chunks=2, but the schedule file .* places 1 stage"):
        PipelineOptions(schedule=path, chunks=2)


def test_json_files_run_too(tmp_path):
    path = _export(tmp_path, "dualpipev", 2, 4, suffix=".json")
    schedule = PipelineOptions(schedule=str(path)).file_schedule()
    built = build_schedule("dualpipev", 2, 4)
    assert _rows(schedule) == _rows(built) and schedule_layout(schedule) == "v"
    assert schedule.options["overlapped_pairs"] is True  # the JSON keeps the builder's options


# ------------------------------------------------------------------------------- names


@pytest.mark.parametrize("given, want", [
    ("1F1B", "1f1b"), ("ZB-V", "zb-v"), ("Zb-H1", "zb-h1"), ("GPIPE", "gpipe"),
    ("GPipe", "gpipe"), ("Interleaved1F1B", "interleaved"), ("ZBVZeroBubble", "zb-v"),
    ("DualPipeV", "dualpipev"), ("dualpipev", "dualpipev"), ("interleaved1f1b", "interleaved"),
])
def test_names_in_any_case_and_pytorchs(given, want):
    assert canonical_name(given) == want and get_spec(given).name == want
    assert PipelineOptions.from_kwargs(given).schedule == want
    assert build_schedule(given, 2, 4, get_spec(want).default_chunks).name == want


def test_every_alias_is_one_of_pytorchs_schedule_names():
    """Each alias is a key of torch.distributed.pipelining's own name table (compared as it
    compares them, case-insensitively)."""
    from torch.distributed.pipelining.schedules import get_schedule_class

    for alias, (ours, spelled) in ALIASES.items():
        assert spelled.lower() == alias and get_schedule_class(spelled) is not None
        assert ours == canonical_name(alias)


def test_pytorchs_interleaved1f1b_is_our_interleaved_order():
    """The Interleaved1F1B alias runs the order PyTorch's ScheduleInterleaved1F1B writes (its
    per-rank order computed by its own code, without a process group)."""
    from torch.distributed.pipelining import schedules as torch_schedules

    for p, m in ((2, 4), (4, 8), (2, 6)):
        ours = build_schedule("Interleaved1F1B", p, m, 2)
        # the attributes its __init__ sets before it computes each rank's order
        torch_schedule = object.__new__(torch_schedules.ScheduleInterleaved1F1B)
        torch_schedule.pp_group_size, torch_schedule.n_local_stages = p, 2
        torch_schedule._num_stages, torch_schedule._n_microbatches = 2 * p, m
        torch_schedule.stage_index_to_group_rank = dict(enumerate(ours.stage_to_rank))
        torch_schedule.number_of_rounds = max(1, m // p)
        torch_schedule.microbatches_per_round = m // torch_schedule.number_of_rounds
        rows = [[str(a) for a in torch_schedule._calculate_single_rank_operations(r)
                 if a is not None] for r in range(p)]
        assert rows == _rows(ours), (p, m)


def test_unknown_names_list_the_names_and_the_closest():
    with pytest.raises(ScheduleError, match=r"unknown schedule 'ZBVZeroBuble': choose one of "
                                            r"gpipe, 1f1b, .*DualPipeV work too.*Did you mean "
                                            r"'ZBVZeroBubble' \(zb-v\)\?"):
        canonical_name("ZBVZeroBuble")
    with pytest.raises(ScheduleError, match=r"unknown schedule '1F1BB'.*Did you mean '1f1b'"):
        canonical_name("1F1BB")
    with pytest.raises(ScheduleError, match=r"'InterleavedZeroBubble' has no equivalent here.*"
                                            r"CSV.*choose one of gpipe"):
        canonical_name("InterleavedZeroBubble")
