"""Weight versions for the asynchronous schedules (``schedules.pipedream``).

Two halves:

* ``plan_versions(schedule)`` (in ``schedules.pipedream``, torch-free): from the IR alone (the action order plus
  ``options["weight_update"]``), the version every (stage, microbatch) runs its F and its B
  with, after which backwards a stage updates, and how many actions use each version. Every
  rank knows every action list, so every rank derives the same plan; with vertical sync a
  microbatch's version is the one stage 0 used, known on every stage without a message.
* ``VersionedStageWork``: a ``StageWork`` for the executor that runs each stage's
  ``torch.nn.Module`` with the planned version's weights (``torch.func.functional_call`` on
  stashed tensors: the module's own parameters never enter autograd, so the optimizer may
  update them in place while older versions are still in flight), accumulates each
  backward's weight gradients, and at the planned points hands them to the optimizer and
  snapshots the result as the next version. A version is dropped once its last planned use
  has run and it is not the newest. Every F and B records the version it really used
  (``record``), and the work tracks the versions held and their bytes.

Version k of a stage is its weights after k updates (version 0: the initial weights).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Callable

import torch

from ..ir import BACKWARD, FORWARD, Action, Schedule, ScheduleError
# the plan is the IR's business (torch-free, beside the builders); re-exported here
from ..schedules.pipedream import (  # noqa: F401
    UpdateRule,
    VersionPlan,
    plan_versions,
    update_rule,
)


#: What a versioned work calls per forward: ``forward_fn(stage, microbatch, call, input)`` with
#: ``call(*args, **kwargs)`` running the stage's module on the planned version's weights;
#: returns the stage's output (the last stage: the scalar loss to backpropagate).
ForwardFn = Callable[[int, int, Callable, object], torch.Tensor]


@dataclass
class VersionRecord:
    action: str
    stage: int
    microbatch: int
    kind: str
    version: int


def local_step(optimizer) -> None:
    """Step ``optimizer`` on this rank alone. A torch optimizer's ``step()`` is local; Megatron's
    ``step()`` is not (its ``ChainedOptimizer`` all-reduces the gradient norm over the
    model-parallel group every step, and the pipeline ranks update at different times here), so
    each of its optimizers runs its local halves: ``prepare_grads()`` (``main_grad`` into
    ``.grad``) and ``step_with_ready_grads()``."""
    chained = getattr(optimizer, "chained_optimizers", None)
    targets = chained if chained is not None else [optimizer]
    for target in targets:
        if getattr(target, "is_stub_optimizer", False):
            continue
        if callable(getattr(target, "prepare_grads", None)) and callable(
                getattr(target, "step_with_ready_grads", None)):
            if getattr(target, "grad_scaler", None) is not None:
                raise ValueError(
                    "Megatron's fp16 optimizer checks for inf/nan with an all-reduce over the "
                    "model-parallel group at every step, which the asynchronous schedules' "
                    "per-stage updates cannot line up: use fp32 or bf16")
            target.prepare_grads()
            target.step_with_ready_grads()
        else:
            target.step()


def _clip_of(optimizer) -> float:
    chained = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    return max((getattr(getattr(o, "config", None), "clip_grad", 0.0) or 0.0) for o in chained)


class StageVersions:
    """One stage's weight versions: detached snapshots of its module's parameters."""

    def __init__(self, stage: int, module: torch.nn.Module, plan: VersionPlan):
        self.stage, self.module = stage, module
        self.names = [n for n, p in module.named_parameters() if p.requires_grad]
        self.params = [p for n, p in module.named_parameters() if p.requires_grad]
        self.remaining = {v: n for (s, v), n in plan.uses.items() if s == stage}
        self.latest = 0
        self.versions: dict[int, list[torch.Tensor]] = {0: self._snapshot()}
        self.grads: list[torch.Tensor | None] = [None] * len(self.params)
        self.max_held = 1
        self.max_bytes = self.bytes_held()

    def _snapshot(self) -> list[torch.Tensor]:
        return [p.detach().clone().requires_grad_(True) for p in self.params]

    def weights(self, version: int) -> dict[str, torch.Tensor]:
        if version not in self.versions:
            raise RuntimeError(f"stage {self.stage}: version {version} is not held (held: "
                               f"{sorted(self.versions)}); the plan and the run disagree")
        return dict(zip(self.names, self.versions[version]))

    def used(self, version: int) -> None:
        self.remaining[version] = self.remaining.get(version, 0) - 1
        self._drop()

    def accumulate(self, grads) -> None:
        for i, g in enumerate(grads):
            if g is None:
                continue
            self.grads[i] = g.detach().clone() if self.grads[i] is None else self.grads[i] + g

    def update(self, optimizer, new_version: int) -> None:
        """The optimizer steps this stage's parameters with the accumulated gradients (other
        stages' parameters get no gradient, so the optimizer leaves them alone), and the
        result becomes ``new_version``."""
        others = {id(p) for p in self.params}
        saved = []
        for group in optimizer.param_groups:
            for p in group["params"]:
                if id(p) not in others and p.grad is not None:
                    saved.append((p, p.grad))
                    p.grad = None
        for p, g in zip(self.params, self.grads):
            g = torch.zeros_like(p) if g is None else g.to(p.dtype)
            if getattr(p, "main_grad", None) is not None:
                # Megatron DDP's buffer: Megatron's optimizer takes the gradient from there
                p.main_grad.copy_(g)
                p.grad = None
            else:
                p.grad = g
        local_step(optimizer)
        for p in self.params:
            p.grad = None
            if getattr(p, "main_grad", None) is not None:
                p.main_grad.zero_()
        for p, g in saved:
            p.grad = g
        self.grads = [None] * len(self.params)
        self.latest = new_version
        self.versions[new_version] = self._snapshot()
        self._drop()

    def _drop(self) -> None:
        for v in list(self.versions):
            if v != self.latest and self.remaining.get(v, 0) <= 0:
                del self.versions[v]
        self.max_held = max(self.max_held, len(self.versions))
        self.max_bytes = max(self.max_bytes, self.bytes_held())

    def bytes_held(self) -> int:
        return sum(t.numel() * t.element_size() for ts in self.versions.values() for t in ts)


class VersionedStageWork:
    """The executor's ``StageWork`` for an asynchronous schedule on one rank.

    ``modules``: stage -> this rank's module for it; ``optimizer``: one optimizer over their
    parameters (any ``torch.optim.Optimizer``, or Megatron's ``get_megatron_optimizer`` over
    the same modules wrapped in Megatron's DDP, without gradient clipping: each update writes
    the gradients into ``main_grad``; each update steps one stage's parameters);
    ``forward_fn``: see ``ForwardFn``; ``loss_scale``: what the last stage's loss is
    multiplied by before its backward (default: 1 / the rule's batch, so an update follows
    the mean gradient of its batch); ``on_loss(microbatch, value)``: called with each loss.
    """

    def __init__(self, schedule: Schedule, rank: int, modules: dict[int, torch.nn.Module],
                 optimizer, forward_fn: ForwardFn, plan: VersionPlan | None = None,
                 loss_scale: float | None = None, on_loss=None):
        self.schedule, self.rank = schedule, rank
        self.plan = plan or plan_versions(schedule)
        if sorted(modules) != schedule.stages_of(rank):
            raise ValueError(f"rank {rank} holds stages {schedule.stages_of(rank)}, but modules "
                             f"were given for stages {sorted(modules)}")
        self.modules, self.optimizer, self.forward_fn = modules, optimizer, forward_fn
        clip = _clip_of(optimizer)
        if clip > 0 and schedule.num_ranks > 1:
            raise ValueError(
                f"{schedule.name}: the optimizer clips gradients (clip_grad={clip}), which "
                "all-reduces the gradient norm over the pipeline ranks at every step; here each "
                "stage updates at its own time, so those collectives would not line up: set "
                "clip_grad=0 (OptimizerConfig) or use a torch.optim optimizer")
        self.stages = {s: StageVersions(s, m, self.plan) for s, m in modules.items()}
        self.loss_scale = 1.0 / self.plan.rule.batch if loss_scale is None else loss_scale
        self.on_loss = on_loss
        self.last = schedule.num_stages - 1
        self.saved: dict[tuple[int, int], tuple] = {}
        self.record: list[VersionRecord] = []
        self.losses: dict[int, float] = {}
        self.in_flight: dict[int, collections.Counter] = {s: collections.Counter()
                                                          for s in modules}
        self.max_in_flight = 0
        self.updates = 0

    # ---- StageWork
    def forward(self, action: Action, input_tensor):
        s, j = action.stage, action.microbatch
        v = self.plan.version[(s, j)]
        versions = self.stages[s]
        weights = versions.weights(v)
        module = self.modules[s]

        def call(*args, **kwargs):
            return torch.func.functional_call(module, weights, args, kwargs, strict=False)

        output = self.forward_fn(s, j, call, input_tensor)
        if s == self.last:
            self.losses[j] = float(output.detach())
            if self.on_loss is not None:
                self.on_loss(j, self.losses[j])
        self.saved[(s, j)] = (input_tensor, output, weights, v)
        self.record.append(VersionRecord(str(action), s, j, FORWARD, v))
        versions.used(v)
        self.in_flight[s][v] += 1
        self.max_in_flight = max(self.max_in_flight,
                                 sum(len(c) for c in self.in_flight.values()))
        return output

    def backward(self, action: Action, output_grad):
        if action.kind != BACKWARD:
            raise ScheduleError(f"{action}: asynchronous schedules run full backwards only")
        s, j = action.stage, action.microbatch
        x, y, weights, v = self.saved.pop((s, j))
        if output_grad is None:  # the last stage: the loss
            y = y * self.loss_scale
            output_grad = torch.ones_like(y)
        params = list(weights.values())
        wants_input = x is not None and x.requires_grad
        inputs = params + ([x] if wants_input else [])
        grads = torch.autograd.grad(y, inputs, output_grad, allow_unused=True)
        versions = self.stages[s]
        versions.accumulate(grads[:len(params)])
        self.record.append(VersionRecord(str(action), s, j, BACKWARD, v))
        self.in_flight[s][v] -= 1
        if not self.in_flight[s][v]:
            del self.in_flight[s][v]
        versions.used(v)
        if (s, j) in self.plan.update_after:
            versions.update(self.optimizer, self.plan.update_after[(s, j)])
            self.updates += 1
        return grads[-1] if wants_input else None

    def weight(self, action: Action) -> None:
        raise ScheduleError(f"{action}: asynchronous schedules run full backwards only")

    def deallocate(self, output) -> None:
        pass

    # ---- what the run held
    def max_versions_held(self) -> int:
        """The most versions this rank's stages held at once (summed over its stages; v=1)."""
        return sum(v.max_held for v in self.stages.values())

    def max_stashed_bytes(self) -> int:
        """The most bytes of weight versions held at once, beyond the parameters themselves."""
        return sum(v.max_bytes for v in self.stages.values())

    def versions_of(self) -> dict[tuple[int, int, str], int]:
        """(stage, microbatch, F or B) -> the version the action really used."""
        return {(r.stage, r.microbatch, r.kind): r.version for r in self.record}
