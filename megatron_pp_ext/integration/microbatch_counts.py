"""The microbatch counts a Megatron-LM run's steps will take, read from its validated arguments.

With a fixed batch, every training step runs ``--global-batch-size / (--micro-batch-size x
data-parallel size)`` microbatches. Megatron 0.19's ``--step-batch-size-schedule "THRESHOLD:BATCH
..."`` (thresholds in tokens when ``--seq-length`` is known, as Megatron reads them) changes the
global batch as samples are consumed; Megatron then leaves ``--global-batch-size`` at micro batch x
data-parallel size, which no training step runs. An evaluation runs
``eval_global_batch_size / (eval_micro_batch_size x data-parallel size)`` forward-only.

:func:`step_counts` lists each distinct count with the arguments it comes from, so the argument-
time checks judge what the steps will run (and name the flag to change).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StepCount:
    """``num_microbatches`` that steps of the run take (``forward_only`` for evaluation), the
    arguments that give it and the flag that sets it (for error messages), and the samples
    one microbatch of every data-parallel replica takes (micro batch x data-parallel size)."""

    num_microbatches: int
    source: str
    flag: str
    samples_per_microbatch: int
    forward_only: bool = False

    def fix(self, num_microbatches: int) -> str:
        """How to make these steps run ``num_microbatches``."""
        return f"set {self.flag} {num_microbatches * self.samples_per_microbatch}"


def _parse_number(text: str) -> int:
    """Megatron's reading of a schedule number: K, M, B, T suffixes (1e3 ... 1e12)."""
    text = text.strip().upper()
    scale = {"K": 10**3, "M": 10**6, "B": 10**9, "T": 10**12}.get(text[-1:], 1)
    return int(float(text[:-1] if scale > 1 else text) * scale)


def parse_batch_size_schedule(text: str, seq_length: int | None) -> list[tuple[int, int, str]]:
    """``--step-batch-size-schedule`` as Megatron reads it: [(threshold in samples, global
    batch, the entry as written)], sorted by threshold (token thresholds divided by
    ``seq_length``)."""
    entries = []
    for entry in text.strip().replace(",", " ").split():
        threshold, _, batch = entry.partition(":")
        if not batch:
            raise ValueError(f"--step-batch-size-schedule entry {entry!r} is not "
                             "THRESHOLD:BATCH_SIZE (e.g. \"0:256 1B:512\")")
        samples = _parse_number(threshold)
        if seq_length:
            samples //= seq_length
        entries.append((samples, _parse_number(batch), entry))
    return sorted(entries)


def _entry_at(entries: list[tuple[int, int, str]], consumed: int) -> tuple[int, int, str]:
    """The entry whose batch a step takes after ``consumed`` samples (Megatron's
    ``_get_batch_size_for_samples``: the last threshold reached, else the first entry)."""
    current = entries[0]
    for entry in entries:
        if consumed >= entry[0]:
            current = entry
    return current


def _entries_reached(entries: list[tuple[int, int, str]], train_iters: int | None) -> list:
    """The schedule's entries that steps 1..train_iters run (every entry when the run's
    length is not given in iterations)."""
    if not train_iters:
        return list(entries)
    reached, consumed = [], 0
    for _ in range(train_iters):
        entry = _entry_at(entries, consumed)
        if entry not in reached:
            reached.append(entry)
        consumed += entry[1]
    return reached


def step_counts(args: Any) -> list[StepCount] | None:
    """The distinct microbatch counts of the run's training (and evaluation) steps, or None
    when the arguments do not fix them yet (not validated)."""
    micro, dp = (getattr(args, key, None) for key in ("micro_batch_size", "data_parallel_size"))
    if not all(isinstance(x, int) and x > 0 for x in (micro, dp)):
        return None
    per_step = f"(--micro-batch-size {micro} x data-parallel size {dp})"
    counts: list[StepCount] = []
    schedule = getattr(args, "step_batch_size_schedule", None)
    if schedule:
        entries = parse_batch_size_schedule(schedule, getattr(args, "seq_length", None))
        for _, batch, entry in _entries_reached(entries, getattr(args, "train_iters", None)):
            counts.append(StepCount(batch // (micro * dp), f"--step-batch-size-schedule entry "
                                    f"{entry}: global batch {batch} / {per_step}",
                                    f"the batch of --step-batch-size-schedule entry {entry} to",
                                    micro * dp))
    elif isinstance(getattr(args, "global_batch_size", None), int):
        batch = args.global_batch_size
        counts.append(StepCount(batch // (micro * dp), f"--global-batch-size {batch} / "
                                f"{per_step}", "--global-batch-size", micro * dp))
    counts += _eval_counts(args, dp)
    return list({(c.num_microbatches, c.forward_only): c for c in counts}.values())


def _eval_counts(args: Any, dp: int) -> list[StepCount]:
    """The forward-only count of an evaluation, when the run evaluates."""
    eval_batch = getattr(args, "eval_global_batch_size", None)
    eval_micro = getattr(args, "eval_micro_batch_size", None) or getattr(args, "micro_batch_size")
    if not getattr(args, "eval_iters", 0) or not isinstance(eval_batch, int):
        return []
    return [StepCount(eval_batch // (eval_micro * dp),
                      f"evaluation: --eval-global-batch-size {eval_batch} / "
                      f"(--eval-micro-batch-size {eval_micro} x data-parallel size {dp})",
                      "--eval-global-batch-size", eval_micro * dp, forward_only=True)]
