"""The plan of a Megatron-LM command line (``pretrain_plan.plan_pretrain``) in a few lines:
parallelism, batch, pipeline, the layers of every stage, per-rank activation, static and total
bytes (and whether they fit), per-stage costs, predicted step and bubble, notes."""

from __future__ import annotations

from ..units import human_bytes
from ..integration.plan import warmup_counts
from ..integration.stage_layers import describe


def report(plan) -> str:  # a pretrain_plan.PretrainPlan
    """The plan as text (see the module docstring)."""
    p, m, v = plan.pp, plan.num_microbatches, plan.chunks
    layout = ("V layout: rank r holds stages r and 2p-1-r" if plan.layout == "v" else
              "dualpipe: rank r holds part r and a copy of part p-1-r, microbatches from "
              "both ends" if plan.layout == "dual" else
              "the stages placed as the schedule file places them" if plan.layout == "other"
              else "loop layout: rank r holds stages r, r+p, ..." if v > 1 else
              "rank r holds stage r")
    act = plan.activations
    split = (f"{p * v} stages of {plan.layers_per_stage} layers ({plan.num_layers} layers)"
             if plan.even else f"{p * v} stages, uneven ({plan.num_layers} layers)")
    lines = [
        f"plan: {plan.name} ({plan.how_chosen}), from Megatron-LM's arguments as its own parser "
        "reads them (no GPU)",
        f"parallelism: world {plan.world_size} = tp {plan.tp} x pp {p} x cp {plan.cp} x dp "
        f"{plan.dp} (world size: {plan.world_from})",
        f"batch: global {plan.global_batch} = micro batch {plan.micro_batch} x dp {plan.dp} x "
        f"m {m} microbatches per step",
        f"pipeline: p={p}, m={m}, v={v} chunk(s) per rank ({plan.chunks_from}); {layout}; "
        f"{split}",
        f"stages (Megatron's split; E embedding, t transformer layer, L output layer and loss): "
        f"{describe(plan.stages)}",
        f"activations per layer per microbatch "
        f"({'no' if act.recompute == 'none' else act.recompute} recompute): {act.formula} = "
        f"{act.bytes_per_layer:,} bytes ({human_bytes(act.bytes_per_layer)})"
        + (f"; {'; '.join(act.notes)}" if act.notes else ""),
    ]
    lines += _rank_table(plan)
    lines += _cost_lines(plan)
    t = plan.timeline
    step = f"{plan.step_seconds * 1e3:.4g} ms" if t.unit == "s" else f"{t.makespan:.6g} t"
    speed = plan.tokens_per_s_per_gpu
    lines.append(f"predicted step: {step}, bubble {100 * t.bubble_fraction:.2f}%"
                 + (f", {speed:,.0f} tokens/s per GPU" if speed else "")
                 + (f" ({plan.costs_text})" if plan.costs_text else ""))
    lines += _term_lines(plan)
    lines += [f"note: {note}" for note in plan.notes]
    return "\n".join(lines)


def _rank_table(plan) -> list[str]:
    warmups = warmup_counts(plan.schedule)
    budget = plan.memory[0].budget if plan.memory else None
    head = ("rank", "stages", "layers", "warmup F", "peak in flight", "peak activation bytes",
            "", "static bytes", "total", "fits" if budget is not None else "")
    rows = [head]
    for r, rank in enumerate(plan.memory):
        stages = plan.schedule.stages_of(r)
        fits = ""
        if budget is not None:
            fits = (f"yes, {human_bytes(rank.headroom)} left" if rank.fits else
                    f"NO, {human_bytes(-rank.headroom)} over")
        rows.append((str(r), ",".join(str(s) for s in stages),
                     ",".join(plan.stages[s].describe() for s in stages),
                     "-" if warmups[r] is None else str(warmups[r]),
                     str(plan.peak_in_flight[r]), f"{rank.activation:,}",
                     f"({human_bytes(rank.activation)})", human_bytes(rank.static),
                     human_bytes(rank.total), fits))
    widths = [max(len(row[c]) for row in rows) for c in range(len(head))]
    right = {0, 3, 4, 5, 7, 8}
    out = ["  ".join(cell.rjust(widths[c]) if c in right else cell.ljust(widths[c])
                     for c, cell in enumerate(row)).rstrip() for row in rows]
    out.append("  peak in flight: a count of microbatch activations of the rank's stages alive "
               "at once; peak activation bytes: the stages' bytes walked through the schedule")
    out.append(f"  static: weights, gradients and optimizer state ({plan.static_rule})"
               + (f"; fits: total + {human_bytes(plan.memory[0].reserve)} reserve (the CUDA "
                  "context, NCCL's buffers, the allocator's fragmentation: --reserve) <= "
                  f"{human_bytes(budget)}{f' ({plan.gpu.name})' if plan.gpu else ''}"
                  if budget is not None else ""))
    return out


def _cost_lines(plan) -> list[str]:
    """Per stage F, I, W in ms, consecutive stages with the same layers and costs as one."""
    if not plan.stage_costs:
        return []
    c = plan.stage_costs
    ms = lambda x: f"{x * 1e3:.3g}"  # noqa: E731
    groups: list[list] = []  # [first stage, last stage, text]
    for s in range(len(plan.stages)):
        text = (f"{plan.stages[s].describe()}: F {ms(c['t_f'][s])} I {ms(c['t_i'][s])} "
                f"W {ms(c['t_w'][s])}")
        if groups and groups[-1][2] == text:
            groups[-1][1] = s
        else:
            groups.append([s, s, text])
    stages = "; ".join(f"stage {a if a == b else f'{a}-{b}'} {text}" for a, b, text in groups)
    return [f"costs per microbatch (ms; {plan.costs_text}): {stages}"]


#: The step's terms as the report names them.
TERM_LABELS = {"gemm": "GEMMs", "attention": "attention", "elementwise": "element-wise",
               "tp": "TP messages", "cp": "CP ring", "ep": "EP all-to-all",
               "bubble_and_p2p": "bubble and pipeline messages",
               "dp": "data-parallel messages not overlapped", "optimizer": "optimizer"}


def _term_lines(plan) -> list[str]:
    """The busiest rank's step by term, in ms (a machine's model only)."""
    terms = plan.step_terms() if plan.timeline.unit == "s" else None
    if not terms:
        return []
    parts = [f"{label} {terms[key] * 1e3:.4g}" for key, label in TERM_LABELS.items()
             if terms[key] > 0]
    return [f"step on rank {terms['rank']} (the busiest), ms: " + ", ".join(parts)]


__all__ = ["report"]
