"""The plan of a Megatron-LM command line (``pretrain_plan.plan_pretrain``) in a few lines:
parallelism, batch, pipeline, per-rank stages and peak activation bytes, predicted step and
bubble, notes."""

from __future__ import annotations

from ..units import human_bytes
from .plan import warmup_counts


def report(plan) -> str:  # a pretrain_plan.PretrainPlan
    """The plan in a few lines: parallelism, batch, pipeline, per-rank stages and peak
    activation bytes (exact and in GiB), predicted step and bubble, notes."""
    p, m, v = plan.pp, plan.num_microbatches, plan.chunks
    layout = ("V layout: rank r holds stages r and 2p-1-r" if plan.layout == "v" else
              "the stages placed as the schedule file places them" if plan.layout == "other"
              else "loop layout: rank r holds stages r, r+p, ..." if v > 1 else
              "rank r holds stage r")
    act = plan.activations
    lines = [
        f"plan: {plan.name} ({plan.how_chosen}), from Megatron-LM's arguments as its own parser "
        "reads them (no GPU)",
        f"parallelism: world {plan.world_size} = tp {plan.tp} x pp {p} x cp {plan.cp} x dp "
        f"{plan.dp} (world size: {plan.world_from})",
        f"batch: global {plan.global_batch} = micro batch {plan.micro_batch} x dp {plan.dp} x "
        f"m {m} microbatches per step",
        f"pipeline: p={p}, m={m}, v={v} chunk(s) per rank ({plan.chunks_from}); {layout}; "
        f"{p * v} stages of {plan.layers_per_stage} layers ({plan.num_layers} layers)",
        f"activations per layer per microbatch "
        f"({'no' if act.recompute == 'none' else act.recompute} recompute): {act.formula} = "
        f"{act.bytes_per_layer:,} bytes ({human_bytes(act.bytes_per_layer)})"
        + (f"; {'; '.join(act.notes)}" if act.notes else ""),
    ]
    warmups = warmup_counts(plan.schedule)
    rows = [("rank", "stages", "warmup F", "peak in flight", "peak activation bytes", "")]
    for r in range(p):
        stages = ",".join(str(s) for s in plan.schedule.stages_of(r))
        rows.append((str(r), stages, "-" if warmups[r] is None else str(warmups[r]),
                     f"{plan.peak_in_flight[r]} x {plan.layers_per_stage} layers",
                     f"{plan.peak_bytes[r]:,}", human_bytes(plan.peak_bytes[r])))
    widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
    for i, row in enumerate(rows):
        cells = [row[0].rjust(widths[0]), row[1].ljust(widths[1]), row[2].rjust(widths[2]),
                 row[3].rjust(widths[3]), row[4].rjust(widths[4]),
                 f"({row[5]})" if i else ""]
        lines.append("  ".join(cells).rstrip())
    lines.append("  peak in flight: microbatch activations of one stage alive at once on the "
                 "rank (transformer layers only)")
    t = plan.timeline
    if t.unit == "s":
        step = f"{t.makespan * 1e3:.4g} ms"
    else:
        step = f"{t.makespan:.6g} t"
    lines.append(f"predicted step: {step}, bubble {100 * t.bubble_fraction:.2f}%"
                 + (f" ({plan.costs_text})" if plan.costs_text else ""))
    lines += [f"note: {note}" for note in plan.notes]
    return "\n".join(lines)


__all__ = ["report"]
