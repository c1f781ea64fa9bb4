"""The two runs of ``verify``, from the job's ``pretrain_gpt.py`` command line, and every refusal
before anything starts.

Both runs take the job's arguments unchanged except for what a short, side-effect-free
comparison needs, each said in the notes: ``--train-iters`` the verify steps; nothing saved
(``--save`` and the exit flags dropped; ``--load`` only reads); no evaluation; dropout off (a
schedule that runs the microbatches in another order draws their dropout masks in another
order: the runs could not match); ``--num-layers`` when asked to shrink the model. The
reference is Megatron's own schedule (its 1F1B with one chunk per rank, or its interleaved
schedule with the job's virtual stages); the candidate adds ``--pipeline-schedule S`` with the
chunks its layout needs, and traces its steps.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Sequence

from ..integration.megatron_args import resolve_schedule_value, schedule_options_from_args
from ..planner.pretrain_args import derive_sizes, parse_pretrain_args
from ..schedules import AUTO, DUAL_LAYOUT, REGISTRY
from .settings import AGAINST, VerifySettings

#: the flags that set a run's virtual pipeline stages
VP_FLAGS = ("--num-virtual-stages-per-pipeline-rank", "--num-layers-per-virtual-pipeline-stage")
#: flags that place layers per stage: --num-layers cannot shrink a model that has them
LAYER_PLACEMENT_FLAGS = ("--pipeline-model-parallel-layout", "--decoder-first-pipeline-num-layers",
                         "--decoder-last-pipeline-num-layers",
                         "--num-layers-per-virtual-pipeline-stage")
#: what a comparison must not do, with the number of values each flag takes
SIDE_EFFECT_FLAGS = {"--save": 1, "--save-interval": 1, "--exit-interval": 1,
                     "--exit-duration-in-mins": 1, "--exit-signal-handler": 0,
                     "--non-persistent-save-interval": 1, "--train-samples": 1}
#: the plugin's own flags, which verify sets for the candidate run
PLUGIN_FLAGS = {"--pipeline-schedule": 1, "--pp-trace": 0, "--pp-trace-dir": 1,
                "--pp-p2p-timeout-s": 1}


@dataclass(frozen=True)
class VerifyRun:
    name: str  # "reference" or "candidate"
    title: str  # "Megatron's 1F1B", "zb-v"
    schedule: str | None  # the plugin's schedule; None: Megatron's own
    order: str  # the schedule whose order the run's steps follow (Megatron's: 1f1b/interleaved)
    argv: tuple[str, ...]
    script_dir: str | None
    steps: int
    log_dir: str | None = None  # each rank's output (Megatron's logs) there, not on the screen


@dataclass
class VerifyPlan:
    settings: VerifySettings
    runs: list[VerifyRun]
    world_size: int
    world_from: str
    notes: list[str] = field(default_factory=list)


# ---------------------------------------------------------------- editing a command line
def drop_flag(argv: list[str], flag: str, values: int = 1) -> tuple[list[str], bool]:
    """``argv`` without ``flag`` (and its ``values``; also ``flag=value``); whether it was
    there."""
    out, found, skip = [], False, 0
    for token in argv:
        if skip:
            skip -= 1
            continue
        if token == flag:
            found, skip = True, values
            continue
        if token.startswith(flag + "="):
            found = True
            continue
        out.append(token)
    return out, found


def set_flag(argv: list[str], flag: str, *values: str) -> list[str]:
    """``argv`` with ``flag`` given ``values`` (once, at the end)."""
    argv, _ = drop_flag(argv, flag, len(values) or 0)
    return [*argv, flag, *values]


def flag_value(argv: Sequence[str], flag: str) -> str | None:
    for i, token in enumerate(argv):
        if token == flag and i + 1 < len(argv):
            return argv[i + 1]
        if token.startswith(flag + "="):
            return token.split("=", 1)[1]
    return None


# ---------------------------------------------------------------- the plan
def split_script(job_argv: Sequence[str]) -> tuple[str | None, list[str]]:
    """(the folder of ``pretrain_gpt.py`` when the command line names it, its arguments)."""
    argv = [str(a) for a in job_argv]
    if argv and argv[0] == "--":
        argv = argv[1:]
    if argv and argv[0].endswith(".py") and not argv[0].startswith("-"):
        return os.path.dirname(os.path.abspath(argv[0])), argv[1:]
    return None, argv


def check_settings(settings: VerifySettings) -> tuple[str, str]:
    """(the candidate schedule, the reference's order), or ValueError naming the fix."""
    if settings.steps < 2:
        raise ValueError(f"--steps {settings.steps}: verify times the steps after the first "
                         "(which builds and warms up), so it needs at least 2")
    schedule = resolve_schedule_value(settings.schedule)
    if schedule == AUTO or schedule not in REGISTRY:
        raise ValueError(f"--schedule {settings.schedule}: verify compares a named schedule "
                         f"(one of {', '.join(REGISTRY)}); auto chooses one while it runs")
    against = settings.against or ("interleaved" if schedule == "interleaved" else "1f1b")
    if against not in AGAINST:
        raise ValueError(f"--against {against}: Megatron's own schedules are 1f1b and "
                         "interleaved")
    if (schedule == "interleaved") != (against == "interleaved"):
        raise ValueError(
            f"--schedule {schedule} --against {against}: Megatron seeds each pipeline rank's "
            "chunks, so its interleaved layout starts from other weights than every one-chunk "
            "or V layout; compare interleaved with --against interleaved, any other schedule "
            "with --against 1f1b")
    return schedule, against


def shared_argv(settings: VerifySettings, argv: list[str], notes: list[str]) -> list[str]:
    """The job's arguments as both runs take them (see the module)."""
    for flag, values in SIDE_EFFECT_FLAGS.items():
        argv, found = drop_flag(argv, flag, values)
        if found:
            notes.append(f"{flag} dropped: verify writes no checkpoint and ends after "
                         f"{settings.steps} steps")
    for flag, values in PLUGIN_FLAGS.items():
        argv, found = drop_flag(argv, flag, values)
        if found:
            notes.append(f"{flag} dropped: verify sets the plugin's flags of each run")
    argv = set_flag(argv, "--train-iters", str(settings.steps))
    argv = set_flag(set_flag(argv, "--eval-iters", "0"), "--eval-interval",
                    str(settings.steps + 1))
    if flag_value(argv, "--load"):
        notes.append("--load: both runs start from that checkpoint (read only)")
    if not settings.keep_dropout:
        argv = set_flag(set_flag(argv, "--attention-dropout", "0"), "--hidden-dropout", "0")
        notes.append("dropout off in both runs: a schedule runs microbatches in another order "
                     "and would draw their masks in another order (--keep-dropout keeps it)")
    return _shrunk(settings, argv, notes)


def _shrunk(settings: VerifySettings, argv: list[str], notes: list[str]) -> list[str]:
    if settings.num_layers is None:
        return argv
    placed = [flag for flag in LAYER_PLACEMENT_FLAGS if flag_value(argv, flag) is not None]
    if placed:
        raise ValueError(f"--num-layers {settings.num_layers} cannot shrink a model whose "
                         f"layers {' and '.join(placed)} place per stage: drop --num-layers "
                         "(verify the whole model), or give a shrunk layout in the job's flags")
    was = flag_value(argv, "--num-layers")
    notes.append(f"the model shrunk to --num-layers {settings.num_layers} (the job's: {was}): "
                 "the verdict and the timings are for this smaller model")
    return set_flag(argv, "--num-layers", str(settings.num_layers))


def _without_vp(argv: list[str]) -> list[str]:
    for flag in VP_FLAGS:
        argv, _ = drop_flag(argv, flag)
    return argv


def run_argvs(schedule: str, against: str, argv: list[str],
              settings: VerifySettings) -> tuple[list[str], list[str]]:
    """(the reference's arguments, the candidate's)."""
    has_vp = any(flag_value(argv, flag) is not None for flag in VP_FLAGS)
    if against == "interleaved" and not has_vp:
        raise ValueError("--schedule interleaved needs the job's virtual stages: add "
                         "--num-virtual-stages-per-pipeline-rank V (V >= 2) to its arguments")
    reference = argv if against == "interleaved" else _without_vp(argv)
    layout = REGISTRY[schedule].layout
    if schedule == "interleaved":
        candidate = list(argv)
    elif layout in ("v", DUAL_LAYOUT):
        candidate = set_flag(_without_vp(argv), "--num-virtual-stages-per-pipeline-rank", "2")
    else:
        candidate = _without_vp(argv)
    candidate = [*candidate, "--pipeline-schedule", schedule, "--pp-trace",
                 "--pp-p2p-timeout-s", f"{settings.p2p_timeout_s:g}"]
    return reference, candidate


def _check_candidate(argv: list[str], dp: int) -> None:
    """The plugin's own argument checks on the candidate's arguments, before anything
    starts (each rank repeats them once Megatron has validated the arguments)."""
    args = parse_pretrain_args(argv)
    vp = getattr(args, "num_virtual_stages_per_pipeline_rank", None)
    args.virtual_pipeline_model_parallel_size = vp if vp and vp > 1 else None
    args.data_parallel_size = dp
    schedule_options_from_args(args)


def plan_verify(settings: VerifySettings, launched_world: int | None = None) -> VerifyPlan:
    """The two runs, or ValueError (the value, the rule, the fix) before anything starts.
    ``launched_world``: the launcher's world size (None: local processes)."""
    schedule, against = check_settings(settings)
    script_dir, job = split_script(settings.job_argv)
    if not job:
        raise ValueError("no job arguments: give the job's pretrain_gpt.py arguments after --")
    notes: list[str] = []
    argv = shared_argv(settings, job, notes)
    if launched_world is None and flag_value(argv, "--num-workers") != "0":
        argv = set_flag(argv, "--num-workers", "0")
        notes.append("--num-workers 0: local processes load their data themselves (the same "
                     "samples in the same order)")
    reference, candidate = run_argvs(schedule, against, argv, settings)
    sizes = derive_sizes(parse_pretrain_args(reference), launched_world or settings.world_size,
                         None, None)
    _check_candidate(candidate, sizes.dp)
    title = "Megatron's 1F1B" if against == "1f1b" else "Megatron's interleaved"
    logs = os.path.join(settings.out, "logs")
    runs = [VerifyRun("reference", title, None, against, tuple(reference), script_dir,
                      settings.steps, logs),
            VerifyRun("candidate", schedule, schedule, schedule, tuple(candidate), script_dir,
                      settings.steps, logs)]
    return VerifyPlan(settings, runs, sizes.world_size, sizes.world_from, notes + sizes.notes)
