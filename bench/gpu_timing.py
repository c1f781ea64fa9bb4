"""The GPU check's timing: a timer per rank that marks each action's start and end (CUDA
events on the rank's current stream, or perf_counter on the CPU), the toy stages timed by it,
and the per-kind millisecond summaries the check prints (F, B, I, W)."""

from __future__ import annotations

import time

import torch

from support.inmemory import RecordingWork

KINDS = ("F", "B", "I", "W")


class ActionTimer:
    """Start / end marks per action: CUDA events on the current stream, or perf_counter."""

    def __init__(self, cuda: bool):
        self.cuda, self.marks = cuda, []  # (kind, start, end)

    def _mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()  # on the current stream: the rank's
        return event

    def timed(self, kind: str, fn):
        start = self._mark()
        out = fn()
        self.marks.append((kind, start, self._mark()))
        return out

    def ms_by_kind(self) -> dict[str, list[float]]:
        """Milliseconds per action, by kind (on CUDA: call after a synchronize)."""
        out: dict[str, list[float]] = {}
        for kind, start, end in self.marks:
            ms = start.elapsed_time(end) if self.cuda else (end - start) * 1e3
            out.setdefault(kind, []).append(ms)
        return out


class TimedWork(RecordingWork):
    """The toy stages, recording the order of what they computed and each action's time."""

    def __init__(self, *args, timer: ActionTimer, **kwargs):
        super().__init__(*args, **kwargs)
        self.timer = timer

    def forward(self, action, input_tensor):
        return self.timer.timed("F", lambda: super(TimedWork, self).forward(action, input_tensor))

    def backward(self, action, output_grad):
        return self.timer.timed(action.kind,
                                lambda: super(TimedWork, self).backward(action, output_grad))

    def weight(self, action):
        return self.timer.timed("W", lambda: super(TimedWork, self).weight(action))


def merge_ms(timers) -> dict[str, list[float]]:
    merged: dict[str, list[float]] = {}
    for timer in timers:
        for kind, values in timer.ms_by_kind().items():
            merged.setdefault(kind, []).extend(values)
    return merged


def format_ms(ms_by_kind: dict[str, list[float]]) -> str:
    return " ".join(f"{k} {sum(v) / len(v):.3f}" for k in KINDS if (v := ms_by_kind.get(k)))


def merge_runs_ms(runs) -> str:
    merged: dict[str, list[float]] = {}
    for run in runs:
        for kind, values in run.ms_by_kind.items():
            merged.setdefault(kind, []).extend(values)
    return format_ms(merged) or "-"
