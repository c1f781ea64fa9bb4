"""Spawn target: Megatron-LM's ``pretrain`` (``support.megatron_loop.run_pretrain``) that also
reports what ``--pp-post-validate`` did on this rank: the type of the optimizer the loop built
and, per step, the outcome of each post-validated step (kept, rolled back, redone clipped)."""

from __future__ import annotations

from typing import Any, Sequence


def run_pretrain_reporting_post_validation(rank: int, world_size: int,
                                           argv: Sequence[str]) -> dict[str, Any]:
    from megatron_pp_ext.integration import post_validation
    from support.megatron_loop import run_pretrain

    built = []
    original_init = post_validation.PostValidatedOptimizer.__init__

    def recording_init(self, optimizer):  # observation only
        original_init(self, optimizer)
        built.append(self)

    post_validation.PostValidatedOptimizer.__init__ = recording_init
    history = run_pretrain(rank, world_size, argv)
    history["post_validated"] = [
        [{"rolled_back": o.rolled_back, "redone": o.redone, "clipped": o.clipped,
          "found_inf": o.found_inf} for o in optimizer.history] for optimizer in built]
    return history
