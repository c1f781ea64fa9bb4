"""V-Half and V-Min: V-layout schedules that trade bubble for activation memory (Qi et al.,
"Pipeline Parallelism with Controllable Memory", NeurIPS 2024), built from their building
blocks (``v_blocks``) at equal F, I and W costs.

* **V-Half**: chunk 0's forwards and chunk 1's input gradients advance two slots per rank,
  the other two legs one (``Block(2, 1, 2, 1, turn0=3 for an even p else 0, turn1=1)``).
  Lifespans about 6p - 3i and 3i slots on rank i: about p chunk-activations, half of 1F1B's
  2p (p microbatches of a rank's layers on rank 0), plus a constant: 6 at p = 4 (0.75x),
  10 at p = 8 (0.62x). Bubble about half of 1F1B's.
* **V-Min**: every leg one slot per rank (``Block(1, 1, 1, 1, turn0=2 when 3 divides p else
  0)``). Lifespans about 4p - 2i and 2i: about 2p/3 chunk-activations, a third of 1F1B's,
  plus a constant: 4 at p = 4 and 8 at p = 8 (0.5x). Bubble about two thirds of 1F1B's.

Both are the authors' own construction (zero-bubble-pipeline-parallelism's ``zbv_greedy``:
the block repeated, then squeezed in two passes, ``v_blocks``), written our way: at p = 4..16,
m = 4p, the same bubble and the same busiest rank's peak as theirs, at free messages and with
message time (``bench/controllable_memory.py``, ``tests/test_controllable_memory.py``); where
the busiest rank's peak is above another rank's (V-Min at p = 5, 8, 11, 14), that rank keeps
its own lower peak rather than rising to it, at the same bubble. With m short of a steady
phase (rank 0's last forward before its first turn: m up to about p + 1 for V-Half, 2p/3 + 1
for V-Min) theirs moves nothing after that turn, ours also tries moving everything: the
faster is kept, at or below their bubble at free messages for every p = 2..16, m <= 4p (a
rank may then rise to the busiest rank's peak, never above it). The paper's 1/2 and 1/3 are
what the peaks tend to as p grows. Layout: the V (rank r holds stages r and 2p-1-r).
"""

from __future__ import annotations

from ..ir import Schedule
from ._common import check_sizes, forwards_only, require, v_placement
from .timing import as_actions
from .v_blocks import Block, block_orders


def v_half_block(p: int) -> Block:
    return Block(2, 1, 2, 1, turn0=3 if p % 2 == 0 else 0, turn1=1)


def v_min_block(p: int) -> Block:
    return Block(1, 1, 1, 1, turn0=2 if p % 3 == 0 else 0, turn1=0)


def _build(name: str, block: Block, num_ranks: int, num_microbatches: int,
           chunks: int, forward_only: bool) -> Schedule:
    check_sizes(name, num_ranks, num_microbatches)
    require(chunks == 2, name, f"chunks v={chunks}: {name} runs the V layout, v = 2")
    rows = as_actions(block_orders(num_ranks, num_microbatches, block))
    schedule = Schedule(name, num_microbatches, v_placement(num_ranks), rows, {"chunks": 2})
    return forwards_only(schedule) if forward_only else schedule


def build_v_half(num_ranks: int, num_microbatches: int, chunks: int = 2,
                 forward_only: bool = False) -> Schedule:
    """V-Half: about half of 1F1B's activation memory, about half its bubble."""
    return _build("v-half", v_half_block(num_ranks), num_ranks, num_microbatches, chunks,
                  forward_only)


def build_v_min(num_ranks: int, num_microbatches: int, chunks: int = 2,
                forward_only: bool = False) -> Schedule:
    """V-Min: about a third of 1F1B's activation memory, about two thirds of its bubble."""
    return _build("v-min", v_min_block(num_ranks), num_ranks, num_microbatches, chunks,
                  forward_only)
