"""The Timeline: what ran where and when, predicted (simulator) or measured (tracer).

Both the simulator and the runtime tracer produce this type, so "predicted versus
measured" is one comparison and every renderer draws both.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

COMPUTE, COMM_WAIT = "compute", "comm"
# A P2P batch in flight on the rank's communication stream (NCCL-rules simulation): it runs
# beside the rank's compute, so it counts neither as busy nor as a wait.
P2P = "p2p"


@dataclass
class Event:
    rank: int
    label: str  # the action's text form ("0F3"), or what a wait waited for
    start: float
    end: float
    category: str = COMPUTE  # COMPUTE, COMM_WAIT or P2P

    @property
    def duration(self) -> float:
        return self.end - self.start

    @property
    def kind(self) -> str:
        """F/B/I/W for a compute event, '' for a wait."""
        if self.category != COMPUTE:
            return ""
        return next((ch for ch in self.label if ch.isalpha()), "")


@dataclass
class Timeline:
    schedule: str
    num_ranks: int
    num_microbatches: int
    #: a chunk-activation is 1/chunks of a rank's layers: v, or 1 for dualpipe (whose two
    #: chunks per rank are each a whole part of the model: ``Schedule.path_chunks``)
    chunks: int
    events: list[Event] = field(default_factory=list)
    peak_activations: list[int] = field(default_factory=list)
    source: str = "predicted"  # or "measured"
    unit: str = "t"  # time unit of start/end ("t" for cost-model units, "s" for seconds)
    # per rank, the peak activation BYTES (runtime/memory.py: measured; or the simulator's
    # count calibrated with one F's bytes per stage); empty when unknown. peak_activations
    # above is a COUNT of chunk-activations.
    peak_bytes: list = field(default_factory=list)
    #: 2 for dualpipe (microbatches from both ends; each rank holds two whole parts)
    directions: int = 1

    @property
    def layout_text(self) -> str:
        """``v=...`` as the headers write it: the chunks per rank, and dualpipe's directions."""
        if self.directions == 2:
            return f"v={2 * self.chunks}, two directions"
        return f"v={self.chunks}"

    def compute_events(self, rank: int | None = None) -> list[Event]:
        return [
            e for e in self.events if e.category == COMPUTE and (rank is None or e.rank == rank)
        ]

    @property
    def start(self) -> float:
        return min((e.start for e in self.events), default=0.0)

    @property
    def makespan(self) -> float:
        return max((e.end for e in self.events), default=0.0) - self.start

    def busy(self, rank: int) -> float:
        return sum(e.duration for e in self.compute_events(rank))

    def comm_wait(self, rank: int) -> float:
        return sum(e.duration for e in self.events if e.rank == rank and e.category == COMM_WAIT)

    def idle(self, rank: int) -> float:
        """Time this rank computed nothing (waits on communication included)."""
        return self.makespan - self.busy(rank)

    def _totals_by_rank(self) -> tuple[float, list[float], list[float]]:
        """(makespan, busy per rank, comm wait per rank) in one pass over the events."""
        busy = [0.0] * self.num_ranks
        wait = [0.0] * self.num_ranks
        for e in self.events:
            if 0 <= e.rank < self.num_ranks and e.category == COMPUTE:
                busy[e.rank] += e.duration
            elif 0 <= e.rank < self.num_ranks and e.category == COMM_WAIT:
                wait[e.rank] += e.duration
        return self.makespan, busy, wait

    @property
    def bubble_fraction(self) -> float:
        """Idle time over (ranks x makespan)."""
        makespan, busy, _ = self._totals_by_rank()
        if makespan <= 0 or self.num_ranks == 0:
            return 0.0
        idle = sum(makespan - b for b in busy)
        return idle / (self.num_ranks * makespan)

    @property
    def window_bubble_fraction(self) -> float:
        """Idle time inside each rank's own window (its first start to its last end) over the
        windows' total: the bubble that steps cannot hide by running into each other. ZB-H2's
        parallelogram has none, though its ``bubble_fraction`` equals ZB-H1's."""
        idle = window = 0.0
        for rank in range(self.num_ranks):
            events = self.compute_events(rank)
            if not events:
                continue
            span = max(e.end for e in events) - min(e.start for e in events)
            idle += span - sum(e.duration for e in events)
            window += span
        return idle / window if window > 0 else 0.0

    def per_rank_summary(self) -> list[dict]:
        makespan, busy, wait = self._totals_by_rank()
        return [
            {
                "rank": r,
                "busy": busy[r],
                "comm_wait": wait[r],
                "idle": makespan - busy[r],
                "peak_activations": (
                    self.peak_activations[r] if r < len(self.peak_activations) else None
                ),
                "peak_bytes": self.peak_bytes[r] if r < len(self.peak_bytes) else None,
            }
            for r in range(self.num_ranks)
        ]

    def to_dict(self) -> dict:
        data = asdict(self)
        data["makespan"] = self.makespan
        data["bubble_fraction"] = self.bubble_fraction
        data["window_bubble_fraction"] = self.window_bubble_fraction
        return data

    @staticmethod
    def of_schedule(schedule, events: list[Event], peak_activations: list[int], source: str,
                    unit: str) -> "Timeline":
        """A schedule's timeline, events ordered by rank then time (a wait before the
        compute it precedes)."""
        events.sort(key=lambda e: (e.rank, e.start, e.category == COMPUTE))
        return Timeline(schedule=schedule.name, num_ranks=schedule.num_ranks,
                        num_microbatches=schedule.num_microbatches,
                        chunks=schedule.path_chunks,
                        directions=1 if schedule.second_direction_from is None else 2,
                        events=events, peak_activations=list(peak_activations),
                        source=source, unit=unit)

    @staticmethod
    def from_dict(data: dict) -> "Timeline":
        fields = {k: v for k, v in data.items() if k not in ("makespan", "bubble_fraction",
                                                         "window_bubble_fraction")}
        fields["events"] = [Event(**e) for e in data.get("events", [])]
        return Timeline(**fields)
