"""Does ``select`` pick what the emulated device measures as fastest among what fits?

For each emulated (p, m), the selector gets the emulated costs (t_F = t_I = t_W = t per rank,
t_comm as calibrated for that process tree, and a per-action runtime cost t_overhead
calibrated once from 1F1B's measured step: (measured - predicted) / its 2(m + p - 1) actions
on the critical path; the same values for every schedule) and two budgets: none, and 1F1B's own peak
(p activations on rank 0, a common "no more memory than today" rule). Among the plugin's
schedules that fit, the measured-fastest is compared with the selector's first choice; the
check passes when the choice is the fastest, or within 2% of it (the rounds' noise; ties such
as zb-h1 / zb-h2 at equal costs are common).
"""

from __future__ import annotations

from megatron_pp_ext.analysis.select import select_schedules
from megatron_pp_ext.analysis.simulate import CostModel

LABELS = {("gpipe", 1): "gpipe", ("1f1b", 1): "1f1b", ("interleaved", 2): "interleaved v=2",
          ("zb-h1", 1): "zb-h1", ("zb-h2", 1): "zb-h2", ("zb-v", 2): "zb-v",
          ("dualpipev", 2): "dualpipev"}
NOISE = 1.02


def calibrated_overhead(rows: list, p: int, m: int) -> float:
    """A per-action runtime cost, from 1F1B alone: (measured - predicted) over the
    2(m + p - 1) F/B actions on its critical path."""
    one_f_one_b = next(r for r in rows if r["m"] == m and r["schedule"] == "1f1b")
    return max(0.0, (one_f_one_b["median"] - one_f_one_b["predicted"]) / (2 * (m + p - 1)))


def check(trees: list, t: float) -> list[dict]:
    out = []
    for tree in trees:
        p = tree["p"]
        for m in sorted({r["m"] for r in tree["rows"]}):
            measured = {r["schedule"]: r["median"] for r in tree["rows"] if r["m"] == m}
            overhead = calibrated_overhead(tree["rows"], p, m)
            costs = CostModel(t_f=t, t_i=t, t_w=t, t_comm=tree["t_comm"], t_overhead=overhead)
            for budget_name, budget in (("none", float("inf")), ("1F1B's peak", float(p))):
                selection = select_schedules(p, m, costs, activation_bytes=1.0,
                                             memory_budget_bytes=budget,
                                             candidates=list(LABELS), chunks_options=(2,))
                fits = [LABELS[(r.name, r.chunks)] for r in selection.ranked]
                fits = [label for label in fits if label in measured]
                chosen = LABELS[(selection.best.name, selection.best.chunks)]
                fastest = min(fits, key=measured.get)
                out.append({
                    "p": p, "m": m, "budget": budget_name, "chosen": chosen,
                    "chosen_ms": 1e3 * measured[chosen], "fastest": fastest,
                    "fastest_ms": 1e3 * measured[fastest],
                    "excluded": [f"{e.name}" + (f" v={e.chunks}" if e.chunks > 1 else "")
                                 for e in selection.excluded],
                    "ok": measured[chosen] <= NOISE * measured[fastest],
                })
    return out


def markdown(rows: list, checks: list) -> list[str]:
    out = ["## Selector against the measurements", "",
           "`select` with the emulated costs; \"fastest that fits\" is the lowest measured step "
           "among the plugin's schedules inside the budget (within 2% counts as a match).", "",
           "| p | m | budget | excluded | selected (ms) | fastest that fits (ms) | match |",
           "|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['p']} | {r['m']} | {r['budget']} | {', '.join(r['excluded']) or '-'} "
                   f"| {r['chosen']} ({r['chosen_ms']:.1f}) | {r['fastest']} "
                   f"({r['fastest_ms']:.1f}) | {'yes' if r['ok'] else 'no'} |")
    good = sum(r["ok"] for r in rows)
    checks.append(("select picks the measured-fastest schedule that fits (within 2%)",
                   f"{good} of {len(rows)} configurations", good == len(rows)))
    return out + [""]
