"""Rank 0's console output: a progress bar and one line per step.

On a terminal the bar stays on the bottom line, redrawn with ``\\r``, and each step's line is
printed above it. Anywhere else (a log file, a pipe, SLURM's output) there is no bar: one line
per step, each starting with ``[step/steps]``. Plain text, no escape sequences.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO
from ..units import format_bytes_list


def format_step(step: int, steps: int, loss: float, seconds: float, bubble: float | None,
                predicted: float | None, peaks: list[int],
                peak_bytes: list | None = None, device_peak: list | None = None) -> str:
    """``peaks``: per rank, the COUNT of chunk-activations held at the peak; ``peak_bytes``:
    per rank, the measured activation bytes (runtime/memory.py), shown in KiB / MiB / GiB;
    ``device_peak``: per rank, the CUDA allocator's peak over the step (GPUs only)."""
    width = len(str(steps))
    parts = [f"step {step:>{width}}/{steps}", f"loss {loss:7.4f}", f"time {seconds:6.3f} s"]
    if bubble is not None:
        text = f"bubble {100 * bubble:5.1f}%"
        if predicted is not None:
            text += f" (predicted {100 * predicted:4.1f}%)"
        parts.append(text)
    if peak_bytes is not None and any(b is not None for b in peak_bytes):
        parts.append(f"peak activations (count) {peaks}")
        parts.append(f"activation memory {format_bytes_list(peak_bytes)}")
        if device_peak is not None and any(b is not None for b in device_peak):
            parts.append(f"CUDA peak allocated {format_bytes_list(device_peak)}")
    else:
        parts.append(f"peak activations {peaks}")
    return "  ".join(parts)


class Progress:
    def __init__(self, steps: int, stream: TextIO | None = None, tty: bool | None = None,
                 width: int = 30):
        self.steps, self.width = steps, width
        self.stream = stream or sys.stdout
        self.tty = self.stream.isatty() if tty is None else tty
        self.started = time.perf_counter()
        self._bar_len = 0

    def _bar(self, done: int) -> str:
        filled = self.width * done // max(self.steps, 1)
        elapsed = time.perf_counter() - self.started
        eta = elapsed / done * (self.steps - done) if done else None
        tail = f"eta {eta:.0f} s" if eta is not None else "starting"
        return f"[{'#' * filled}{'.' * (self.width - filled)}] {done}/{self.steps}  {tail}"

    def _clear(self) -> None:
        if self._bar_len:
            self.stream.write("\r" + " " * self._bar_len + "\r")
            self._bar_len = 0

    def _draw(self, done: int) -> None:
        bar = self._bar(done)
        self.stream.write(bar)
        self._bar_len = len(bar)

    def start(self) -> None:
        if self.tty:
            self._draw(0)
            self.stream.flush()

    def step(self, done: int, line: str) -> None:
        """Step ``done`` (1-based) finished: print its line (and redraw the bar)."""
        if self.tty:
            self._clear()
            self.stream.write(line + "\n")
            if done < self.steps:
                self._draw(done)
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def message(self, text: str) -> None:
        """A line that is not a step (keeps the bar below it)."""
        if self.tty:
            self._clear()
        self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self._clear()
            self.stream.flush()
