"""Megatron-LM arguments of the plugin: a plain argparse parser, Megatron's own parser, and the
check that ``install_from_args`` reaches the ``get_forward_backward_func`` that Megatron-LM's
training loop bound at import time."""

import argparse
import sys
from types import SimpleNamespace

import pytest

from megatron_pp_ext.integration.megatron_args import (
    ENV_SCHEDULE,
    GROUP_TITLE,
    add_pipeline_schedule_args,
    install_from_args,
    schedule_choices,
    schedule_options_from_args,
)
from megatron_pp_ext.schedules import schedule_names

def _plain_parser(monkeypatch):
    monkeypatch.delenv(ENV_SCHEDULE, raising=False)
    parser = argparse.ArgumentParser(allow_abbrev=False)
    assert add_pipeline_schedule_args(parser) is parser
    return parser


def _args(**overrides):
    base = dict(pipeline_schedule=None, pp_schedule_chunks=None, pp_max_pending_backward=None,
                pp_p2p_timeout_s=None, pp_trace=False, pipeline_model_parallel_size=4,
                virtual_pipeline_model_parallel_size=None, microbatch_group_size_per_vp_stage=None)
    base.update(overrides)
    return SimpleNamespace(**base)


# --- plain argparse ------------------------------------------------------------------------


def test_choices_are_the_registry_plus_auto():
    assert schedule_choices() == [*schedule_names(), "auto"]
    assert {"gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2", "zb-v", "dualpipev"} <= set(
        schedule_names())


def test_defaults_leave_megatron_alone(monkeypatch):
    args = _plain_parser(monkeypatch).parse_args([])
    assert args.pipeline_schedule is None
    assert (args.pp_schedule_chunks, args.pp_max_pending_backward, args.pp_p2p_timeout_s) == (
        None, None, None)
    assert args.pp_trace is False
    assert schedule_options_from_args(args) is None
    assert install_from_args(args) is False


def test_group_and_values_parse(monkeypatch):
    parser = _plain_parser(monkeypatch)
    assert GROUP_TITLE in [g.title for g in parser._action_groups]
    assert "--pipeline-schedule" in parser.format_help()  # help strings format cleanly
    args = parser.parse_args(["--pipeline-schedule", "zb-h1", "--pp-max-pending-backward", "3",
                              "--pp-p2p-timeout-s", "12.5", "--pp-trace",
                              "--pp-schedule-chunks", "1"])
    assert (args.pipeline_schedule, args.pp_max_pending_backward, args.pp_p2p_timeout_s,
            args.pp_trace, args.pp_schedule_chunks) == ("zb-h1", 3, 12.5, True, 1)


@pytest.mark.parametrize("argv", [
    ["--pipeline-schedule", "pipedream"],
    ["--pp-max-pending-backward", "0"],
    ["--pp-max-pending-backward", "two"],
    ["--pp-p2p-timeout-s", "-1"],
    ["--pp-schedule-chunks", "0"],
])
def test_bad_values_are_rejected_by_argparse(monkeypatch, capsys, argv):
    with pytest.raises(SystemExit):
        _plain_parser(monkeypatch).parse_args(argv)
    assert "error" in capsys.readouterr().err


def test_env_gives_the_default_and_the_flag_wins(monkeypatch):
    monkeypatch.setenv(ENV_SCHEDULE, "gpipe")
    parser = add_pipeline_schedule_args(argparse.ArgumentParser())
    assert parser.parse_args([]).pipeline_schedule == "gpipe"
    assert parser.parse_args(["--pipeline-schedule", "1f1b"]).pipeline_schedule == "1f1b"


def test_bad_env_schedule_is_a_value_error():
    with pytest.raises(ValueError, match="MEGATRON_PP_SCHEDULE.*choose one of"):
        schedule_options_from_args(_args(pipeline_schedule="1f1f"))


# --- schedule versus Megatron's model chunks -----------------------------------------------


def test_options_passed_to_install():
    opts = schedule_options_from_args(_args(
        pipeline_schedule="interleaved", virtual_pipeline_model_parallel_size=3,
        microbatch_group_size_per_vp_stage=4, pp_p2p_timeout_s=9.0, pp_trace=True))
    assert opts == dict(schedule="interleaved", chunks=3, max_pending_backward=None, warmup_forwards=None,
                        microbatch_group_size_per_vp_stage=4, p2p_timeout_s=9.0, trace=True)
    assert schedule_options_from_args(_args(pipeline_schedule="1f1b"))["chunks"] is None
    for name in ("zb-v", "dualpipev"):
        opts = schedule_options_from_args(_args(pipeline_schedule=name,
                                                virtual_pipeline_model_parallel_size=2))
        assert opts["chunks"] == 2


def test_interleaved_without_virtual_pipeline_says_which_flag():
    with pytest.raises(ValueError, match="--num-virtual-stages-per-pipeline-rank"):
        schedule_options_from_args(_args(pipeline_schedule="interleaved"))


@pytest.mark.parametrize("name", ["zb-v", "dualpipev"])
@pytest.mark.parametrize("vp", [None, 3])
def test_v_schedules_need_two_chunks(name, vp):
    with pytest.raises(ValueError, match="--num-virtual-stages-per-pipeline-rank 2"):
        schedule_options_from_args(_args(pipeline_schedule=name,
                                         virtual_pipeline_model_parallel_size=vp))


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zb-h1", "zb-h2"])
def test_single_chunk_schedules_refuse_virtual_pipeline(name):
    with pytest.raises(ValueError, match="interleaved"):
        schedule_options_from_args(_args(pipeline_schedule=name,
                                         virtual_pipeline_model_parallel_size=2))


def test_max_pending_backward_only_for_zb_h1_and_zb_h2():
    with pytest.raises(ValueError, match="--pp-max-pending-backward 2 shapes zb-h1 and zb-h2 "
                                         "only, and 1f1b would ignore it: drop it or use "
                                         "--pipeline-schedule zb-h1 or zb-h2"):
        schedule_options_from_args(_args(pipeline_schedule="1f1b", pp_max_pending_backward=2))
    opts = schedule_options_from_args(_args(pipeline_schedule="zb-h2", pp_max_pending_backward=2))
    assert opts["max_pending_backward"] == 2


def test_chunks_flag_must_agree():
    with pytest.raises(ValueError, match="--pp-schedule-chunks 3"):
        schedule_options_from_args(_args(pipeline_schedule="interleaved",
                                         virtual_pipeline_model_parallel_size=2,
                                         pp_schedule_chunks=3))
    with pytest.raises(ValueError, match="--pp-schedule-chunks 2"):
        schedule_options_from_args(_args(pipeline_schedule="1f1b", pp_schedule_chunks=2))


def test_unvalidated_args_derive_chunks_like_megatron():
    args = _args(pipeline_schedule="interleaved", num_virtual_stages_per_pipeline_rank=None,
                 num_layers_per_virtual_pipeline_stage=1, num_layers=8)
    del args.virtual_pipeline_model_parallel_size  # as after parse_args, before validate_args
    assert schedule_options_from_args(args)["chunks"] == 2


# --- through Megatron-LM's own parser --------------------------------------------------------

MEGATRON_ARGV = [
    "pretrain_gpt.py", "--num-layers", "8", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "1",
    "--global-batch-size", "8", "--train-iters", "2", "--lr", "1e-3", "--mock-data",
    "--tokenizer-type", "NullTokenizer", "--vocab-size", "128",
    "--pipeline-model-parallel-size", "4",
]


def _megatron_args(monkeypatch, extra, validate=True, ignore_unknown_args=False):
    from megatron.training.arguments import parse_args, validate_args

    monkeypatch.delenv(ENV_SCHEDULE, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "4")  # validate_args reads the world size from the env
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(sys, "argv", MEGATRON_ARGV + extra)
    args = parse_args(extra_args_provider=add_pipeline_schedule_args,
                      ignore_unknown_args=ignore_unknown_args)
    if validate:
        validate_args(args)
    return args


def test_megatron_parse_args_accepts_the_group(monkeypatch):
    args = _megatron_args(monkeypatch, [
        "--pipeline-schedule", "zb-h2", "--pp-max-pending-backward", "6", "--pp-trace",
        "--pp-p2p-timeout-s", "30", "--some-unknown-flag"], validate=False,
        ignore_unknown_args=True)
    assert (args.pipeline_schedule, args.pp_max_pending_backward, args.pp_trace,
            args.pp_p2p_timeout_s) == ("zb-h2", 6, True, 30.0)
    assert args.pipeline_model_parallel_size == 4  # Megatron's own flags still parse


def test_megatron_parse_args_default_is_megatron_schedule(monkeypatch):
    args = _megatron_args(monkeypatch, [])
    assert args.pipeline_schedule is None
    assert install_from_args(args) is False


@pytest.mark.parametrize("vp_flags", [["--num-virtual-stages-per-pipeline-rank", "2"],
                                      ["--num-layers-per-virtual-pipeline-stage", "1"]])
def test_megatron_validated_interleaved(monkeypatch, vp_flags):
    args = _megatron_args(monkeypatch, ["--pipeline-schedule", "interleaved",
                                        "--microbatch-group-size-per-virtual-pipeline-stage", "4",
                                        *vp_flags])
    assert args.virtual_pipeline_model_parallel_size == 2
    opts = schedule_options_from_args(args)
    assert (opts["chunks"], opts["microbatch_group_size_per_vp_stage"]) == (2, 4)


def test_megatron_validated_interleaved_without_vp_fails_early(monkeypatch):
    args = _megatron_args(monkeypatch, ["--pipeline-schedule", "interleaved"])
    with pytest.raises(ValueError, match="needs v >= 2"):
        install_from_args(args)


@pytest.mark.parametrize("schedule,extra,vp", [
    ("1f1b", [], None),
    ("interleaved", ["--num-virtual-stages-per-pipeline-rank", "2"], 2),
])
def test_training_loop_gets_the_plugin_function(monkeypatch, schedule, extra, vp):
    import megatron.training.training as training

    import megatron_pp_ext as plugin

    megatron_fn = training.get_forward_backward_func(pp_size=4, vp_size=vp)
    assert not megatron_fn.__module__.startswith("megatron_pp_ext")
    args = _megatron_args(monkeypatch, ["--pipeline-schedule", schedule, *extra])
    try:
        assert install_from_args(args) is True
        # The name that megatron/training/training.py bound at import time.
        fn = training.get_forward_backward_func(pp_size=4, vp_size=vp)
        assert fn.__module__.startswith("megatron_pp_ext"), fn
    finally:
        plugin.uninstall()
    assert training.get_forward_backward_func(pp_size=4, vp_size=vp) is megatron_fn


def test_auto_is_accepted_and_installs_the_auto_schedule(monkeypatch):
    options = schedule_options_from_args(_args(pipeline_schedule="auto"))
    assert options == {"schedule": "auto", "p2p_timeout_s": None, "trace": False,
                       "auto_memory_budget_bytes": None}
    # --pp-memory-budget: auto's budget, in bytes (a size with a unit), refused elsewhere
    parsed = _plain_parser(monkeypatch).parse_args(["--pipeline-schedule", "auto",
                                                    "--pp-memory-budget", "2GiB"])
    assert parsed.pp_memory_budget == 2 * 1024 ** 3
    options = schedule_options_from_args(_args(pipeline_schedule="auto",
                                                pp_memory_budget=2 * 1024 ** 3))
    assert options["auto_memory_budget_bytes"] == 2 * 1024 ** 3
    with pytest.raises(ValueError, match="--pp-memory-budget is auto's budget.*"
                                         "--pipeline-schedule zb-auto takes none"):
        schedule_options_from_args(_args(pipeline_schedule="zb-auto", pp_memory_budget=1e9))
    with pytest.raises(SystemExit):
        _plain_parser(monkeypatch).parse_args(["--pp-memory-budget", "lots"])


# --- names in any case, PyTorch's names, and schedule files ----------------------------------


def _csv(tmp_path, name, p, m, chunks=None):
    from megatron_pp_ext.schedules import build_schedule

    path = tmp_path / f"{name}_p{p}_m{m}.csv"
    path.write_text(build_schedule(name, p, m, chunks).to_csv())
    return str(path)


def test_the_flag_takes_any_case_pytorchs_names_and_schedule_files(monkeypatch, tmp_path):
    parser = _plain_parser(monkeypatch)
    for given, want in (("ZB-H1", "zb-h1"), ("Interleaved1F1B", "interleaved"),
                        ("ZBVZeroBubble", "zb-v"), ("DualPipeV", "dualpipev"), ("Auto", "auto")):
        assert parser.parse_args(["--pipeline-schedule", given]).pipeline_schedule == want
    path = _csv(tmp_path, "zb-h1", 4, 8)
    assert parser.parse_args(["--pipeline-schedule", path]).pipeline_schedule == path


@pytest.mark.parametrize("value, words", [
    ("missing.csv", "cannot read schedule file missing.csv"),
    ("ZBVZeroBuble", "Did you mean 'ZBVZeroBubble' (zb-v)?"),
])
def test_the_flag_refuses_bad_files_and_names_with_the_reason(monkeypatch, capsys, value, words):
    with pytest.raises(SystemExit):
        _plain_parser(monkeypatch).parse_args(["--pipeline-schedule", value])
    assert words in capsys.readouterr().err


def test_schedule_file_options_and_layout(tmp_path):
    from megatron_pp_ext.integration.megatron_args import uses_v_layout

    loop = _csv(tmp_path, "zb-h1", 4, 8)
    opts = schedule_options_from_args(_args(pipeline_schedule=loop, pp_trace=True))
    assert opts == dict(schedule=loop, chunks=None, p2p_timeout_s=None, trace=True)
    assert not uses_v_layout(_args(pipeline_schedule=loop))
    v = _csv(tmp_path, "zb-v", 4, 8)
    assert schedule_options_from_args(_args(pipeline_schedule=v,
                                            virtual_pipeline_model_parallel_size=2))
    assert uses_v_layout(_args(pipeline_schedule=v))  # pretrain_gpt_pp.py builds V chunks
    interleaved = _csv(tmp_path, "interleaved", 4, 8, 3)
    assert schedule_options_from_args(_args(pipeline_schedule=interleaved,
                                            virtual_pipeline_model_parallel_size=3))


@pytest.mark.parametrize("schedule, overrides, words", [
    ("zb-h1", dict(pipeline_model_parallel_size=2),
     "has 4 rows (one per pipeline rank), but --pipeline-model-parallel-size is 2"),
    ("zb-h1", dict(virtual_pipeline_model_parallel_size=2),
     "places 1 stage(s) on each rank but Megatron builds 2 model chunk(s) per rank: remove"),
    ("zb-v", {}, "add --num-virtual-stages-per-pipeline-rank 2 (the file's V layout"),
    ("zb-v", dict(virtual_pipeline_model_parallel_size=2, num_layers=8,
                  decoder_first_pipeline_num_layers=3),
     "the other 7 stages must share the remaining 5 of --num-layers 8 evenly"),
    ("zb-h1", dict(pp_max_pending_backward=2), "drop --pp-max-pending-backward"),
    ("zb-h1", dict(pp_schedule_chunks=2), "--pp-schedule-chunks 2 does not fit"),
    ("zb-h1", dict(global_batch_size=16, micro_batch_size=1, data_parallel_size=1),
     "schedules m=8 microbatches, but --global-batch-size 16 / (--micro-batch-size 1 x "
     "data-parallel size 1) is 16 microbatches per step: set --global-batch-size 8"),
])
def test_schedule_files_that_do_not_fit_megatrons_arguments(tmp_path, schedule, overrides, words):
    path = _csv(tmp_path, schedule, 4, 8)
    with pytest.raises(ValueError) as info:
        schedule_options_from_args(_args(pipeline_schedule=path, **overrides))
    assert words in str(info.value)


def test_megatron_validated_schedule_file_installs(monkeypatch, tmp_path):
    """Through Megatron's own parser and validate_args (pp=4, global batch 8 of micro batch 1:
    m=8): the file's p and m fit, and the training loop's selector returns the plugin."""
    import megatron.training.training as training

    import megatron_pp_ext as plugin

    path = _csv(tmp_path, "zb-h1", 4, 8)
    args = _megatron_args(monkeypatch, ["--pipeline-schedule", path])
    assert args.pipeline_schedule == path
    try:
        assert install_from_args(args) is True
        fn = training.get_forward_backward_func(pp_size=4, vp_size=None)
        assert fn.__module__.startswith("megatron_pp_ext") and fn.options.schedule == path
    finally:
        plugin.uninstall()
    wrong_m = _csv(tmp_path, "zb-h1", 4, 4)
    args = _megatron_args(monkeypatch, ["--pipeline-schedule", wrong_m])
    with pytest.raises(ValueError, match="set --global-batch-size 4"):
        install_from_args(args)


def test_pp_trace_dir_turns_tracing_on_and_names_the_folder(monkeypatch):
    parser = _plain_parser(monkeypatch)
    args = parser.parse_args(["--pipeline-schedule", "zb-h1", "--pp-trace-dir", "runs/trace"])
    args.pipeline_model_parallel_size = 4
    options = schedule_options_from_args(args)
    assert (options["trace"], options["trace_dir"]) == (True, "runs/trace")
    plain = schedule_options_from_args(parser.parse_args(["--pipeline-schedule", "zb-h1"]))
    assert plain["trace"] is False and "trace_dir" not in plain


# --- refusals at argument time, through Megatron's own parser and validate_args (pp=4, m=8) --


def test_a_layout_string_with_two_stages_per_rank_names_that_flag_for_one_chunk_schedules(
        monkeypatch):
    """The virtual stages come from the string: the message names it (not the two vp flags
    the user never passed) and says how many stages a one-chunk schedule needs."""
    args = _megatron_args(monkeypatch, ["--pipeline-schedule", "zb-h1",
                                        "--pipeline-model-parallel-layout", "Et|t|t|t|t|t|t|tL"])
    assert args.virtual_pipeline_model_parallel_size == 2
    with pytest.raises(ValueError) as info:
        install_from_args(args)
    text = str(info.value)
    assert "--pipeline-model-parallel-layout 'Et|t|t|t|t|t|t|tL' gives each pipeline rank " \
           "several stages: write it with 4 stage(s)" in text
    assert "--num-virtual-stages-per-pipeline-rank" not in text


# (flags, --num-layers, the layout string the V layout builds at pp 4: 8 stages)
V_SPLITS = [
    (["--decoder-first-pipeline-num-layers", "1", "--decoder-last-pipeline-num-layers", "1"],
     "8", "Et|(t|)*6,tL"),
    (["--decoder-first-pipeline-num-layers", "3"], "10", "Et*3|(t|)*6,tL"),
    (["--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split"],
     "6", "E|(t|)*6,L"),
    (["--account-for-loss-in-pipeline-split"], "15", "Ett|(tt|)*6,tL"),
]


@pytest.mark.parametrize("flags, layers, layout", V_SPLITS, ids=[" ".join(row[0])[2:30]
                                                                  for row in V_SPLITS])
@pytest.mark.parametrize("name", ["zb-v", "dualpipev"])
def test_v_layouts_apply_megatrons_split_flags_to_the_first_and_last_stage(
        monkeypatch, name, flags, layers, layout):
    """Megatron's first/last-stage split flags under a V schedule (stages 0 and 2p-1 both on
    rank 0): the arguments get the equivalent layout string in their place (the flags
    cleared, so Megatron's TransformerConfig builds the string), and its stages are V stage
    0 and 2p-1 as the flags say."""
    from megatron_pp_ext.integration.stage_layers import stage_layers

    args = _megatron_args(monkeypatch, ["--pipeline-schedule", name, "--num-layers", layers,
                                        "--num-virtual-stages-per-pipeline-rank", "2", *flags])
    assert install_from_args(args)
    assert args.pipeline_model_parallel_layout == layout
    assert " ".join(args.pp_v_split_flags) == " ".join(flags)  # what plan's note names
    assert (args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers,
            args.account_for_embedding_in_pipeline_split,
            args.account_for_loss_in_pipeline_split) == (None, None, False, False)
    stages = stage_layers(args, 4, 2)  # Megatron's TransformerConfig parses the string
    decoders = [stage.decoder for stage in stages]
    assert sum(decoders) == int(layers)
    if "--decoder-first-pipeline-num-layers" in flags:
        assert decoders[0] == int(flags[flags.index("--decoder-first-pipeline-num-layers") + 1])
    if "--decoder-last-pipeline-num-layers" in flags:
        assert decoders[-1] == int(flags[flags.index("--decoder-last-pipeline-num-layers") + 1])
    # an account-for flag: its stage holds one decoder layer less than the others
    if "--account-for-embedding-in-pipeline-split" in flags:
        assert decoders[0] == decoders[1] - 1
    if "--account-for-loss-in-pipeline-split" in flags:
        assert decoders[-1] == decoders[1] - 1
    assert stages[0].embedding and stages[-1].loss


@pytest.mark.parametrize("flags, layers, words", [
    (["--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split"], "8",
     "--num-layers 8 plus the embedding and the loss counted as layers (10) must divide evenly "
     "over the 8 stages"),
    (["--decoder-first-pipeline-num-layers", "2", "--decoder-last-pipeline-num-layers", "2"],
     "8", "the other 6 stages must share the remaining 4 of --num-layers 8 evenly"),
])
def test_v_layouts_refuse_split_flags_that_do_not_divide(monkeypatch, flags, layers, words):
    args = _megatron_args(monkeypatch, ["--pipeline-schedule", "zb-v", "--num-layers", layers,
                                        "--num-virtual-stages-per-pipeline-rank", "2", *flags])
    with pytest.raises(ValueError) as info:
        install_from_args(args)
    assert words in str(info.value)
    assert "--pipeline-model-parallel-layout" in str(info.value)  # the way out


@pytest.mark.parametrize("name", ["zb-v", "dualpipev"])
def test_v_layouts_refuse_mtp_layers_off_the_last_stage(monkeypatch, name):
    """The MTP stage's embedding copy is summed with the first stage's on rank 0 (stages 0
    and 2p-1): a string with 'm' on another stage is refused before anything runs; the
    DeepSeek-style string with the MTP layers and the loss alone on the last stage is taken."""
    import megatron_pp_ext as plugin

    rope = ["--position-embedding-type", "rope", "--mtp-num-layers", "1"]
    args = _megatron_args(monkeypatch, [
        "--pipeline-schedule", name, *rope,
        "--pipeline-model-parallel-layout", "Et|t|t|t|t|t|ttm|L"])
    with pytest.raises(ValueError, match=r"puts the MTP layers on stage 6: move 'm' to the "
                                         r"last stage"):
        install_from_args(args)
    args = _megatron_args(monkeypatch, [
        "--pipeline-schedule", name, *rope,
        "--pipeline-model-parallel-layout", "Et|t|t|t|t|t|tt|mL"])
    try:
        assert install_from_args(args) is True
    finally:
        plugin.uninstall()


def test_v_layouts_take_a_layout_string_of_2p_stages(monkeypatch):
    import megatron_pp_ext as plugin

    args = _megatron_args(monkeypatch, [
        "--pipeline-schedule", "zb-v",
        "--pipeline-model-parallel-layout", "Et|t|t|t|t|t|t|tL"])  # 8 stages at pp 4
    try:
        assert install_from_args(args) is True
    finally:
        plugin.uninstall()
    args = _megatron_args(monkeypatch, [
        "--pipeline-schedule", "zb-v", "--pipeline-model-parallel-layout",
        "Ett|t|t|t|t|t|t|t|t|t|t|L"])  # 12 stages: 3 per rank
    with pytest.raises(ValueError, match=r"'Ett\|t.*must hold 2p = 8 stages, two per rank"):
        install_from_args(args)


def test_interleaved_with_fewer_microbatches_than_ranks_is_refused_at_argument_time(
        monkeypatch):
    """m = 2 < p = 4: Megatron's interleaved schedule cannot run it; refused when the
    arguments are read, naming the batch flags, not at the first step."""
    args = _megatron_args(monkeypatch, ["--pipeline-schedule", "interleaved",
                                        "--num-virtual-stages-per-pipeline-rank", "2",
                                        "--global-batch-size", "2"])
    with pytest.raises(ValueError) as info:
        install_from_args(args)
    text = str(info.value)
    assert text.startswith("--pipeline-schedule interleaved cannot run 2 microbatches per "
                           "step at --pipeline-model-parallel-size 4 (--global-batch-size 2 / "
                           "(--micro-batch-size 1 x data-parallel size 1)): interleaved:")


def test_the_v_layout_providers_patches_are_undone_by_uninstall():
    """The first V chunk built patches Megatron's Float16Module (casts by the chunk's own
    pre/post-processing) and finalize_model_grads' embedding all-reduce (summed on rank 0);
    megatron_pp_ext.uninstall() puts both back."""
    import importlib

    from megatron.training import training

    import megatron_pp_ext as plugin
    from megatron_pp_ext.integration import v_layout_models

    finalize = importlib.import_module("megatron.core.distributed.finalize_model_grads")
    originals = (training.Float16Module, finalize._allreduce_word_embedding_grads)
    v_layout_models._patch_once()
    try:
        assert training.Float16Module.v_layout_aware is True
        assert finalize._allreduce_word_embedding_grads is not originals[1]
        v_layout_models._patch_once()  # once: a second call patches nothing more
        assert len(v_layout_models._PATCHED) == 2
    finally:
        plugin.uninstall()
    assert (training.Float16Module, finalize._allreduce_word_embedding_grads) == originals
