"""PipeDream's asynchronous pipeline and PipeDream-2BW, as schedules of the same IR.

Both run the 1F1B order (warmup p-1-r forwards on rank r, then one forward and one backward
in turn) *without a flush*: one action list spans ``steps`` optimizer batches of ``m``
microbatches each, ``steps * m`` microbatches in all, and the pipeline drains only at the very
end of the run. What makes them asynchronous is not the order but *when weights change*, which
the schedule states in ``options["weight_update"]`` (read by ``runtime.weight_versions``):

* ``pipedream`` (Harlap et al., "PipeDream: Generalized Pipeline Parallelism for DNN
  Training", SOSP 2019): every stage applies an update after *every* backward (``batch`` 1).
  Weight stashing: a microbatch's forward runs with the stage's newest version and its
  backward with that same version (stashed), so stage r holds up to p - r versions. With
  ``vertical_sync=True`` every stage runs a microbatch with the version *it entered the
  pipeline with* (the version stage 0 used), i.e. ``W(t+1) = W(t) - lr * grad f(W(t-p+1))``
  on every stage.
* ``pipedream-2bw`` (Narayanan et al., "Memory-Efficient Pipeline-Parallel DNN Training",
  ICML 2021): gradients accumulate over a batch of ``m`` microbatches and each stage applies
  them one batch late: batch b runs on version ``max(b - 1, 0)`` on every stage, and after its
  last backward a stage makes version b + 1 from version b, so
  ``W(t+1) = W(t) - lr * grad f(W(t-1))`` and no stage holds more than 2 versions. Needs
  m >= p (the paper's m >= d) so that no batch starts before the one two back is finished.

Nothing here changes an action: the versions are implied by the order plus the update rule,
so the CSV / JSON forms are plain 1F1B lists (the JSON keeps the rule in ``options``). These
schedules change the optimizer's semantics: they are registered apart (``ASYNC_REGISTRY``),
are never candidates of ``select``, ``auto`` or ``compare``, and cannot run under Megatron's
``forward_backward_func``, which flushes every step (``megatron_pp_ext.runtime.pipedream``
and ``train --schedule pipedream`` run them).
"""

from __future__ import annotations

from ..ir import Action, Schedule
from ._common import check_sizes, loop_placement, require

PIPEDREAM, PIPEDREAM_2BW = "pipedream", "pipedream-2bw"


def _one_f_one_b_rows(p: int, total: int) -> list[list[Action]]:
    rows = []
    for rank in range(p):
        warmup = min(p - 1 - rank, total)
        steady = total - warmup
        row = [Action(rank, "F", mb) for mb in range(warmup)]
        for i in range(steady):
            row.append(Action(rank, "F", warmup + i))
            row.append(Action(rank, "B", i))
        row += [Action(rank, "B", steady + i) for i in range(warmup)]
        rows.append(row)
    return rows


def _check(name: str, num_ranks: int, num_microbatches: int, chunks: int, steps: int) -> None:
    check_sizes(name, num_ranks, num_microbatches)
    require(chunks == 1, name, f"chunks v={chunks}: runs one model chunk per rank (v = 1)")
    require(isinstance(steps, int) and steps >= 1, name,
            f"steps={steps!r} must be an integer >= 1 (optimizer batches the list spans)")


def build_pipedream(num_ranks: int, num_microbatches: int, chunks: int = 1, steps: int = 2,
                    vertical_sync: bool = False, **_options) -> Schedule:
    """Asynchronous 1F1B over ``steps * m`` microbatches, an update after every backward."""
    _check(PIPEDREAM, num_ranks, num_microbatches, chunks, steps)
    total = steps * num_microbatches
    return Schedule(PIPEDREAM, total, loop_placement(num_ranks, 1),
                    _one_f_one_b_rows(num_ranks, total), {
                        "asynchronous": True, "steps": steps,
                        "microbatches_per_step": num_microbatches,
                        "weight_update": {"rule": PIPEDREAM, "batch": 1, "delay": 0,
                                          "vertical_sync": bool(vertical_sync)},
                    })


def build_pipedream_2bw(num_ranks: int, num_microbatches: int, chunks: int = 1, steps: int = 2,
                        **_options) -> Schedule:
    """Asynchronous 1F1B over ``steps * m`` microbatches, an update after each batch's last
    backward, applied one batch late (two weight versions)."""
    _check(PIPEDREAM_2BW, num_ranks, num_microbatches, chunks, steps)
    require(num_microbatches >= num_ranks, PIPEDREAM_2BW,
            f"m={num_microbatches} microbatches per batch must be >= p={num_ranks} (the "
            "paper's m >= d): with fewer, a batch would start on a stage before the batch two "
            f"back has finished there, and 2 weight versions would not do; use -m {num_ranks}")
    total = steps * num_microbatches
    return Schedule(PIPEDREAM_2BW, total, loop_placement(num_ranks, 1),
                    _one_f_one_b_rows(num_ranks, total), {
                        "asynchronous": True, "steps": steps,
                        "microbatches_per_step": num_microbatches,
                        "weight_update": {"rule": PIPEDREAM_2BW, "batch": num_microbatches,
                                          "delay": 1, "vertical_sync": False},
                    })
