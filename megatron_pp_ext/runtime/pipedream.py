"""The Python API for the asynchronous schedules: PipeDream (weight stashing, optional vertical
sync) and PipeDream-2BW, with your model chunks and your optimizer.

Megatron-LM's ``forward_backward_func`` runs one flushed step (all microbatches in, all
gradients out, then the optimizer), so it cannot express a pipeline whose stages update their
weights *inside* the action list; the plugin's drop-in refuses these names. Run them here
instead, one call for ``steps`` optimizer batches::

    from megatron_pp_ext.runtime.pipedream import AsyncPipeline

    pipeline = AsyncPipeline("pipedream-2bw", model_chunks=[my_stage_module], optimizer=adam,
                             forward_fn=forward_fn, num_microbatches=8, steps=50,
                             recv_shape=(seq, micro_batch, hidden), dtype=torch.float32)
    result = pipeline.run()          # every rank of the pipeline group calls it
    result.losses                    # the last stage's per-microbatch losses, in order

``forward_fn(stage, microbatch, call, input_tensor)`` runs one microbatch through the stage:
``call(*args, **kwargs)`` is the stage's module run on the weight version the schedule says
(``input_tensor`` is None on stage 0, which reads its own data); the last stage returns the
scalar loss. The optimizer is any ``torch.optim.Optimizer`` over this rank's parameters, or
Megatron's (``get_megatron_optimizer`` over the chunks wrapped in Megatron's DDP; no gradient
clipping, no fp16 loss scaling: both are collectives that per-stage updates cannot line up);
each update steps one stage's parameters with its accumulated gradients (written into
``main_grad`` where Megatron's DDP gave one; the loss is scaled by 1 / the microbatches per
update), through ``weight_versions.local_step``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from ..ir import Schedule
from .executor import Executor, StepResult
from .weight_versions import ForwardFn, VersionedStageWork, plan_versions
from ..schedules import build_async_schedule
from .transport import TorchDistTransport


@dataclass
class AsyncResult:
    step: StepResult  # the executor's result for the whole list (peak activations, calls)
    work: VersionedStageWork  # versions used (``record``), versions and bytes held
    losses: list[float]  # the last stage's losses by microbatch (empty on other ranks)

    @property
    def max_versions_held(self) -> int:
        return self.work.max_versions_held()

    @property
    def max_stashed_bytes(self) -> int:
        return self.work.max_stashed_bytes()

    def losses_per_step(self, microbatches_per_step: int) -> list[float]:
        """Mean loss of each optimizer batch (on the last stage's rank)."""
        m = microbatches_per_step
        return [sum(self.losses[i:i + m]) / m for i in range(0, len(self.losses) - m + 1, m)]


class AsyncPipeline:
    """One rank of an asynchronous pipeline over ``group`` (default: the whole world)."""

    def __init__(self, schedule: str | Schedule, model_chunks: Sequence[torch.nn.Module],
                 optimizer, forward_fn: ForwardFn, *, num_microbatches: int | None = None,
                 steps: int = 1, vertical_sync: bool = False, recv_shape: tuple | None = None,
                 dtype: torch.dtype = torch.float32, group=None, transport=None,
                 rank: int | None = None, device: torch.device | None = None,
                 timeout_s: float = 600.0, trace: bool = False, on_loss=None):
        if isinstance(schedule, str):
            import torch.distributed as dist

            size = transport.world_size if transport is not None else dist.get_world_size(group)
            if num_microbatches is None:
                raise ValueError("num_microbatches is required with a schedule name")
            options = {"vertical_sync": True} if vertical_sync else {}
            schedule = build_async_schedule(schedule, size, num_microbatches, steps=steps,
                                            **options)
        if transport is None:
            transport = TorchDistTransport(group, timeout_s=timeout_s)
        self.schedule, self.transport = schedule, transport
        self.rank = transport.rank if rank is None else rank
        stages = schedule.stages_of(self.rank)
        if len(model_chunks) != len(stages):
            raise ValueError(f"rank {self.rank} holds stages {stages} of {schedule.name}: give "
                             f"{len(stages)} model chunk(s), not {len(model_chunks)}")
        self.plan = plan_versions(schedule)
        self.work = VersionedStageWork(schedule, self.rank, dict(zip(stages, model_chunks)),
                                       optimizer, forward_fn, plan=self.plan, on_loss=on_loss)
        self.executor = Executor(schedule, self.rank, transport, self.work,
                                 recv_shape=recv_shape, dtype=dtype,
                                 device=device or getattr(transport, "device", torch.device("cpu")),
                                 timeout_s=timeout_s, trace=trace, memory=trace)

    def run(self) -> AsyncResult:
        """Run the whole action list (every step, no flush until the end)."""
        step = self.executor.run()
        losses = [self.work.losses[j] for j in sorted(self.work.losses)]
        return AsyncResult(step, self.work, losses)
