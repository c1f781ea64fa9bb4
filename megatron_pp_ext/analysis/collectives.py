"""Collectives inside compute actions: what a forward or backward issues on a group other than
the pipeline's, recorded in the lowered program, and the check that the ranks of each such
group issue the same sequence.

An MoE layer's forward and backward issue all-to-alls on the expert group. NCCL (and gloo)
match a group's collectives by their order on each rank, so every rank of the group must issue
them in the same order: otherwise the job hangs or, where two all-to-alls happen to have the
same sizes, hands tokens to the wrong microbatch. An expert group holds ranks of one pipeline
stage in different data-parallel replicas; they issue the same sequence when their replicas
run the same action list. That is what makes it safe, and :func:`check_same_sequence` checks it
(the drop-in does so over the expert group before its first step: ``integration.expert_groups``).

No torch: the counts per layer are measured facts about Megatron-Core 0.19.2 (``MOE_PER_LAYER``),
the number of MoE layers per stage comes from the model.
"""

from __future__ import annotations

from ..ir import BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, Action
from ..program import Collective, Compute, Program

EXPERT = "expert"

#: Per MoE layer, the expert-group collectives of its forward and of its input-gradient
#: backward, for Megatron-Core 0.19.2's alltoall dispatcher: 3 all_to_all_single calls on the
#: expert group per layer and microbatch each way (tests/test_moe.py counts every rank's calls
#: in a run of each schedule against this table). The experts' weight gradients (W) are
#: local: none there.
MOE_PER_LAYER = {
    "alltoall": (("dispatch tokens", "dispatch probs", "combine"),
                 ("combine (gradient)", "dispatch (gradient)", "dispatch (gradient)")),
}


def moe_collectives(moe_layers: dict[int, int], dispatcher: str = "alltoall",
                    ) -> dict[tuple[int, str], tuple[Collective, ...]]:
    """What one action issues on the expert group, per (stage, kind), for a model with
    ``moe_layers[stage]`` MoE layers in each stage. The alltoall dispatcher's calls are
    counted exactly; another dispatcher's are recorded as one collective per layer and
    direction (its own count is not modelled), which keeps their order checkable."""
    forward, backward = MOE_PER_LAYER.get(
        dispatcher, ((f"{dispatcher} dispatch and combine",),
                     (f"{dispatcher} dispatch and combine (gradient)",)))
    op = "all_to_all" if dispatcher in MOE_PER_LAYER else f"{dispatcher} collectives"
    table: dict[tuple[int, str], tuple[Collective, ...]] = {}
    for stage, layers in moe_layers.items():
        if layers <= 0:
            continue
        fwd = tuple(Collective(EXPERT, op, f"MoE layer {i} {what}")
                    for i in range(layers) for what in forward)
        bwd = tuple(Collective(EXPERT, op, f"MoE layer {i} {what}")
                    for i in reversed(range(layers)) for what in backward)
        table[stage, FORWARD] = fwd
        table[stage, BACKWARD] = table[stage, BACKWARD_INPUT] = bwd
        table[stage, BACKWARD_WEIGHT] = ()
    return table


def with_collectives(program: Program, per_action: dict[tuple[int, str], tuple]) -> Program:
    """The program with each compute step carrying the collectives its action issues (a
    lowering pass: the steps, batches and waits are the same objects)."""
    if not per_action:
        return program
    steps = []
    for rank_steps in program.steps:
        annotated = []
        for step in rank_steps:
            if isinstance(step, Compute):
                action = Action.parse(step.action)
                step = step._replace(collectives=per_action.get((action.stage, action.kind), ()))
            annotated.append(step)
        steps.append(annotated)
    return Program(program.name, steps, program.action_starts)


def issued(program: Program, rank: int, group: str = EXPERT) -> list[tuple[str, Collective]]:
    """(action, collective) for each collective ``rank`` issues on ``group``, in order."""
    return [(step.action, c) for step in program.steps[rank] if isinstance(step, Compute)
            for c in step.collectives if c.group == group]


def sequence_difference(sequences: dict[int, list[tuple[str, Collective]]],
                        group: str = EXPERT) -> str | None:
    """None when every rank of one ``group`` (``sequences``: rank -> (action, collective) it
    issues there, in order) issues the same collectives in the same order; else the error
    text: the ranks, the first position where they part, what each issues there, the rule
    and the fix."""
    ranks = sorted(sequences)
    for other in ranks[1:]:
        mine, theirs = sequences[ranks[0]], sequences[other]
        if [c for _, c in mine] == [c for _, c in theirs]:
            continue
        at = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a[1] != b[1]),
                  min(len(mine), len(theirs)))

        def there(seq, rank):
            if at >= len(seq):
                return f"rank {rank} issues nothing more (it issues {len(seq)} in all)"
            action, collective = seq[at]
            return f"rank {rank} issues {collective} in action {action}"

        return (
            f"the ranks of one {group} group would issue its collectives in different orders: "
            f"at collective #{at + 1} on that group, {there(mine, ranks[0])} and "
            f"{there(theirs, other)} ({len(mine)} and {len(theirs)} in a step). A group's "
            "collectives are matched by order on every rank, so this step would hang or mix "
            f"up tokens. The ranks of an {group} group hold the same pipeline stage in "
            "different data-parallel replicas: run every replica with the same schedule, "
            "microbatches and options (the same launch arguments and environment).")
    return None


def check_same_sequence(sequences: dict[int, list[tuple[str, Collective]]],
                        group: str = EXPERT) -> None:
    """``ValueError`` with :func:`sequence_difference`'s text unless the ranks agree."""
    difference = sequence_difference(sequences, group)
    if difference is not None:
        raise ValueError(difference)
