"""A step's seconds on a machine, by named term: each stage's F, I, W (``layer_terms``: GEMMs,
attention, element-wise kernels, TP / CP / EP messages), the pipeline's messages (the
simulator's ``t_comm``), and once per step the data-parallel gradient reduce-scatter and
parameter all-gather beyond what overlaps, and the optimizer.

**Data parallel** (per rank, its stages' parameters on its tp rank; dense over dp x cp ranks
tp apart, experts over the expert data-parallel ranks): the distributed optimizer reduce-scatters
the gradients (2 bytes with ``--grad-reduce-in-bf16``, else 4) and all-gathers the parameters
(1 byte with ``--fp8-param-gather``, else 2); without it the gradients are all-reduced. With
``--overlap-grad-reduce`` a chunk's reduce-scatter runs beside the rest of the step: exposed is
what the last chunk's (1/v of the rank's) leaves after that chunk's last backward; with
``--overlap-param-gather`` the all-gather likewise before the first chunk's first forward. A
group on several nodes runs at ``Machine.ring_bytes_per_s``.

**Optimizer**: Adam over the rank's shard: 32 bytes per parameter read and written (the fp32
master, two moments, the gradient, the 16-bit parameter) at the memory bandwidth.

**Calibration**: the GEMMs' share of the data sheet's peak is the one constant per GPU kind and
precision, fitted on one named row of NVIDIA's published runs (``CALIBRATION``;
``tests/support/published_recipes.py`` fits it again, ``tests/test_published_recipes.py``
holds the two equal and every other row to the table in ``docs/planning.md``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

from .comm_terms import LayerComm
from .kernel_time import Kernels
from .layer_terms import Terms, StageTerms, stage_terms
from .machines import Machine
from .static_memory import stage_params

if TYPE_CHECKING:
    from ..integration.stage_layers import StageLayers
    from ..ir import Schedule
    from .model_shape import ModelShape

#: The GEMMs' share of the dense peak (of FP8's with an FP8 recipe, else BF16's), per GPU kind:
#: (share, the published row it is fitted on). Every expressible row with a DGX's own model
#: is FP8 (GPT-OSS, the one BF16 family, is not expressible: docs/planning.md), so BF16 runs are
#: priced at the same share of BF16's peak. H200 is priced with H100's (the same GPU, more and
#: faster memory).
CALIBRATION = {
    "H100": (0.55185, "Llama3 70B, 64 H100, 26.04 (1633 tokens/s/GPU)"),
    "B200": (0.43582, "Llama3.1 405B, 128 B200, 25.11 (661 tokens/s/GPU)"),
}
OPTIMIZER_BYTES_PER_PARAM = 32


def gemm_share(machine: Machine) -> tuple[float, str]:
    return CALIBRATION[calibration_kind(machine.gpu.name)]


def calibration_kind(gpu: str) -> str:
    return "H100" if gpu == "H200" else gpu


@dataclass
class StepModel:
    """What a step costs on a machine, before the schedule orders it."""

    stages: list[StageTerms]  # per stage, one microbatch on one rank
    layers: list["StageLayers"]  # per stage, its layers
    pipeline_message: float  # seconds, one activation message between stages
    machine: Machine
    gemm_share: float
    fitted_on: str
    args: Any
    shape: "ModelShape"
    dp: int
    world_size: int

    def stage_costs(self) -> dict[str, list[float]]:
        return {"t_f": [s.f.total for s in self.stages], "t_i": [s.i.total for s in self.stages],
                "t_w": [s.w.total for s in self.stages]}

    def per_step(self, schedule: "Schedule", rank: int) -> tuple[float, float]:
        """(exposed data-parallel seconds, optimizer seconds) of ``rank`` once per step."""
        stages = list(schedule.stages_of(rank))
        single = len(self.stages) == 1
        dense = expert = 0.0
        for s in stages:
            params = stage_params(self.shape, self.layers[s], single)
            dense, expert = dense + params.dense, expert + params.expert
        exposed = self._data_parallel(dense, expert, stages)
        shards = self.dp * self.shape.cp if _flag(self.args, "use_distributed_optimizer") else 1
        held = dense / shards + expert / (self._expert_dp() if shards > 1 else 1)
        optimizer = held * OPTIMIZER_BYTES_PER_PARAM / self.machine.hbm_bytes_per_s
        return exposed, optimizer

    def _expert_dp(self) -> int:
        pp = self.world_size // max(1, self.dp * self.shape.tp * self.shape.cp)
        return max(1, self.world_size // (self.shape.ep * self.shape.etp * max(1, pp)))

    def _data_parallel(self, dense: float, expert: float, stages: list[int]) -> float:
        shape, args = self.shape, self.args
        grad = 2 if _flag(args, "grad_reduce_in_bf16") else 4
        param = 1 if _flag(args, "fp8_param_gather") else 2
        distributed = _flag(args, "use_distributed_optimizer")
        dense_rate = self.machine.ring_bytes_per_s(self.dp * shape.cp, shape.tp)
        expert_rate = self.machine.ring_bytes_per_s(self._expert_dp(), shape.ep * shape.etp)
        reduce = gather = 0.0
        for params, (group, rate) in ((dense, (self.dp * shape.cp, dense_rate)),
                                      (expert, (self._expert_dp(), expert_rate))):
            if group <= 1 or not params:
                continue
            ring = (group - 1) / group * params / rate
            reduce += ring * grad * (1 if distributed else 2)
            gather += ring * param if distributed else 0.0
        v = len(stages)
        last = first = self.stages[stages[0]]  # chunk 0: the first forward, the last backward
        if _flag(args, "overlap_grad_reduce"):
            reduce = max(0.0, reduce / v - (last.i.total + last.w.total))
        if _flag(args, "overlap_param_gather"):
            gather = max(0.0, gather / v - first.f.total)
        return reduce + gather


def _flag(args: Any, name: str) -> bool:
    return bool(getattr(args, name, False))


def step_model(args: Any, shape: "ModelShape", stages: Sequence["StageLayers"], machine: Machine,
               recompute: str, recomputed_layers: int | None, dp: int,
               world_size: int) -> StepModel:
    """Every stage's F, I, W on ``machine`` at the calibrated GEMM share."""
    share, fitted_on = gemm_share(machine)
    kernels = Kernels(machine, share, shape.fp8)
    comm = LayerComm(shape, machine, tp_overlap=_flag(args, "tp_comm_overlap"))
    terms = [stage_terms(shape, stage, kernels, comm, recompute, recomputed_layers)
             for stage in stages]
    return StepModel(terms, list(stages), comm.pipeline_message(shape.tp * shape.cp * dp),
                     machine, share, fitted_on, args, shape, dp, world_size)


def rank_terms(model: StepModel, schedule: "Schedule", rank: int, m: int) -> Terms:
    """The rank's F, I, W terms over the step's ``m`` microbatches."""
    total = Terms()
    for s in schedule.stages_of(rank):
        stage = model.stages[s]
        total = total + (stage.f + stage.i + stage.w).times(m)
    return total


__all__ = ["CALIBRATION", "StepModel", "calibration_kind", "gemm_share", "rank_terms", "step_model"]
