"""What a training run is asked to do, and the checks that run before any process starts.

No torch and no Megatron here: a bad command line fails in a fraction of a second, with one
line that names the value and the fix. (A schedule file is also checked against NCCL's rules,
which loads torch: a second more, for that case only.)
"""

from __future__ import annotations

import functools

from dataclasses import asdict, dataclass

from ..ir import Schedule, ScheduleError
from ..schedules import (
    AUTO,
    build_schedule,
    build_async_schedule,
    get_spec,
    is_async_schedule,
    is_schedule_file,
    load_schedule_file,
    resolve_schedule,
    schedule_layout,
)
from ..integration.options import PipelineOptions

# the command-line flags the settings' fields come from, as errors name them
_FLAGS = {"pp": "-p/--ranks", "microbatches": "-m/--microbatches"}


@functools.lru_cache(maxsize=8)
def _chunks_it_picks(name: str, pp: int, microbatches: int) -> int:
    """zb-auto's chunks per rank at unit costs (the layout it builds when not told)."""
    return build_schedule(name, pp, microbatches).chunks


@dataclass(frozen=True)
class TrainSettings:
    schedule: str = "1f1b"  # a name (any case, PyTorch's too), auto, or a .csv / .json file
    pp: int = 4  # pipeline ranks
    microbatches: int = 8  # per step
    chunks: int | None = None  # model chunks per rank; None: the schedule's own (interleaved 2)
    steps: int = 50
    out: str = "out/train"
    trace: bool = True  # record measured timelines (per-step bubble, timeline.html, trace.json)
    seed: int = 1234
    lr: float = 3e-3
    layers: int | None = None  # None: the smallest multiple of pp*v that is >= 8
    hidden: int = 64
    heads: int = 4
    seq_length: int = 32
    micro_batch_size: int = 4
    vocab: int = 64
    p2p_timeout_s: float = 120.0  # the plugin's wait on any peer
    timeout_s: float | None = None  # the whole run (local launch); None: from the size
    vertical_sync: bool = False  # pipedream only: every stage uses the entry version

    def __post_init__(self):
        # names in any case, or PyTorch's, as the registry's; pipedream and pipedream-2bw
        # (train.async_loop) too; unknown ones are left for check() to refuse
        try:
            object.__setattr__(self, "schedule",
                               resolve_schedule(self.schedule, asynchronous=True))
        except ScheduleError:
            pass

    # ---- derived
    @property
    def is_async(self) -> bool:
        """An asynchronous schedule (pipedream, pipedream-2bw): run by ``train.async_loop``."""
        return is_async_schedule(self.schedule)

    @property
    def is_file(self) -> bool:
        """Whether the schedule is a file (``--csv``, or ``--schedule FILE.csv``)."""
        return is_schedule_file(self.schedule)

    def file_schedule(self) -> Schedule | None:
        """The schedule file's schedule (validated), else None."""
        return load_schedule_file(self.schedule) if self.is_file else None

    def first_step_schedule(self) -> Schedule:
        """The schedule the first step runs: the file's, or the built one."""
        if self.is_file:
            return self.file_schedule()
        if self.is_async:
            return build_async_schedule(self.schedule, self.pp, self.microbatches, self.steps,
                                        **({"vertical_sync": True} if self.vertical_sync else {}))
        return build_schedule(self.first_schedule, self.pp, self.microbatches, self.v)

    @property
    def first_schedule(self) -> str:
        """The schedule of the first step: ``auto`` measures with 1f1b (one chunk per rank)
        or zb-v (--chunks 2: the V layout), then picks among the schedules of that layout."""
        if self.schedule != AUTO:
            return self.schedule
        return "zb-v" if self.chunks == 2 else "1f1b"

    @property
    def v(self) -> int:
        """Model chunks per rank."""
        if self.is_file:
            return self.file_schedule().chunks
        if self.is_async:
            return 1 if self.chunks is None else self.chunks
        spec = get_spec(self.first_schedule)
        if self.chunks is None and spec.default_chunks is None:  # zb-auto: the layout it picks
            return _chunks_it_picks(spec.name, self.pp, self.microbatches)
        return spec.default_chunks if self.chunks is None else self.chunks

    @property
    def layout(self) -> str:
        """``"v"`` for zb-v / dualpipev (rank r holds stages r and 2p-1-r), else ``"loop"``; a
        schedule file's from its stage-to-rank mapping."""
        if self.is_file:
            return schedule_layout(self.file_schedule())
        if self.is_async:
            return "loop"
        return get_spec(self.first_schedule).layout_for(self.v)

    @property
    def vp_size(self) -> int | None:
        """Megatron's virtual pipeline size (None for one chunk per rank)."""
        return self.v if self.v > 1 else None

    @property
    def num_layers(self) -> int:
        if self.layers is not None:
            return self.layers
        stages = self.pp * self.v
        return stages * max(1, -(-8 // stages))

    @property
    def run_timeout_s(self) -> float:
        if self.timeout_s is not None:
            return self.timeout_s
        return 180.0 + 10.0 * self.steps * max(1, self.pp * self.microbatches // 16)

    def to_dict(self) -> dict:
        data = asdict(self)
        data.update(chunks=self.v, layers=self.num_layers, layout=self.layout)
        return data

    # ---- checks
    def check(self) -> None:
        """Raise ``ValueError`` (one sentence, with the fix) for anything that cannot run."""
        if self.vertical_sync and self.schedule != "pipedream":
            raise ValueError(f"--vertical-sync is PipeDream's option; {self.schedule} does not "
                             "take it (use --schedule pipedream)")
        if self.is_async and self.chunks not in (None, 1):
            raise ValueError(f"--chunks {self.chunks} does not fit {self.schedule}: it runs one "
                             "model chunk per rank (leave --chunks out)")
        if self.is_file:
            self._check_file()
        elif self.schedule == AUTO and self.chunks not in (None, 1, 2):
            raise ValueError(f"--schedule auto takes --chunks 1 (gpipe, 1f1b, zb-h1, zb-h2) or 2 "
                             f"(the V layout: zb-v, dualpipev), not {self.chunks}")
        spec = None if self.is_file or self.is_async else get_spec(self.first_schedule)  # unknown: closest named
        for name in ("pp", "microbatches", "steps", "hidden", "heads", "seq_length",
                     "micro_batch_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                flag = _FLAGS.get(name, f"--{name.replace('_', '-')}")
                raise ValueError(f"{flag} {value} must be an integer >= 1")
        if self.vocab < 2:
            raise ValueError(f"--vocab {self.vocab} must be >= 2")
        if self.lr <= 0:
            raise ValueError(f"--lr {self.lr} must be > 0")
        if self.p2p_timeout_s <= 0 or (self.timeout_s is not None and self.timeout_s <= 0):
            raise ValueError("timeouts must be > 0 seconds")
        if self.chunks is not None and self.chunks < 1:
            raise ValueError(f"--chunks {self.chunks} must be >= 1")
        if spec is not None and not spec.allowed_chunks(self.v):
            rule = {"v": "2 (the V layout)", "loop": "1", "dual": "2 (part r and a copy of "
                    "part p-1-r)", "auto": "1 (the loop layout) or 2 (the V layout)"}[spec.layout]
            if spec.name == "interleaved":
                rule = ">= 2"
            raise ValueError(f"--chunks {self.v} does not fit {self.schedule}: it needs {rule}")
        if self.pp == 1 and self.v > 1:
            raise ValueError(
                f"{self.schedule} needs -p 2 or more (at p=1 Megatron runs its own "
                "no-pipelining loop, which takes one model chunk); use -p 2 or --schedule 1f1b"
            )
        if self.layout == "dual" and self.num_layers % self.pp:
            raise ValueError(
                f"--layers {self.num_layers} must be a multiple of pp = {self.pp} (dualpipe "
                f"splits the model in p parts, as 1F1B); try --layers {self.pp * 2}")
        if self.layout != "dual" and self.num_layers % (self.pp * self.v):
            raise ValueError(
                f"--layers {self.num_layers} must be a multiple of pp*v = {self.pp}*{self.v} "
                f"(one equal share per stage); try --layers {self.pp * self.v * 2}"
            )
        if self.hidden % self.heads:
            raise ValueError(f"--hidden {self.hidden} must be a multiple of --heads {self.heads}")
        if self.is_file:
            return
        if self.is_async:
            try:  # 2BW: m >= p
                self.first_step_schedule()
            except ScheduleError as exc:
                raise ValueError(" ".join(str(exc).split())) from None
            return
        try:  # the builder's own constraints (e.g. interleaved: p <= m, m mod p), validated
            build_schedule(self.first_schedule, self.pp, self.microbatches, self.v)
        except ScheduleError as exc:
            raise ValueError(" ".join(str(exc).split())) from None

    def _check_file(self) -> None:
        """A schedule file: validated, its NCCL program checked, and written for the run's
        p, m and chunks."""

        schedule = PipelineOptions(schedule=self.schedule).file_schedule()  # + NCCL's rules
        for name, want, what in (("pp", schedule.num_ranks, "pipeline ranks (one row per rank)"),
                                 ("microbatches", schedule.num_microbatches, "microbatches")):
            value = getattr(self, name)
            if value != want:
                flag = _FLAGS[name].split("/")[0]
                raise ValueError(
                    f"{_FLAGS[name]} {value} does not fit the schedule file {self.schedule}, "
                    f"written for {want} {what}: use {flag} {want} (or leave {flag} out), or "
                    f"write the schedule for {value}")
        if self.chunks is not None and self.chunks != schedule.chunks:
            raise ValueError(
                f"--chunks {self.chunks} does not fit the schedule file {self.schedule}, which "
                f"places {schedule.chunks} stage(s) on each rank ({self.layout} layout): leave "
                "--chunks out")

    def check_world(self, world_size: int) -> None:
        """Under torchrun / srun: the world must be a whole number of pipelines (one, for an
        asynchronous schedule)."""
        if self.is_async and world_size != self.pp:
            raise ValueError(
                f"{self.schedule} runs one pipeline (no data parallelism): start {self.pp} "
                f"processes, not {world_size}")
        if world_size % self.pp:
            raise ValueError(
                f"the launcher started {world_size} processes, not a multiple of -p {self.pp}; "
                f"start {self.pp} (or k*{self.pp} for k data-parallel replicas)"
            )
