"""A single-process reference of PipeDream-2BW's update rule on the tiny Megatron-Core GPT
(pp = 1, the same weights: ``tiny_gpt.init_weights`` fills every parameter from its global
name, whatever the pipeline split), for ``train --schedule pipedream-2bw``'s defaults."""

from __future__ import annotations

import torch


def reference_2bw_losses(rank, world, steps: int, m: int, lr: float = 3e-3, seed: int = 1234,
                         layers: int = 8) -> list[float]:
    """``train.processes.spawn`` target (1 process): per-batch mean losses of

        W(t+1) = Adam(W(t), mean over the batch of grad f(W(t-1))),  W(-1) = W(0)."""
    from megatron_pp_ext.models import tiny_gpt
    from megatron_pp_ext.train.data import counting_batches
    from megatron_pp_ext.train.processes import init_megatron
    from megatron_pp_ext.train.settings import TrainSettings

    d = TrainSettings()
    cfg = tiny_gpt.TinyGPTConfig(num_layers=layers, hidden_size=d.hidden,
                                 num_attention_heads=d.heads, vocab_size=d.vocab,
                                 seq_length=d.seq_length, micro_batch_size=d.micro_batch_size,
                                 seed=seed, loss_mask_drop=0.0)
    init_megatron(1, None, seed=seed, force_cpu=True)
    config = tiny_gpt.make_transformer_config(cfg, 1, None)
    (model,) = tiny_gpt.build_model_chunks(cfg, vp_size=None, layout="loop", config=config)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    history = [{n: p.detach().clone() for n, p in model.named_parameters()}]
    losses = []
    for t in range(steps):
        used = {n: w.clone().requires_grad_(True) for n, w in history[max(t - 1, 0)].items()}
        total, values = None, []
        for b in counting_batches(m, cfg.micro_batch_size, cfg.seq_length, cfg.vocab_size,
                                  seed, t):
            out = torch.func.functional_call(model, used, (b["tokens"], b["position_ids"],
                                                           b["attention_mask"]),
                                             {"labels": b["labels"]})
            loss = tiny_gpt.loss_func(b["loss_mask"], out)[0]
            values.append(float(loss.detach()))
            grads = torch.autograd.grad(loss / m, list(used.values()))
            total = list(grads) if total is None else [a + g for a, g in zip(total, grads)]
        for p, g in zip(model.parameters(), total):
            p.grad = g
        optimizer.step()
        optimizer.zero_grad()
        history.append({n: p.detach().clone() for n, p in model.named_parameters()})
        losses.append(sum(values) / m)
    return losses
