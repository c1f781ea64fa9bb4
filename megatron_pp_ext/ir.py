"""The schedule IR: actions, per-rank action lists, and their CSV / JSON forms.

An action is (stage, kind, microbatch); its text form is ``{stage}{kind}{microbatch}``
(``0F3``, ``5I2``, ``5W2``), the same as PyTorch's ``torch.distributed.pipelining``
compute-only ``_Action`` strings, so schedules travel both ways as CSV.

No torch here: the IR, the builders, the validator and the simulator run anywhere.
"""

from __future__ import annotations

import csv
import io
import json
import re
from dataclasses import dataclass, field

FORWARD, BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT = "F", "B", "I", "W"
KINDS = (FORWARD, BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT)

_ACTION_RE = re.compile(r"^\s*(\d+)\s*([FBIW])\s*(\d+)\s*$")
# PyTorch writes DualPipeV's overlapped pair as "(0F7;7B3)OVERLAP_F_B".
_OVERLAP_RE = re.compile(r"^\s*\((.*)\)\s*OVERLAP_F_B\s*$")


class ScheduleError(ValueError):
    """A schedule that cannot run: bad text, bad builder arguments, or a failed validation."""


@dataclass(frozen=True, order=True)
class Action:
    stage: int
    kind: str
    microbatch: int

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ScheduleError(f"action kind {self.kind!r} is not one of {', '.join(KINDS)}")
        if self.stage < 0 or self.microbatch < 0:
            raise ScheduleError(f"action {self} has a negative stage or microbatch")

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"

    @staticmethod
    def parse(text: str) -> "Action":
        match = _ACTION_RE.match(text)
        if not match:
            raise ScheduleError(
                f"cannot parse action {text!r}: expected {{stage}}{{F|B|I|W}}{{microbatch}}, e.g. '0F3'"
            )
        return Action(int(match.group(1)), match.group(2), int(match.group(3)))


def parse_cell(text: str) -> list[Action]:
    """One CSV cell: empty (idle slot), one action, or PyTorch's overlapped F/B pair.

    An overlapped pair runs its two halves one after the other, in the written order.
    Communication cells (``0SEND_F1`` ...) are rejected: we load compute-only schedules
    and derive communication ourselves.
    """
    text = text.strip()
    if not text:
        return []
    overlap = _OVERLAP_RE.match(text)
    if overlap:
        return [Action.parse(part) for part in overlap.group(1).split(";") if part.strip()]
    if not _ACTION_RE.match(text):
        raise ScheduleError(
            f"cannot load cell {text!r}: only compute actions (F, B, I, W) and "
            "'(xFa;yBb)OVERLAP_F_B' pairs are accepted; communication is derived, not loaded"
        )
    return [Action.parse(text)]


@dataclass
class Schedule:
    """Every rank's ordered compute actions plus the stage-to-rank placement."""

    name: str
    num_microbatches: int
    stage_to_rank: tuple[int, ...]
    actions: list[list[Action]]
    options: dict = field(default_factory=dict)

    def __post_init__(self):
        self.stage_to_rank = tuple(self.stage_to_rank)
        self.actions = [list(rank_actions) for rank_actions in self.actions]

    @property
    def num_ranks(self) -> int:
        return len(self.actions)

    @property
    def num_stages(self) -> int:
        return len(self.stage_to_rank)

    @property
    def chunks(self) -> int:
        """Model chunks per rank (v); 1 for gpipe / 1f1b."""
        return max(1, self.num_stages // max(1, self.num_ranks))

    def rank_of(self, stage: int) -> int:
        return self.stage_to_rank[stage]

    def stages_of(self, rank: int) -> list[int]:
        """This rank's stages in chunk order: chunk c is the c-th smallest stage."""
        return [s for s, r in enumerate(self.stage_to_rank) if r == rank]

    def chunk_of(self, stage: int) -> int:
        return self.stages_of(self.rank_of(stage)).index(stage)

    # ---- microbatch paths: which stages a microbatch crosses, in order ----
    # Every schedule but one sends each microbatch through all stages 0..S-1. The
    # bidirectional DualPipe holds each model part twice: microbatches below
    # ``options["second_direction_from"]`` cross stages 0..S/2-1 (rank 0 to rank p-1), the
    # others stages S/2..S-1 (rank p-1 to rank 0), and stage S/2 + k is a copy of stage k.
    @property
    def second_direction_from(self) -> int | None:
        value = self.options.get("second_direction_from")
        return None if value is None else int(value)

    @property
    def model_stages(self) -> int:
        """How many distinct model parts the stages hold (S, or S/2 with two directions)."""
        stages = len(self.stage_to_rank)  # read directly: called per action in every pass
        return stages // 2 if self.options.get("second_direction_from") is not None else stages

    @property
    def path_chunks(self) -> int:
        """How many of a rank's stages one microbatch crosses: v (a stage holds 1/v of a
        rank's layers, and its activation 1/v of a v=1 activation), 1 for dualpipe (each
        stage is a whole part: what every activation count and per-rank cost is scaled by)."""
        return max(1, self.model_stages // max(1, self.num_ranks))

    def model_stage(self, stage: int) -> int:
        """The model part ``stage`` computes (its copy's stage in the first direction)."""
        return stage % self.model_stages

    def path(self, microbatch: int) -> range:
        """The stages ``microbatch`` crosses, first to last."""
        split = self.second_direction_from
        if split is None:
            return range(self.num_stages)
        half = self.num_stages // 2
        return range(0, half) if microbatch < split else range(half, self.num_stages)

    def upstream(self, stage: int) -> int | None:
        """The stage whose output ``stage`` takes (None: it reads the data)."""
        return None if self.is_entry(stage) else stage - 1

    def downstream(self, stage: int) -> int | None:
        """The stage that takes ``stage``'s output (None: ``stage`` computes the loss)."""
        return None if self.is_exit(stage) else stage + 1

    def is_entry(self, stage: int) -> bool:
        """Whether microbatches enter the pipeline at ``stage`` (the embedding's stage)."""
        return stage % self.model_stages == 0

    def is_exit(self, stage: int) -> bool:
        """Whether ``stage`` computes the loss (the output layer's stage)."""
        return stage % self.model_stages == self.model_stages - 1

    def neighbours(self) -> list[tuple[int | None, int | None]]:
        """Per stage, (``upstream``, ``downstream``): for passes over every action, which
        look each stage up once instead of once per action."""
        return [(self.upstream(s), self.downstream(s)) for s in range(self.num_stages)]

    def exit_stages(self) -> list[int]:
        return [s for s in range(self.num_stages) if self.is_exit(s)]

    def uses_split_backward(self) -> bool:
        return any(a.kind in (BACKWARD_INPUT, BACKWARD_WEIGHT) for row in self.actions for a in row)

    def text(self) -> list[list[str]]:
        return [[str(a) for a in row] for row in self.actions]

    # ---- CSV (PyTorch's compute-only format: a row per rank, an action per cell) ----
    def to_csv(self) -> str:
        buffer = io.StringIO()
        writer = csv.writer(buffer, lineterminator="\n")
        for row in self.text():
            writer.writerow(row)
        return buffer.getvalue()

    @staticmethod
    def from_csv(text: str, name: str = "csv", stage_to_rank=None) -> "Schedule":
        rows = [row for row in csv.reader(io.StringIO(text))]
        while rows and not any(cell.strip() for cell in rows[-1]):
            rows.pop()  # trailing blank lines
        if not rows:
            raise ScheduleError("the CSV holds no rows: expected one row of actions per rank")
        actions = [[a for cell in row for a in parse_cell(cell)] for row in rows]
        actions = _legacy_b_to_i(actions)
        return Schedule._from_rank_lists(name, actions, stage_to_rank)

    # ---- JSON ----
    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "num_ranks": self.num_ranks,
            "num_microbatches": self.num_microbatches,
            "stage_to_rank": list(self.stage_to_rank),
            "options": dict(self.options),
            "actions": self.text(),
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    @staticmethod
    def from_dict(data: dict) -> "Schedule":
        try:
            actions = [[Action.parse(t) for t in row] for row in data["actions"]]
        except (KeyError, TypeError) as exc:
            raise ScheduleError(f"schedule JSON lacks a valid 'actions' list of lists: {exc}") from None
        schedule = Schedule._from_rank_lists(
            data.get("name", "json"), actions, data.get("stage_to_rank")
        )
        schedule.options = dict(data.get("options", {}))
        if "num_microbatches" in data:
            schedule.num_microbatches = int(data["num_microbatches"])
        return schedule

    @staticmethod
    def from_json(text: str) -> "Schedule":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ScheduleError(f"schedule JSON does not parse: {exc}") from None
        return Schedule.from_dict(data)

    @staticmethod
    def _from_rank_lists(name, actions, stage_to_rank=None) -> "Schedule":
        if stage_to_rank is None:
            stage_to_rank = infer_placement(actions)
        microbatches = {a.microbatch for row in actions for a in row}
        return Schedule(
            name=name,
            num_microbatches=(max(microbatches) + 1) if microbatches else 0,
            stage_to_rank=tuple(stage_to_rank),
            actions=actions,
        )


def infer_placement(actions: list[list[Action]]) -> tuple[int, ...]:
    """Stage -> rank from the rows the stages appear in (a stage must live on one rank)."""
    owner: dict[int, int] = {}
    for rank, row in enumerate(actions):
        for action in row:
            previous = owner.setdefault(action.stage, rank)
            if previous != rank:
                raise ScheduleError(
                    f"stage {action.stage} appears on rank {previous} and on rank {rank} "
                    f"(action {action}): a stage must live on exactly one rank"
                )
    if not owner:
        return ()
    missing = sorted(set(range(max(owner) + 1)) - set(owner))
    if missing:
        raise ScheduleError(
            f"stages {missing} never appear in the schedule: stages must be numbered 0..S-1 "
            "without gaps"
        )
    return tuple(owner[s] for s in range(len(owner)))


def _legacy_b_to_i(actions: list[list[Action]]) -> list[list[Action]]:
    """Older PyTorch CSVs write the input-gradient half of a split backward as ``B``.

    A ``B`` that is followed later on its rank by a ``W`` of the same stage and microbatch
    is such a half: rewrite it as ``I``.
    """
    converted = []
    for row in actions:
        weights = {(a.stage, a.microbatch) for a in row if a.kind == BACKWARD_WEIGHT}
        converted.append(
            [
                Action(a.stage, BACKWARD_INPUT, a.microbatch)
                if a.kind == BACKWARD and (a.stage, a.microbatch) in weights
                else a
                for a in row
            ]
        )
    return converted
