"""Toy pipeline stages with real autograd, for tests, fuzzing and the emulated-device bench.

Each stage is one small linear layer (``tanh(x @ W_s)``); the last stage sums into a loss.
A backward can run whole (B) or split (I: input gradient now, W: weight gradient later),
through a generic split on the autograd graph. Optional per-kind costs sleep, standing in
for GPU kernels that run asynchronously to the CPU.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from megatron_pp_ext.ir import Action, Schedule


@dataclass
class EmulatedCosts:
    t_f: float = 0.0
    t_b: float | None = None  # None: t_i + t_w
    t_i: float = 0.0
    t_w: float = 0.0

    def of(self, kind: str) -> float:
        if kind == "B":
            return self.t_b if self.t_b is not None else self.t_i + self.t_w
        return {"F": self.t_f, "I": self.t_i, "W": self.t_w}[kind]


def stage_weights(num_stages: int, width: int, seed: int = 0, device=None,
                  dtype: torch.dtype = torch.float64) -> list[torch.Tensor]:
    """``device`` / ``dtype``: drawn in float64 on the CPU (the same numbers everywhere), then
    moved (the defaults move nothing)."""
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(width, width, generator=generator, dtype=torch.float64) / width**0.5)
            .to(device=device, dtype=dtype) for _ in range(num_stages)]


def microbatch_inputs(num_microbatches: int, rows: int, width: int, seed: int = 1,
                      device=None, dtype: torch.dtype = torch.float64):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(rows, width, generator=generator, dtype=torch.float64)
            .to(device=device, dtype=dtype) for _ in range(num_microbatches)]


class EmulatedStageWork:
    """The StageWork of one rank: its stages' weights, saved activations and pending W's."""

    def __init__(self, schedule: Schedule, rank: int, weights: list[torch.Tensor], inputs,
                 costs: EmulatedCosts | None = None, delay: float = 0.0):
        self.schedule, self.rank, self.inputs = schedule, rank, inputs
        self.costs = costs or EmulatedCosts()
        self.delay = delay  # extra jitter per action (fuzzing)
        # dualpipe holds each model part twice: a stage's weights are its part's
        self.params = {s: weights[schedule.model_stage(s)].clone().requires_grad_(True)
                       for s in schedule.stages_of(rank)}
        self.saved: dict[tuple, tuple] = {}  # (stage, mb) -> (input, output)
        self.pending_weight: dict[tuple, tuple] = {}  # (stage, mb) -> (output, grad)
        self.losses: dict[int, float] = {}
        self.deallocated = 0

    def _spend(self, kind: str) -> None:
        cost = self.costs.of(kind) + self.delay
        if cost > 0:
            time.sleep(cost)

    def forward(self, action: Action, input_tensor):
        self._spend("F")
        stage, mb = action.stage, action.microbatch
        x = self.inputs[mb] if self.schedule.is_entry(stage) else input_tensor
        y = torch.tanh(x @ self.params[stage])
        if self.schedule.is_exit(stage):
            y = y.sum() / self.schedule.num_microbatches
            self.losses[mb] = float(y.detach())
        self.saved[(stage, mb)] = (input_tensor, y)
        return y

    def backward(self, action: Action, output_grad):
        self._spend(action.kind)
        stage, mb = action.stage, action.microbatch
        x, y = self.saved.pop((stage, mb))
        grad = torch.ones_like(y) if output_grad is None else output_grad
        weight = self.params[stage]
        if action.kind == "B":
            inputs = (weight,) if x is None else (weight, x)
            grads = torch.autograd.grad(y, inputs, grad)
            weight.grad = grads[0] if weight.grad is None else weight.grad + grads[0]
            return None if x is None else grads[1]
        # I: input gradient now, keep the graph for the W that follows
        self.pending_weight[(stage, mb)] = (y, grad)
        if x is None:
            return None
        return torch.autograd.grad(y, (x,), grad, retain_graph=True)[0]

    def weight(self, action: Action) -> None:
        self._spend("W")
        y, grad = self.pending_weight.pop((action.stage, action.microbatch))
        weight = self.params[action.stage]
        (g,) = torch.autograd.grad(y, (weight,), grad)
        weight.grad = g if weight.grad is None else weight.grad + g

    def deallocate(self, output) -> None:
        self.deallocated += 1

    def gradients(self) -> dict[int, torch.Tensor]:
        return {s: p.grad for s, p in self.params.items()}
