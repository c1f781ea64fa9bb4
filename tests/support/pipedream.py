"""Toy stages (``tanh(x @ W_s)``, the last summed into a loss) for the asynchronous schedules,
run on the in-memory transport through the one executor, and the single-process references
of PipeDream's and PipeDream-2BW's update rules written from the papers' equations."""

from __future__ import annotations

import torch

from megatron_pp_ext.ir import Schedule
from megatron_pp_ext.runtime.executor import Executor
from megatron_pp_ext.runtime.inmemory import run_ranks_in_threads
from megatron_pp_ext.runtime.weight_versions import VersionedStageWork, plan_versions
from support.emulated import microbatch_inputs, stage_weights

WIDTH, ROWS, LR = 6, 3, 0.1


class ToyStage(torch.nn.Module):
    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = torch.nn.Parameter(weight.clone())

    def forward(self, x):
        return torch.tanh(x @ self.weight)


def toy_forward_fn(schedule: Schedule, inputs):
    last = schedule.num_stages - 1

    def forward_fn(stage, microbatch, call, input_tensor):
        y = call(inputs[microbatch] if stage == 0 else input_tensor)
        return y.sum() if stage == last else y

    return forward_fn


def run_async(schedule: Schedule, lr: float = LR, optimizer: str = "sgd", timeout_s=30.0):
    """Per rank: (StepResult, VersionedStageWork) of one run of the whole action list."""
    weights = stage_weights(schedule.num_stages, WIDTH)
    inputs = microbatch_inputs(schedule.num_microbatches, ROWS, WIDTH)
    plan = plan_versions(schedule)

    def rank_fn(rank, transport):
        modules = {s: ToyStage(weights[s]) for s in schedule.stages_of(rank)}
        params = [p for m in modules.values() for p in m.parameters()]
        opt = (torch.optim.SGD(params, lr=lr) if optimizer == "sgd"
               else torch.optim.Adam(params, lr=lr))
        work = VersionedStageWork(schedule, rank, modules, opt, toy_forward_fn(schedule, inputs),
                                  plan=plan)
        executor = Executor(schedule, rank, transport, work, recv_shape=(ROWS, WIDTH),
                            dtype=torch.float64, device=torch.device("cpu"), timeout_s=timeout_s)
        return executor.run(), work

    return run_ranks_in_threads(schedule.num_ranks, rank_fn, timeout_s=timeout_s + 10)


def final_weights(results) -> dict[int, torch.Tensor]:
    out = {}
    for _result, work in results:
        for stage, module in work.modules.items():
            out[stage] = module.weight.detach().clone()
    return out


def _loss_and_grads(weights_used: list[torch.Tensor], x: torch.Tensor):
    leaves = [w.clone().requires_grad_(True) for w in weights_used]
    for w in leaves:
        x = torch.tanh(x @ w)
    loss = x.sum()
    return float(loss.detach()), torch.autograd.grad(loss, leaves)


def reference_pipedream(p: int, total: int, vertical_sync: bool = False, lr: float = LR):
    """PipeDream (SOSP 2019, section 3.3), n = p stages, one update per microbatch t:

        weight stashing: W(t+1) = W(t) - lr * grad f(W_1(t-n+1), W_2(t-n+2), ..., W_n(t))
        vertical sync:   W(t+1) = W(t) - lr * grad f(W_1(t-n+1), W_2(t-n+1), ..., W_n(t-n+1))

    with W_i(k) = W_i(0) for k < 0 (the pipeline filling up). Returns the final weights and
    the losses."""
    history = [stage_weights(p, WIDTH)]  # history[k][s] = W_s(k)
    losses = []
    for t, x in enumerate(microbatch_inputs(total, ROWS, WIDTH)):
        used = []
        for s in range(p):  # 0-based stage s is the paper's stage i = s + 1
            k = t - (p - 1) if vertical_sync else t - (p - 1 - s)
            used.append(history[max(k, 0)][s])
        loss, grads = _loss_and_grads(used, x)
        losses.append(loss)
        history.append([history[t][s] - lr * grads[s] for s in range(p)])
    return history[-1], losses


def reference_2bw(p: int, m: int, batches: int, lr: float = LR):
    """PipeDream-2BW (ICML 2021, section 3.1), batches of m microbatches:

        W(t+1) = W(t) - lr * grad f(W(t-1)),  W(-1) = W(0)

    where grad f is the mean gradient over the batch's m microbatches. Returns the final
    weights and the losses."""
    history = [stage_weights(p, WIDTH)]
    inputs = microbatch_inputs(batches * m, ROWS, WIDTH)
    losses = []
    for t in range(batches):
        used = history[max(t - 1, 0)]
        total = [torch.zeros(WIDTH, WIDTH, dtype=torch.float64) for _ in range(p)]
        for x in inputs[t * m:(t + 1) * m]:
            loss, grads = _loss_and_grads(used, x)
            losses.append(loss)
            total = [a + g / m for a, g in zip(total, grads)]
        history.append([history[t][s] - lr * total[s] for s in range(p)])
    return history[-1], losses
