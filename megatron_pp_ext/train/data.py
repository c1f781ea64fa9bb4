"""Training data the tiny GPT can learn in a few dozen steps: counting sequences.

Each sequence counts up from a random token by a random stride, modulo the vocabulary:
``start, start+k, start+2k, ...`` with ``k`` in ``STRIDES``. The first token cannot be
predicted (loss ln V), the second needs the stride (ln len(STRIDES)), every later one follows
from the two before it. So a model that learns reaches a loss near
``(ln V + ln 3) / s``, far below the ``ln V`` it starts from; fresh batches every step mean the
falling loss is learning, not memorising.

Batches are dicts in the format of Megatron-LM's ``get_batch`` (the same as
``models.tiny_gpt.mock_batches``, so ``models.tiny_gpt.forward_step_func`` consumes them): tokens and
labels ``[b, s]`` int64 (labels are the tokens shifted by one), loss_mask ``[b, s]`` float32,
position_ids ``[b, s]``, attention_mask ``[1, 1, s, s]`` bool, True = masked (causal).
"""

from __future__ import annotations

import torch

STRIDES = (1, 2, 3)


def counting_batches(num_microbatches: int, micro_batch_size: int, seq_length: int,
                     vocab_size: int, seed: int, step: int, replica: int = 0,
                     device: torch.device | str = "cpu") -> list[dict[str, torch.Tensor]]:
    """The microbatches of one step, deterministic in (seed, step, replica): every rank of a
    pipeline makes the same ones, and each data-parallel replica gets its own."""
    gen = torch.Generator(device="cpu").manual_seed(
        (int(seed) * 1_000_003 + int(step) * 7_919 + int(replica) * 104_729) % (2**63 - 1))
    b, s = micro_batch_size, seq_length
    positions = torch.arange(s + 1, dtype=torch.int64)
    attention_mask = torch.tril(torch.ones(1, 1, s, s)) < 0.5
    position_ids = torch.arange(s, dtype=torch.int64).unsqueeze(0).expand(b, s).contiguous()
    strides = torch.tensor(STRIDES, dtype=torch.int64)
    batches = []
    for _ in range(num_microbatches):
        start = torch.randint(0, vocab_size, (b, 1), generator=gen, dtype=torch.int64)
        stride = strides[torch.randint(0, len(STRIDES), (b, 1), generator=gen)]
        text = (start + stride * positions) % vocab_size
        batch = dict(
            tokens=text[:, :-1].contiguous(),
            labels=text[:, 1:].contiguous(),
            loss_mask=torch.ones(b, s, dtype=torch.float32),
            position_ids=position_ids.clone(),
            attention_mask=attention_mask.clone(),
        )
        batches.append({k: v.to(device) for k, v in batch.items()})
    return batches
