"""A training script that knows nothing about megatron-pp-ext: it asks Megatron-Core for its
forward_backward_func, as Megatron-LM's train_step does, and runs a few steps of the tiny GPT.

    # Megatron's own 1F1B:
    .venv/bin/torchrun --nproc-per-node 2 docs/examples/megatron_step.py
    # the same script, unmodified, with the plugin's ZB-H1:
    MEGATRON_PP_SCHEDULE=zb-h1 .venv/bin/torchrun --nproc-per-node 2 \
        -m megatron_pp_ext.run docs/examples/megatron_step.py

CPU and gloo (the tiny GPT and the CPU shims come from megatron_pp_ext.models and megatron_pp_ext.train); pp = the number
of processes. Prints which function Megatron handed out and the loss of each step.
"""

import datetime
import os

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.pipeline_parallel.schedules import get_forward_backward_func

from megatron_pp_ext.models import tiny_gpt
from megatron_pp_ext.train.processes import init_megatron

STEPS, MICROBATCHES = 3, 8


def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    pp = dist.get_world_size()
    init_megatron(pp)  # Megatron's parallel state; CPU shims for its model code
    cfg = tiny_gpt.TinyGPTConfig()
    config = tiny_gpt.make_transformer_config(cfg, pp)
    model = tiny_gpt.build_model_chunks(cfg, config=config, wrap_ddp=True)
    tiny_gpt.configure_hooks(config, model)
    optimizer = torch.optim.SGD([p for chunk in model for p in chunk.parameters()], lr=0.5)
    last = parallel_state.is_pipeline_last_stage()
    for step in range(STEPS):
        for chunk in model:
            chunk.zero_grad_buffer()
        forward_backward_func = get_forward_backward_func()
        losses = forward_backward_func(
            forward_step_func=tiny_gpt.forward_step_func,
            data_iterator=iter(tiny_gpt.mock_batches(cfg, MICROBATCHES)),
            model=model, num_microbatches=MICROBATCHES, seq_length=cfg.seq_length,
            micro_batch_size=cfg.micro_batch_size)
        for chunk in model:
            for param in chunk.parameters():
                param.grad = param.main_grad
        optimizer.step()
        if last:
            loss = sum(float(x["lm loss"]) for x in losses) / len(losses)
            name = f"{forward_backward_func.__module__}.{forward_backward_func.__name__}"
            print(f"step {step}: loss {loss:.4f} via {name}", flush=True)
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
