"""``python -m megatron_pp_ext train``: train the tiny Megatron-Core GPT under any schedule.

One job per module:

* ``settings``  -- :class:`TrainSettings` (what the command line asks for) and its checks, run
  before any process starts. No torch.
* ``data``      -- a learnable token pattern, in the batch format of Megatron's ``get_batch``.
* ``launcher``  -- who starts the ranks: this command (P local gloo processes), torchrun, or srun.
* ``loop``      -- one rank's training: Megatron's parallel state, model, DDP, optimizer,
  ``install()`` and ``get_forward_backward_func()`` every step.
* ``measure``   -- a step's peaks per rank, measured and predicted timelines, per-rank costs.
* ``progress``  -- rank 0's progress bar and per-step lines.
* ``report``    -- summary.json, timeline.html and trace.json.
"""

from .settings import TrainSettings

__all__ = ["TrainSettings"]
