"""Does ``select`` pick what the emulated device measures as fastest among what fits?

For each judged (p, m), the selector gets the emulated costs (t_F = t_I = t_W = t per rank)
and the machine's numbers from the *calibration* run for that p (t_comm and the per-action
t_overhead fitted to 1F1B alone at one m; see ``bench.calibration``), never anything from the
run it is judged against, and two budgets: none, and 1F1B's own peak (p activations on rank 0,
a common "no more memory than today" rule). Among the plugin's schedules that fit, the
measured-fastest (median step of the judged run) is compared with the selector's first
choice; the check passes when the choice is the fastest, or within 2% of it (the rounds'
noise; ties such as zb-h1 / zb-h2 at equal costs are common). Configurations at the
calibration's m are marked: 1F1B's step there was measured (in the other run) to fit the
overhead.
"""

from __future__ import annotations

from megatron_pp_ext.analysis.select import select_schedules
from megatron_pp_ext.analysis.simulate import CostModel

from bench.stats import ms_range

LABELS = {("gpipe", 1): "gpipe", ("1f1b", 1): "1f1b", ("interleaved", 2): "interleaved v=2",
          ("zb-h1", 1): "zb-h1", ("zb-h2", 1): "zb-h2", ("zb-v", 2): "zb-v",
          ("dualpipev", 2): "dualpipev"}
NOISE = 1.02


def check(trees: list, calibrations: dict, t: float) -> list[dict]:
    """``calibrations``: p -> the calibration record for that p (``bench.calibration``)."""
    out = []
    for tree in trees:
        p, cal = tree["p"], calibrations[tree["p"]]
        for m in sorted({r["m"] for r in tree["rows"]}):
            rows = {r["schedule"]: r for r in tree["rows"] if r["m"] == m}
            measured = {label: r["median"] for label, r in rows.items()}
            costs = CostModel(t_f=t, t_i=t, t_w=t, t_comm=cal["t_comm"],
                              t_overhead=cal["t_overhead"])
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
                    "chosen_times": rows[chosen]["times"], "fastest": fastest,
                    "fastest_times": rows[fastest]["times"],
                    "calibration_m": m == cal["m"],
                    "excluded": [f"{e.name}" + (f" v={e.chunks}" if e.chunks > 1 else "")
                                 for e in selection.excluded],
                    "ok": measured[chosen] <= NOISE * measured[fastest],
                })
    return out


def markdown(rows: list, checks: list) -> list[str]:
    out = ["## Selector against the measurements", "",
           "`select` with the emulated costs and the calibration run's t_comm and t_overhead; "
           "\"fastest that fits\" is the lowest median step of the judged run among the "
           "plugin's schedules inside the budget (within 2% counts as a match). Steps: median "
           "(min-max) over the judged run's rounds, ms.", "",
           "| p | m | budget | excluded | selected (ms) | fastest that fits (ms) | match |",
           "|---|---|---|---|---|---|---|"]
    for r in rows:
        m = f"{r['m']} (calibration m)" if r["calibration_m"] else str(r["m"])
        out.append(f"| {r['p']} | {m} | {r['budget']} | {', '.join(r['excluded']) or '-'} "
                   f"| {r['chosen']} {ms_range(r['chosen_times'])} | {r['fastest']} "
                   f"{ms_range(r['fastest_times'])} | {'yes' if r['ok'] else 'no'} |")
    good = sum(r["ok"] for r in rows)
    held = [r for r in rows if not r["calibration_m"]]
    held_good = sum(r["ok"] for r in held)
    checks.append(("(a)", "select picks the measured-fastest schedule that fits (within 2%), "
                   "costs from the calibration run",
                   f"{good} of {len(rows)} configurations; {held_good} of {len(held)} at m other "
                   "than the calibration's", good == len(rows)))
    return out + [""]
