"""``schedule="auto"``: measure the stages, then pick the fastest schedule that fits.

The first step(s) run a measuring schedule that suits how the model is chunked, with tracing
on: ``1f1b`` with each backward written as I then W (same order and arithmetic as 1F1B) for
one chunk per rank, ``zb-v`` for the V layout. Each rank then has the mean F, I and W time of
its stages; every rank shares them (each stage's cost the mean over the pipelines: data-,
tensor- and context-parallel replicas), global rank 0 ranks the schedules that fit the
model's chunking with the selector (``analysis.select``) under the memory budget, broadcasts
its choice to every rank (one schedule for the whole job), logs it with the predicted gain,
and every later step runs the chosen schedule. The step after the switch, Megatron DDP
learns its grad-ready counts afresh (``megatron_stage.relearn_grad_ready_counts``).

Which schedules can be chosen depends on the model, which is built for one layout: one chunk
per rank -> gpipe, 1f1b, zb-h1, zb-h2, zb-auto; V layout (rank 0 holds the first and the last
stage) -> zb-v, dualpipev, v-half, v-min, zb-auto; v chunks in Megatron's loop layout ->
interleaved only (nothing to choose). zb-auto is synthesized from the measured costs under the
budget (``schedules.zb_auto``): auto profiles, then reschedules; rank 0's choice carries the
options it was built with, so every rank builds the same order.

Memory, in bytes: one microbatch's activation on each rank is MEASURED in the measuring step
(``runtime/memory.py``: the bytes of the tensors autograd saved in one F of each of the
rank's stages, summed: v=1 units), on the CPU and on GPUs alike; each candidate's peak on a
rank is its simulated count times that rank's bytes (``analysis.select``). The budget per
rank is ``auto_memory_budget_bytes`` when given (``install``), else on GPUs the free device
memory after the measuring step; on the CPU there is no budget unless given.
``auto_activation_bytes`` overrides the measured activation; where nothing was measured (a
work without saved-tensor accounting) the GPU's peak growth over the step divided by the
peak count stands in.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass, field, replace

import torch.distributed as dist

from ..analysis.select import format_bytes, select_schedules, zb_auto_options
from ..analysis.simulate import CostModel
from ..ir import Schedule
from ..schedules import AUTO_LAYOUT, candidates_by_layout, get_spec
from ..schedules.zb_auto import NAME as ZB_AUTO
from ..timeline import COMPUTE

log = logging.getLogger("megatron_pp_ext")

# {"one-chunk": (...), "v": (...), "loop": (...)}; zb-auto, which builds for either, pinned to
# the model's layout (1 chunk: the loop layout; the V layout: 2)
CANDIDATES = {layout: tuple((name, 2 if layout == "v" else 1)
                            if get_spec(name).layout == AUTO_LAYOUT else name for name in names)
              for layout, names in candidates_by_layout().items()}
MEASURE_WITH = {"one-chunk": ("1f1b", {"split_backward": True}), "v": ("zb-v", {}),
                "loop": ("interleaved", {})}


def measured_activation_bytes(result) -> int | None:
    """One microbatch's activation bytes on this rank, v=1 units: the bytes one F saved on
    each of the rank's stages, summed (``StepResult.saved_bytes_per_stage``); None where not
    measured."""
    per_stage = getattr(result, "saved_bytes_per_stage", None)
    return int(sum(per_stage.values())) if per_stage else None


def model_layout(model_chunks, pp_group) -> str:
    """'one-chunk', 'v' or 'loop', agreed over the pipeline group (who holds the loss)."""
    if len(model_chunks) == 1:
        return "one-chunk"
    from megatron.core.utils import get_attr_wrapped_model

    holds_loss = [bool(get_attr_wrapped_model(chunk, "post_process")) for chunk in model_chunks]
    mine = [(dist.get_rank(pp_group), c) for c, flag in enumerate(holds_loss) if flag]
    everyone: list = [None] * dist.get_world_size(pp_group)
    dist.all_gather_object(everyone, mine, group=pp_group)
    owners = [entry for entries in everyone for entry in entries]
    v_layout = len(everyone) > 1 and owners == [(0, len(model_chunks) - 1)]
    return "v" if v_layout else "loop"


def stage_costs(events, schedule: Schedule) -> dict[int, dict[str, float]]:
    """Mean duration of each kind of compute action, per stage, from one rank's trace."""
    sums: dict = defaultdict(lambda: defaultdict(float))
    counts: dict = defaultdict(lambda: defaultdict(int))
    for event in events:
        if event.category != COMPUTE:
            continue
        kind = event.kind
        stage = int(event.label.split(kind)[0])
        sums[stage][kind] += event.duration
        counts[stage][kind] += 1
    return {stage: {kind: sums[stage][kind] / counts[stage][kind] for kind in sums[stage]}
            for stage in sums}


def _mean_costs_by_stage(parts) -> dict[int, dict[str, float]]:
    """Each stage's mean cost of each kind over the pipelines that measured it (one part per
    rank: ``stage_costs`` of its stages)."""
    values: dict = defaultdict(lambda: defaultdict(list))
    for part in parts:
        for stage, costs in part.items():
            for kind, cost in costs.items():
                values[stage][kind].append(cost)
    return {stage: {kind: sum(v) / len(v) for kind, v in kinds.items()}
            for stage, kinds in values.items()}


def per_rank_costs(costs_by_stage: dict[int, dict[str, float]], schedule: Schedule) -> CostModel:
    """The selector's costs: one number per rank for its whole part (its chunks summed)."""
    def total(rank: int, kind: str) -> float:
        values = costs_by_stage.get
        stages = schedule.stages_of(rank)
        if kind in ("I", "W") and not any("I" in values(s, {}) for s in stages):
            return sum(values(s, {}).get("B", 0.0) for s in stages) / 2  # no split measured
        return sum(values(s, {}).get(kind, 0.0) for s in stages)

    ranks = range(schedule.num_ranks)
    return CostModel(t_f=[total(r, "F") for r in ranks], t_i=[total(r, "I") for r in ranks],
                     t_w=[total(r, "W") for r in ranks], t_comm=0.0)


@dataclass
class AutoChoice:
    schedule: str
    reason: str
    predicted: dict = field(default_factory=dict)  # schedule -> predicted step time (s)
    # what the schedule is built with: zb-auto's measured costs and budget, the same on every
    # rank (rank 0's choice is broadcast), so every rank builds the same order
    builder_options: dict = field(default_factory=dict)


@dataclass
class AutoSchedule:
    """The state of ``schedule="auto"`` across steps."""

    measure_steps: int = 1
    memory_budget_bytes: float | None = None
    activation_bytes: float | None = None
    layout: str | None = None
    measured: int = 0
    choice: AutoChoice | None = None

    @property
    def measuring(self) -> bool:
        return self.choice is None

    def options_for_step(self, options, model_chunks, pp_group):
        """(options, extra builder options) this step runs with: measuring, or the choice."""
        if self.layout is None:
            self.layout = model_layout(model_chunks, pp_group)
        if self.choice is None and self.layout == "loop":  # one candidate: nothing to measure
            self.choice = AutoChoice("interleaved", "the model is chunked for interleaved only")
        if self.choice is not None:
            return replace(options, schedule=self.choice.schedule), dict(
                self.choice.builder_options)
        name, builder_options = MEASURE_WITH[self.layout]
        return replace(options, schedule=name, trace=True), dict(builder_options)

    def after_step(self, result, schedule: Schedule, pp_group, memory=None) -> AutoChoice | None:
        """Count a measuring step; after the last one, choose: one choice for the whole job,
        made on global rank 0 and broadcast to every rank. Every pipeline (data-parallel
        replicas, and the tensor- and context-parallel slices, each with its own pipeline
        group) must run the same schedule: the ranks of a TP group run one action list, and
        the DP replicas' gradient reductions must start in the same order. So the costs are
        gathered from every rank, each stage's the mean over the pipelines that ran it, each
        pipeline rank's activation the largest of its replicas."""
        self.measured += 1
        if self.measured < self.measure_steps:
            return None
        mine = (dist.get_rank(pp_group), stage_costs(result.events, schedule), memory,
                measured_activation_bytes(result))
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        costs_by_stage = _mean_costs_by_stage([part for _r, part, _m, _a in gathered])
        activation: dict = {}
        for pp_rank, _part, _mem, act in gathered:
            previous = activation.get(pp_rank, 0)
            activation[pp_rank] = None if act is None or previous is None else max(previous, act)
        self.measured_activation = [activation.get(r) for r in range(schedule.num_ranks)]
        choice = [None]
        if dist.get_rank() == 0:
            try:
                choice[0] = self._choose(costs_by_stage, schedule,
                                         [m for _r, _c, m, _a in gathered])
            except ValueError as exc:  # every rank raises it, none waits for a choice
                choice[0] = str(exc)
        dist.broadcast_object_list(choice, src=0)
        if isinstance(choice[0], str):
            raise ValueError(choice[0])
        self.choice = choice[0]
        if dist.get_rank() == 0:
            log.info("auto schedule: %s", self.choice.reason)
        return self.choice

    def _choose(self, costs_by_stage, schedule: Schedule, memories) -> AutoChoice:
        costs = per_rank_costs(costs_by_stage, schedule)
        budget, activation = self._memory(memories, schedule)
        selection = select_schedules(schedule.num_ranks, schedule.num_microbatches, costs,
                                     activation_bytes=activation, memory_budget_bytes=budget,
                                     candidates=CANDIDATES[self.layout])
        predicted = {r.name: r.makespan for r in selection.ranked}
        best = selection.best
        if best is None:
            reasons = "; ".join(f"{e.name}: {e.reason}" for e in selection.excluded)
            raise ValueError(f"auto schedule: no schedule fits the memory budget ({reasons}); "
                             "lower the micro-batch size or num_microbatches, or raise the budget")
        baseline_name = MEASURE_WITH[self.layout][0]  # what ran while measuring
        baseline = predicted.get(baseline_name, best.makespan)
        gain = 1 - best.makespan / baseline if baseline else 0.0
        per_rank = ", ".join(f"rank {r}: F {costs.t_f[r] * 1e3:.2f} I {costs.t_i[r] * 1e3:.2f} "
                             f"W {costs.t_w[r] * 1e3:.2f} ms" for r in range(schedule.num_ranks))
        excluded = "; ".join(f"{e.name} excluded: {e.reason}" for e in selection.excluded)
        budget_text = "no memory budget" if budget == float("inf") else \
            f"budget {format_bytes(budget)} per rank"
        if isinstance(activation, list):
            budget_text += (", measured activation per microbatch ["
                            + ", ".join(format_bytes(b) for b in activation) + "] per rank")
        elif activation != 1.0:
            budget_text += f", activation per microbatch {format_bytes(activation)} per rank"
        reason = (f"chose {best.name}: predicted step {best.makespan * 1e3:.1f} ms vs "
                  f"{baseline_name} {baseline * 1e3:.1f} ms ({gain:+.0%} faster) from measured "
                  f"costs [{per_rank}], {budget_text}"
                  + (f"; {excluded}" if excluded else ""))
        built_with = (zb_auto_options(costs, schedule.num_ranks, activation, budget)
                      if best.name == ZB_AUTO else {})
        return AutoChoice(best.name, reason, predicted, built_with)

    def _memory(self, memories, schedule: Schedule) -> tuple[float, float | list]:
        budget = self.memory_budget_bytes
        activation = self.activation_bytes
        measured = getattr(self, "measured_activation", None) or []
        if activation is None and measured and all(b for b in measured):
            activation = [float(b) for b in measured]  # per rank, v=1 units
        known = [m for m in memories if m is not None]
        if known and (budget is None or activation is None):
            # m = (free bytes, bytes one microbatch's activation took on that rank)
            if budget is None:
                budget = min(free for free, _act in known)
            if activation is None:
                activation = max(act for _free, act in known)
        return (float("inf") if budget is None else budget,
                1.0 if activation is None else activation)
