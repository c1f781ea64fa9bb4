"""The parallel configurations ``select --search-parallelism`` plans (``parallel_search``): a
split of the GPUs (tp, pp, cp, ep) and a micro batch, the command-line flags that set one, and
a planned row of the search.

Megatron's rules: tp a power of two up to the node's GPUs dividing the heads and the query
groups (sequence parallelism above 1); cp while each rank keeps at least
``MIN_TOKENS_PER_CP_RANK`` tokens; pp dividing what is left, at most the layers; ep a power of
two dividing the experts and the ranks of a pipeline stage, with expert tensor parallelism 1;
the micro batch where the global batch splits evenly: 1, 2 or 4 for a MoE model, whose grouped
GEMMs get more tokens per expert with it, 1 and the arguments' own for a dense one, whose step
the planner prices per token (a larger micro batch only holds more bytes)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .pretrain_plan import PretrainPlan
from .pretrain_select import PretrainSelection, split_flags

#: a rank keeps at least this many tokens of a sequence under context parallelism
MIN_TOKENS_PER_CP_RANK = 4096
#: the flags the search sets, each with its value count (the arguments' are replaced)
PARALLEL_FLAGS = {"--tensor-model-parallel-size": 1, "--pipeline-model-parallel-size": 1,
                  "--context-parallel-size": 1, "--expert-model-parallel-size": 1,
                  "--expert-tensor-parallel-size": 1, "--micro-batch-size": 1,
                  "--sequence-parallel": 0, "--num-virtual-stages-per-pipeline-rank": 1,
                  "--num-layers-per-virtual-pipeline-stage": 1, "--pipeline-schedule": 1,
                  "--decoder-first-pipeline-num-layers": 1,
                  "--decoder-last-pipeline-num-layers": 1,
                  "--pipeline-model-parallel-layout": 1}


@dataclass(frozen=True)
class Parallelism:
    tp: int
    pp: int
    cp: int
    ep: int
    micro_batch: int

    def flags(self) -> list[str]:
        """The command-line flags that set this configuration."""
        flags = ["--tensor-model-parallel-size", str(self.tp),
                 "--pipeline-model-parallel-size", str(self.pp),
                 "--context-parallel-size", str(self.cp),
                 "--micro-batch-size", str(self.micro_batch)]
        if self.ep > 1:
            flags += ["--expert-model-parallel-size", str(self.ep),
                      "--expert-tensor-parallel-size", "1"]
        return flags + (["--sequence-parallel"] if self.tp > 1 else [])

    def label(self) -> str:
        return f"tp{self.tp} pp{self.pp} cp{self.cp} ep{self.ep} mbs{self.micro_batch}"


@dataclass
class SearchRow:
    parallelism: Parallelism
    plan: PretrainPlan  # planned at the job's microbatches, or at ROUNDS[-1] x pp (extended)
    selection: PretrainSelection
    step_seconds: float  # at the job's microbatches
    tokens_per_s_per_gpu: float
    extended: bool = False  # the step extended from fewer microbatches (``ROUNDS``)

    @property
    def most_bytes(self) -> int:
        return self.plan.most_bytes


def exact_row(parallelism: Parallelism, plan: PretrainPlan,
              selection: PretrainSelection) -> SearchRow:
    return SearchRow(parallelism, plan, selection, plan.step_seconds,
                     plan.tokens_per_s_per_gpu or 0.0)


def powers_of_two(limit: int) -> list[int]:
    return [1 << k for k in range(limit.bit_length()) if 1 << k <= limit]


def parallelisms(args, world_size: int, gpus_per_node: int) -> list[Parallelism]:
    """Every configuration of the screen (module docstring) for Megatron's parsed ``args``."""
    heads = int(args.num_attention_heads)
    groups = int(args.num_query_groups) if getattr(args, "group_query_attention", False) \
        else heads
    seq, layers = int(args.seq_length), int(args.num_layers)
    experts = int(getattr(args, "num_experts", None) or 0)
    batch = int(args.global_batch_size)
    micro_batches = (1, 2, 4) if experts else tuple(sorted({1, int(args.micro_batch_size or 1)}))
    found = []
    for tp in powers_of_two(gpus_per_node):
        for cp in powers_of_two(max(1, seq // MIN_TOKENS_PER_CP_RANK)):
            if heads % tp or groups % tp or world_size % (tp * cp):
                continue
            rest = world_size // (tp * cp)
            for pp in (d for d in range(1, min(rest, layers) + 1) if rest % d == 0):
                dp = rest // pp
                for ep in _expert_sizes(experts, world_size // pp):
                    found += [Parallelism(tp, pp, cp, ep, b) for b in micro_batches
                              if batch % (b * dp) == 0]
    return found


def _expert_sizes(experts: int, stage_ranks: int) -> list[int]:
    """ep candidates: 1 for a dense model, else the powers of two dividing the experts and the
    ranks of a pipeline stage (expert tensor parallelism 1)."""
    if not experts:
        return [1]
    return [ep for ep in powers_of_two(stage_ranks) if experts % ep == 0 and stage_ranks % ep == 0]


def with_parallelism(argv: Sequence[str], parallelism: Parallelism) -> list[str]:
    """``argv`` with its parallel, micro-batch, schedule and layout flags replaced by
    ``parallelism``'s."""
    rest, _ = split_flags(list(argv), PARALLEL_FLAGS)
    return rest + parallelism.flags()


def given_parallelism(args) -> Parallelism:
    return Parallelism(int(args.tensor_model_parallel_size or 1),
                       int(args.pipeline_model_parallel_size or 1),
                       int(getattr(args, "context_parallel_size", 1) or 1),
                       int(getattr(args, "expert_model_parallel_size", 1) or 1),
                       int(args.micro_batch_size or 1))


def with_batch(argv: list[str], global_batch: int) -> list[str]:
    """``argv`` with ``--global-batch-size`` set to ``global_batch``."""
    rest, _ = split_flags(argv, {"--global-batch-size": 1})
    return rest + ["--global-batch-size", str(global_batch)]


__all__ = ["MIN_TOKENS_PER_CP_RANK", "PARALLEL_FLAGS", "Parallelism", "SearchRow", "exact_row",
           "given_parallelism", "parallelisms", "powers_of_two", "with_batch",
           "with_parallelism"]
