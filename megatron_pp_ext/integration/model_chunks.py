"""How many model chunks per rank Megatron builds from its arguments (its virtual pipeline
size), read the way Megatron's ``validate_args`` derives it: what the schedule flags, the V
layout's model providers and the planner check a schedule against."""

from __future__ import annotations

from typing import Any


def model_chunks(args: Any) -> int:
    """Model chunks per rank that Megatron builds from these (validated) arguments."""
    if hasattr(args, "virtual_pipeline_model_parallel_size"):  # set by validate_args
        return int(args.virtual_pipeline_model_parallel_size or 1)
    # Not validated yet: derive it the way Megatron's validate_args does.
    vp = getattr(args, "num_virtual_stages_per_pipeline_rank", None)
    per_vstage = getattr(args, "num_layers_per_virtual_pipeline_stage", None)
    pp = getattr(args, "pipeline_model_parallel_size", 1) or 1
    layout = getattr(args, "pipeline_model_parallel_layout", None)
    if layout:  # Megatron's parser of the string; imported here, where one is given
        from megatron.core.transformer.pipeline_parallel_layer_layout import (
            PipelineParallelLayerLayout)

        stages = PipelineParallelLayerLayout.get_num_stages_from_str(str(layout))
        if stages % pp:
            raise ValueError(f"--pipeline-model-parallel-layout {str(layout)!r} has {stages} "
                             f"stages, not a multiple of --pipeline-model-parallel-size {pp} "
                             "(Megatron's rule): give a multiple of pp stages")
        return stages // pp
    num_layers = getattr(args, "num_layers", None)
    if vp is None and per_vstage and num_layers:
        vp = num_layers // pp // per_vstage
    return int(vp or 1)
