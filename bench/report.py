"""``results.md`` and ``results.png`` from ``results.json`` (format 2: one provenance per part).

Every figure is printed as ``median (min-max)`` over the rounds behind it; every part names
the run (commit, uncommitted changes, UTC time, command) that produced it.
"""

from __future__ import annotations

from pathlib import Path

from bench import calibration, selector_check
from bench.emulated_device import PLUGIN, PLUGIN_ONLY_WHEN_ASKED, TORCH, labelled_schedule
from bench.provenance import short
from bench.stats import median, ms_range, quartiles, with_range
from megatron_pp_ext.schedules.validate import peak_activations

TARGETS = {"zb-h1": 0.85, "zb-h2": 0.80, "zb-v": 0.80}
PARTS = {"emulated": "(a)", "real_gpt": "(b)", "overhead": "(c)", "analysis": "(d)",
         "nccl_fabric": "(e)", "memory_bytes": "(f)"}
MODEL_NAMES = {"t_comm": "costs + t_comm", "post": "+post (measured posting time per action)",
               "calibrated": "calibrated t_overhead"}


def render(results: dict) -> str:
    sections = results["sections"]
    checks: list = []  # (part, target, measured, met)
    body = []
    if "emulated" in sections:
        body += emulated_markdown(sections["emulated"], results["t"], checks)
    if "real_gpt" in sections:
        body += real_gpt_markdown(sections["real_gpt"], checks)
    if "overhead" in sections:
        body += overhead_markdown(sections["overhead"]["rows"], checks)
    if "analysis" in sections:
        body += analysis_markdown(sections["analysis"]["rows"], checks)
    if "nccl_fabric" in sections:
        body += nccl_fabric_markdown(sections["nccl_fabric"], checks)
    if "memory_bytes" in sections:
        body += memory_bytes_markdown(sections["memory_bytes"])
    out = ["# Benchmark results", "",
           "Each part names the run that produced it; a part rerun alone (`--only`) replaces "
           "its own rows and provenance and leaves the others as they were. Figures are the "
           "median (min-max) over the rounds behind them.", ""]
    out += runs_table(sections)
    out += ["## Targets", "", "| part | target | measured | met |", "|---|---|---|---|"]
    out += [f"| {part} | {target} | {measured} | {verdict(met)} |"
            for part, target, measured, met in checks]
    return "\n".join(out + [""] + body) + "\n"


def verdict(met) -> str:
    """A check is met (True), not (False), or says why neither (a string)."""
    return met if isinstance(met, str) else ("yes" if met else "no")


def runs_table(sections: dict) -> list[str]:
    out = ["## Runs", "", "| part | commit | uncommitted changes | UTC | command | machine |",
           "|---|---|---|---|---|---|"]
    for key, part in PARTS.items():
        if key not in sections:
            continue
        prov = sections[key]["provenance"]
        dirty = "no"
        if prov["dirty"]:
            paths = prov["dirty_paths"]
            dirty = "yes: " + ", ".join(f"`{p}`" for p in paths[:6]) + (
                f" and {len(paths) - 6} more" if len(paths) > 6 else "")
        out.append(f"| {part} | `{prov['commit']}` | {dirty} | {prov['utc_start']} to "
                   f"{prov.get('utc_end', '?')} | `{prov['command']}` | {prov['cpus']} CPUs, "
                   f"Python {prov['python']}, load {prov['load_before']} before, "
                   f"{prov.get('load_after', '?')} after, {prov.get('seconds', 0):.0f} s |")
    return out + [""]


# ------------------------------------------------------------------ (a)
def emulated_markdown(section: dict, t: float, checks: list) -> list[str]:
    trees, cals = section["trees"], section["calibration"]
    by_p = {cal["p"]: cal for cal in cals}
    out = ["## (a) Emulated device, real Executor over gloo", "",
           f"Run: {short(section['provenance'])}.", "",
           f"t_F = t_I = t_W = {1e3 * t:g} ms per rank (t_B = {2e3 * t:g} ms); a schedule with v "
           "chunks per rank runs chunks of 1/v of that. Step = barrier to barrier, last rank's "
           "end minus first rank's start. Two kinds of process trees, one after the other: a "
           "*calibration run* per p (the same mix as a judged tree, at one m; only the "
           "plugin's 1f1b steps and the ping-pongs are kept) gives t_comm, the posting time "
           "and the per-action t_overhead; a *judged run* per p (a fresh tree, "
           "every schedule, every m, rounds in rotating order) is predicted with those numbers "
           "unchanged. Held out: every judged row except 1F1B (any implementation) at the "
           "calibration's (p, m).", ""]
    out += calibration_table(cals)
    out += judged_table(trees, by_p, t)
    out += accuracy_lines(trees, checks)
    target_checks(trees, checks)
    torch_target_checks(trees, checks, t)
    out += selector_check.markdown(selector_check.check(trees, by_p, t), checks)
    out += back_to_back_table(trees)
    return out


def calibration_table(cals: list) -> list[str]:
    out = ["### Calibration run", "",
           "t_overhead = (1F1B's step - its prediction with t_comm alone) / 2(m + p - 1), per "
           "round; the median is used.", "",
           "| p | m | rounds | 1F1B step (ms) | round trip mean (ms) | t_comm (ms) | "
           "post (ms) | t_overhead (ms) | UTC |", "|---|---|---|---|---|---|---|---|---|"]
    for cal in cals:
        out.append(f"| {cal['p']} | {cal['m']} | {len(cal['times'])} | {ms_range(cal['times'])} "
                   f"| {1e3 * cal['rtt']:.2f} | {1e3 * cal['t_comm']:.3f} | "
                   f"{1e3 * cal['post']:.3f} | {ms_range(cal['t_overhead_rounds'], 3)} | "
                   f"{cal.get('utc_start')} |")
    return out + [""]


def judged_table(trees: list, cals: dict, t: float) -> list[str]:
    out = ["### Judged run", ""]
    for tree in trees:
        out.append(f"p={tree['p']}: {tree['reps']} rounds, {tree.get('utc_start')} to "
                   f"{tree.get('utc_end')}; this tree's own round trip {1e3 * tree['rtt']:.2f} "
                   f"ms mean (not used: predictions use the calibration's "
                   f"{1e3 * cals[tree['p']]['rtt']:.2f} ms); ranks reniced: "
                   f"{tree.get('reniced')}  ")
    out += ["", "measured / predicted, for three predictions: *t_comm* (the costs and t_comm "
            "alone), *+post* (the measured time to post one fused send+receive added to every "
            "F, I and B), *calibrated* (t_overhead added instead). \"vs 1F1B\": per-round ratio "
            "to the plugin's 1f1b in the same tree; \"predicted\": the calibrated ratio.", "",
            "| p | m | schedule | v | step (ms) | vs 1F1B | predicted | measured / t_comm | "
            "measured / +post | measured / calibrated | held out |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    for tree in trees:
        for m in sorted({r["m"] for r in tree["rows"]}):
            group = [r for r in tree["rows"] if r["m"] == m]
            base = next(r for r in group if r["schedule"] == "1f1b")
            for r in group:
                out.append(judged_row(r, base))
            limit = 3 * m * t
            out.append(f"| {tree['p']} | {m} | zero-bubble limit m(t_F+t_I+t_W) | - | "
                       f"{1e3 * limit:.1f} | {limit / base['median']:.3f} | "
                       f"{limit / base['predicted']['calibrated']:.3f} | - | - | - | - |")
    return out + [""] + torch_notes(trees)


def judged_row(r: dict, base: dict) -> str:
    """One row of the judged table; torch.pipelining's rows are measured only ("-")."""
    head = (f"| {r['p']} | {r['m']} | {r['schedule']} | {r['v']} | {ms_range(r['times'])} | "
            f"{with_range(r['vs_1f1b_rounds'])} | ")
    if r.get("predicted") is None:
        return head + "- | - | - | - | - |"
    errors = [with_range(calibration.error_rounds(r, model)) for model in calibration.MODELS]
    predicted = r["predicted"]["calibrated"] / base["predicted"]["calibrated"]
    return head + (f"{predicted:.3f} | {' | '.join(errors)} | "
                   f"{'yes' if r['held_out'] else 'no (calibration)'} |")


def torch_notes(trees: list) -> list[str]:
    """What the torch rows are, and the configurations torch's classes refused."""
    out = ["\"torch ...\": `torch.distributed.pipelining` (`PipelineStage` + the schedule "
           "class named) in the same tree and rounds, chunks costing what the plugin's do, its "
           "own I/W split (`stage_backward_input` / `stage_backward_weight`; on stage 0 torch "
           "skips the input half and runs the whole backward in W). Not predicted."]
    for tree in trees:
        for e in tree.get("torch_errors", []):
            out.append(f"* p={e['p']} m={e['m']} {e['schedule']}: not run, torch raised "
                       f"`{e['error']}`")
    return out + [""]


def accuracy_lines(trees: list, checks: list) -> list[str]:
    """Within 5% on held-out rows only, for each of the three predictions."""
    out = ["Held-out accuracy (judged run, medians; \"every round\": all of the row's rounds "
           "within 5%):", ""]
    for model in calibration.MODELS:
        acc = calibration.accuracy(trees, model)
        text = (f"{acc['within']} of {acc['rows']} held-out rows within "
                f"{100 * calibration.TOLERANCE:.0f}% ({acc['every_round']} of {acc['rows']} in "
                f"every round); median error {100 * acc['median_error']:.1f}%, worst "
                f"{100 * acc['worst']:.1f}%")
        out.append(f"* {MODEL_NAMES[model]}: {text}; {breakdown(trees, model)}")
        off = f"; off: {'; '.join(acc['off'])}" if acc["off"] else ""
        checks.append(("(a)", f"held-out schedules within {100 * calibration.TOLERANCE:.0f}% of "
                       f"the prediction, {MODEL_NAMES[model]} (from the calibration run)",
                       text + off, not acc["off"]))
    return out + [""]


def breakdown(trees: list, model: str) -> str:
    """Within-tolerance counts for v=1 and v=2 rows, and for rows at m other than the
    calibration's."""
    cal_m = {tree["p"]: tree["calibration"]["m"] for tree in trees}
    parts = {"v=1": lambda r: r["v"] == 1, "v=2": lambda r: r["v"] == 2,
             "m other than the calibration's": lambda r: r["m"] != cal_m[r["p"]]}
    counts = []
    for name, keep in parts.items():
        acc = calibration.accuracy(trees, model, keep)
        counts.append(f"{name} {acc['within']} of {acc['rows']}")
    return ", ".join(counts)


def target_checks(trees: list, checks: list) -> None:
    for name, limit in TARGETS.items():
        values = []
        for tree in trees:
            for r in tree["rows"]:
                if r["schedule"] != name:
                    continue
                base = next(b for b in tree["rows"] if b["m"] == r["m"] and b["schedule"] == "1f1b")
                predicted = r["predicted"]["calibrated"] / base["predicted"]["calibrated"]
                values.append((r, predicted))
        if values:
            text = ", ".join(f"{with_range(r['vs_1f1b_rounds'])} (p={r['p']} m={r['m']}; "
                             f"predicted {pr:.3f})" for r, pr in values)
            checks.append(("(a)", f"{name} <= {limit} of 1F1B", text,
                           all(r["vs_1f1b"] <= limit for r, _ in values)))


TORCH_TARGET, FLOOR_TARGET = 0.95, 1.02


def torch_target_checks(trees: list, checks: list, t: float) -> None:
    """Per (p, m): the fastest plugin schedule within 1F1B's activation memory against (1)
    torch.pipelining's fastest row of the same run (per-round ratio) and (2) the floor of
    its own layout."""
    for tree in trees:
        p = tree["p"]
        for m in sorted({r["m"] for r in tree["rows"]}):
            group = {r["schedule"]: r for r in tree["rows"] if r["m"] == m}
            fits = [r for label, r in group.items()
                    if label in PLUGIN_LABELS and peak_v1(label, p, m) <= p]
            torch_rows = [r for label, r in group.items() if label in TORCH_LABELS]
            if not fits:
                continue
            best = min(fits, key=lambda r: r["median"])
            name = f"{best['schedule']} {ms_range(best['times'])}"
            where = f"p={p} m={m}"
            if torch_rows:
                rival = min(torch_rows, key=lambda r: r["median"])
                ratios = [a / b for a, b in zip(best["times"], rival["times"])]
                checks.append(("(a)", f"{where}: fastest plugin schedule within 1F1B's peak "
                               f"activations ({p} in v=1 units) / torch.pipelining's fastest "
                               f"row, per round, <= {TORCH_TARGET}",
                               f"{name} / {rival['schedule']} {ms_range(rival['times'])}: "
                               f"{with_range(ratios)}", median(ratios) <= TORCH_TARGET))
            floor = layout_floor(best["schedule"], p, m, t)
            checks.append(("(a)", f"{where}: that schedule / its floor m(t_F+t_I+t_W) + its "
                           f"layout's fill, <= {FLOOR_TARGET}",
                           f"{name} / {1e3 * floor:.1f}: "
                           f"{with_range([x / floor for x in best['times']])}",
                           best["median"] / floor <= FLOOR_TARGET))


PLUGIN_LABELS = {label for label, *_ in PLUGIN + PLUGIN_ONLY_WHEN_ASKED}
TORCH_LABELS = {label for label, *_ in TORCH}


def peak_v1(label: str, p: int, m: int) -> float:
    """The schedule's peak of live activations on any rank, in v=1 units (a stage's
    activation is 1/path_chunks of a rank's share; dualpipe's stages are whole parts)."""
    schedule = labelled_schedule(label, p, m)
    return max(peak_activations(schedule)) / schedule.path_chunks


def layout_floor(label: str, p: int, m: int, t: float) -> float:
    """m(t_F+t_I+t_W), every rank's work, plus the fill its layout cannot avoid: a rank
    cannot start before the forwards of the stages between an entry and its nearest stage
    (t / path_chunks each); the latest such start over the ranks, e.g. (p-1) t/2 for the V
    layout, (p-1) t for 1F1B's."""
    schedule = labelled_schedule(label, p, m)
    entries = [s for s in range(schedule.num_stages) if schedule.is_entry(s)]
    ahead = lambda s: s - max(e for e in entries if e <= s)  # stages before s on its path
    fill = max(min(ahead(s) for s in schedule.stages_of(rank)) for rank in range(p))
    return 3 * m * t + fill * t / schedule.path_chunks


def back_to_back_table(trees: list) -> list[str]:
    rows = [r for tree in trees for r in tree["back_to_back"]]
    if not rows:
        return []
    out = ["### Back to back, no barrier between steps (judged run)", "",
           "Each rank starts its next step as soon as its own part of the previous one is done "
           "(4 steps; steady step = (E_4 - E_1) / 3, E_j = when the last rank finishes step j; "
           "rounds in rotating order). This is what Megatron-LM does when nothing in the "
           "optimizer step synchronizes the pipeline ranks: `--clip-grad 0` (no global "
           "grad-norm all-reduce), bf16 or fp32 (no fp16 loss-scaler inf check), "
           "`--untie-embeddings-and-output-weights` (no first/last-stage embedding all-reduce), "
           "no `--log-num-zeros-in-grad`, no per-token loss. Predicted: the 4 steps simulated as "
           "one concatenated schedule, with the calibration run's numbers.", "",
           "| p | m | schedule | steady step (ms) | vs 1F1B | measured / t_comm | "
           "measured / +post | measured / calibrated | single step, barrier (ms) |",
           "|---|---|---|---|---|---|---|---|---|"]
    for tree in trees:
        single = {(r["m"], r["schedule"]): r["times"] for r in tree["rows"]}
        for r in tree["back_to_back"]:
            errors = [with_range(calibration.error_rounds(r, model, "periods"))
                      for model in calibration.MODELS]
            out.append(f"| {r['p']} | {r['m']} | {r['schedule']} | {ms_range(r['periods'])} | "
                       f"{with_range(r['vs_1f1b_rounds'])} | {' | '.join(errors)} | "
                       f"{ms_range(single[(r['m'], r['schedule'])])} |")
    return out + [""] + cross_step_table(trees)


def cross_step_table(trees: list) -> list[str]:
    """Back to back with gradient clipping and fp16 loss scaling emulated: Megatron's
    synchronous optimizer step against the post-validated one, beside the single step (with a
    barrier) and the back-to-back step with nothing in the optimizer step."""
    rows = [r for tree in trees for r in tree.get("cross_step", [])]
    if not rows:
        return []
    first = rows[0]
    out = ["### Back to back with clipping and loss scaling (cross-step)", "",
           f"Each step ends with an optimizer step of t_opt = {1e3 * first['t_opt']:.0f} ms and "
           "two one-float all-reduces over every rank (found-inf MAX, squared grad norm SUM). "
           "*sync*: Megatron's `optimizer.step()` (both block, then the optimizer). "
           "*post-validated*: `integration.post_validation` (reductions posted async, snapshot "
           f"t_copy = {1e3 * first['t_copy']:.0f} ms and the optimistic step at once, settled "
           "before the rank's next step reads its weights; on step(s) "
           f"{first['rollback_steps']} of steps 0-{first['k'] - 1} the norm is above the clip: "
           "restore and redo, t_copy + t_opt more). *run-ahead*: `run_ahead_step.RunAhead` "
           "(the next step starts at once on the optimistic weights; the previous step settles "
           "after its compute; a step after a rolled-back one is replayed). Steady step "
           f"(E_{first['k']} - E_1) / {first['k'] - 1} over {first['k']} steps back to back "
           "(E_j: when the last rank's step j returns); vs 1F1B sync: per-round ratio to 1F1B with Megatron's step, median "
           "(min-max).", "",
           "| p | m | schedule | mode | steady step (ms) | vs 1F1B sync | vs 1F1B same mode | "
           "back to back, no optimizer (ms) | single step, barrier (ms) |",
           "|---|---|---|---|---|---|---|---|---|"]
    for tree in trees:
        single = {(r["m"], r["schedule"]): r["times"] for r in tree["rows"]}
        free = {(r["m"], r["schedule"]): r["periods"] for r in tree["back_to_back"]}
        for r in tree.get("cross_step", []):
            key = (r["m"], r["schedule"])
            out.append(
                f"| {r['p']} | {r['m']} | {r['schedule']} | {r['mode']} | "
                f"{ms_range(r['periods'])} | {with_range(r.get('vs_1f1b_sync_rounds', []))} | "
                f"{with_range(r.get('vs_1f1b_same_mode_rounds', []))} | "
                f"{ms_range(free[key]) if key in free else '-'} | "
                f"{ms_range(single[key]) if key in single else '-'} |")
    return out + [""]


# ------------------------------------------------------------------ (b)
def real_gpt_markdown(section: dict, checks: list) -> list[str]:
    runs = section["runs"]
    pooled = [x for run in runs for x in run["ratios"]]
    per_run = [run["ratio"] for run in runs]
    of_medians = [run["ratio_of_medians"] for run in runs]
    q1, q3 = quartiles(pooled)
    # One median is not the figure here: the runs disagree by more than the 3% target.
    met = ("yes" if max(per_run) <= 1.03 else "no" if min(per_run) > 1.03
           else "inconclusive: the runs straddle 1.03")
    checks.append(("(b)", "tiny GPT: plugin 1f1b / Megatron 1F1B <= 1.03",
                   f"per-run medians of the per-round ratios {min(per_run):.3f} to "
                   f"{max(per_run):.3f} over {len(runs)} fresh runs (ratio of medians "
                   f"{min(of_medians):.3f} to {max(of_medians):.3f}); all {len(pooled)} rounds: "
                   f"median {median(pooled):.3f}, quartiles {q1:.3f}-{q3:.3f}, range "
                   f"{min(pooled):.3f}-{max(pooled):.3f}. CPU-bound: 4 ranks on "
                   f"{section['provenance']['cpus']} cores", met))
    out = [f"## (b) Tiny real GPTModel on CPU/gloo, p={section['p']}, m={section['m']}", "",
           f"Run: {short(section['provenance'])}.", "",
           f"{len(runs)} fresh process trees one after the other; in each, the two functions "
           f"alternate step by step (order flipped every round), {section['steps']} steps each. "
           "CPU-bound: 4 ranks computing on "
           f"{section['provenance']['cpus']} cores next to whatever else runs, so single "
           "rounds, and single runs, are noisy; read the spread.", "",
           "| run | UTC | plugin `ScheduleFunction(\"1f1b\")` (ms) | Megatron "
           "`forward_backward_pipelining_without_interleaving` (ms) | plugin / Megatron, "
           "per-round ratio | ratio of medians |", "|---|---|---|---|---|---|"]
    for i, run in enumerate(runs, 1):
        rq1, rq3 = quartiles(run["ratios"])
        out.append(f"| {i} | {run['utc_start']} | {ms_range(run['times']['plugin 1f1b'])} | "
                   f"{ms_range(run['times']['megatron 1f1b'])} | {with_range(run['ratios'])}, "
                   f"quartiles {rq1:.3f}-{rq3:.3f} | {run['ratio_of_medians']:.3f} |")
    out.append(f"| all | | | | {with_range(pooled)}, quartiles {q1:.3f}-{q3:.3f} | "
               f"{min(of_medians):.3f} to {max(of_medians):.3f} |")
    return out + [""]


# ------------------------------------------------------------------ (c), (d)
def overhead_markdown(rows: list, checks: list) -> list[str]:
    out = ["## (c) Executor overhead per action, stages that do nothing", "",
           "`instant`: one rank's list at a time against a transport that completes at once "
           "(the executor's own cost); `in-memory threads`: all ranks as threads of one "
           "process, wall time over all actions; `gloo processes`: wall time over one rank's "
           "actions (latency-bound: every hop on the critical path is a gloo message). "
           "Median (min-max) over the repeats.", "",
           "| schedule | p | m | v | mode | wall us per action | CPU us per action |",
           "|---|---|---|---|---|---|---|"]
    for r in rows:
        cpu = with_range(r["cpu_us_rounds"], 1) if r.get("cpu_us_rounds") else "-"
        out.append(f"| {r['schedule']} | {r['p']} | {r['m']} | {r['v']} | {r['mode']} | "
                   f"{with_range(r['us_rounds'], 1)} | {cpu} |")
    instant = [r for r in rows if r["mode"] == "instant"]
    if instant:
        cpu = [x for r in instant for x in r["cpu_us_rounds"]]
        medians = [r["cpu_us_per_action"] for r in instant]
        checks.append(("(c)", "executor overhead < 50 us per action (instant transport, CPU "
                       "time)", f"medians {min(medians):.1f} to {max(medians):.1f} us CPU; "
                       f"every repeat {min(cpu):.1f} to {max(cpu):.1f} us", max(cpu) < 50))
    return out + [""]


def analysis_markdown(rows: list, checks: list) -> list[str]:
    out = ["## (d) Validator and simulator at p=64, m=512", "",
           "Median (min-max) of the repeats, CPU time (wall time median beside it; the "
           "simulator timed without its own validation); the target is judged on CPU time, "
           "which other work on this shared machine does not inflate.", "",
           "| schedule | v | actions | build (s) | validate CPU (s) | validate wall (s) | "
           "simulate CPU (s) | simulate wall (s) | bubble |",
           "|---|---|---|---|---|---|---|---|---|"]
    worst = []
    for r in rows:
        if "simulate_s" not in r:
            out.append(f"| {r['schedule']} | {r['v']} | - | - | - | - | - | - | {r['note']} |")
            continue
        validate, simulate = r["validate_rounds"], r["simulate_rounds"]
        out.append(f"| {r['schedule']} | {r['v']} | {r['actions']} | {r['build_s']:.2f} | "
                   f"{with_range(validate['cpu'])} | {r['validate_s']:.3f} | "
                   f"{with_range(simulate['cpu'])} | {r['simulate_s']:.3f} | "
                   f"{100 * r['bubble']:.2f}% |")
        if r["v"] == 2:
            worst += validate["cpu"] + simulate["cpu"]
    if worst:
        checks.append(("(d)", "validate and simulate < 2 s at p=64, m=512, v=2 (CPU time)",
                       f"slowest repeat {max(worst):.2f} s CPU", max(worst) < 2))
    return out + [""]


# ------------------------------------------------------------------ plot
def nccl_fabric_markdown(section: dict, checks: list) -> list[str]:
    cal = section["calibration"]
    out = ["## (e) Emulated device over the in-memory NCCL-rules fabric", "",
           "Threads of one process run the real Executor as on NCCL (the posting "
           "`analysis.lowering` picks) over `NcclRulesFabric` (rendezvous sends, one Work per "
           "batch, batches in order per rank, data visible after the wait); stages sleep "
           "t_F = t_I = t_W = 20 ms per rank (1/v per chunk). Predicted by the simulator's "
           "NCCL model (`simulate(..., communication=\"nccl\")`: the lowered program timed "
           "under the same rules) and, beside it, the buffered model, with one number "
           f"from a separate calibration run of 1F1B at p={cal['p']}, m={cal['m']} "
           f"({len(cal['steps'])} rounds) in two ways: t_overhead = "
           f"{1000 * cal['t_overhead']:.3f} ms per F/I/B (rounds "
           f"{with_range(cal['t_overhead_rounds'], 3, 1000)} ms; columns *NCCL model* and "
           "*buffered*), or t_comm = "
           f"{1000 * cal.get('t_comm', 0.0):.3f} ms per message, charged by the NCCL model "
           "only where a message is on the critical path (*NCCL, latency*). Held out: every "
           "row but that 1F1B.", "",
           "| p | m | schedule | v | step (ms) | NCCL model (ms) | measured / NCCL model | "
           "buffered model (ms) | measured / buffered | NCCL, latency (ms) | "
           "measured / NCCL, latency | held out |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    judged = {"nccl": [], "nccl_latency": []}
    for r in section["rows"]:
        ratio = {k: [s / r[k] for s in r["steps"]] for k in judged if k in r}
        latency = (f"{1000 * r['nccl_latency']:.1f} | {with_range(ratio['nccl_latency'])}"
                   if "nccl_latency" in r else "- | -")
        out.append(f"| {r['p']} | {r['m']} | {r['schedule']} | {r['v']} | "
                   f"{ms_range(r['steps'])} | {1000 * r['nccl']:.1f} | "
                   f"{with_range(ratio['nccl'])} | {1000 * r['buffered']:.1f} | "
                   f"{with_range([s / r['buffered'] for s in r['steps']])} | {latency} | "
                   f"{'yes' if r['held_out'] else 'no (calibration)'} |")
        if r["held_out"]:
            for k in ratio:
                judged[k].append((r, median(ratio[k])))
    for key, model in (("nccl", "NCCL model, t_overhead"), ("nccl_latency",
                                                             "NCCL model, t_comm")):
        rows = judged[key]
        v_rows = [(r, x) for r, x in rows if r["schedule"] in ("zb-v", "dualpipev")]
        if v_rows:
            text = "; ".join(f"{r['schedule']} m={r['m']}: {x:.3f}" for r, x in v_rows)
            checks.append(("(e)", f"zb-v and dualpipev within 3% of the simulator ({model}, "
                           "held out)", text, all(abs(x - 1) <= 0.03 for _, x in v_rows)))
        if rows:
            inside = sum(abs(x - 1) <= 0.03 for _, x in rows)
            worst = max(rows, key=lambda rx: abs(rx[1] - 1))
            checks.append(("(e)", f"every held-out schedule within 3% ({model})",
                           f"{inside} of {len(rows)}; worst {worst[0]['schedule']} "
                           f"m={worst[0]['m']}: {worst[1]:.3f}", inside == len(rows)))
    return out + [""]


def memory_bytes_markdown(section: dict) -> list[str]:
    """(f): bench/memory_bytes.py's table."""
    from bench import memory_bytes

    return (["## (f) Activation memory in bytes: measured and predicted", ""]
            + memory_bytes.markdown(section) + [""])


def plot(section: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    trees = section["trees"]
    fig, axes = plt.subplots(len(trees), 2, figsize=(15, 4.2 * len(trees)), squeeze=False)
    for row, tree in zip(axes, trees):
        rows = tree["rows"]
        ms_ = sorted({r["m"] for r in rows})
        labels = list(dict.fromkeys(r["schedule"] for r in rows))
        # torch.pipelining's rows are measured, not predicted: left panel only
        predicted = [label for label in labels
                     if all(r.get("predicted") for r in rows if r["schedule"] == label)]
        width = 0.8 / len(ms_)
        for i, m in enumerate(ms_):
            group = {r["schedule"]: r for r in rows if r["m"] == m}
            shift = (i - (len(ms_) - 1) / 2) * width
            xs = [j + shift for j, label in enumerate(labels) if label in group]
            base = group["1f1b"]["predicted"]["calibrated"]
            _bars(row[0], xs, [group[label]["vs_1f1b_rounds"] for label in labels
                               if label in group], width, f"m={m} measured")
            row[0].scatter([j + shift for j, label in enumerate(labels)
                            if label in predicted and label in group],
                           [group[label]["predicted"]["calibrated"] / base
                            for label in labels if label in predicted and label in group],
                           marker="_", s=120, color="black", zorder=3,
                           label="predicted" if i == 0 else None)
            row[0].axhline(3 * m * tree["t"] / group["1f1b"]["median"], color=f"C{i}",
                           linestyle=":", linewidth=1)
            _bars(row[1], [j + shift for j, label in enumerate(predicted) if label in group],
                  [calibration.error_rounds(group[label], "calibrated")
                   for label in predicted if label in group], width, f"m={m}")
        for ax, names in ((row[0], labels), (row[1], predicted)):
            ax.set_xticks(range(len(names)))
            ax.set_xticklabels(names, rotation=30, ha="right", fontsize=8)
            ax.grid(axis="y", alpha=0.3)
        row[0].set_title(f"p={tree['p']}: step time / plugin 1f1b, median and min-max "
                         "(dotted: zero-bubble limit)", fontsize=10)
        row[0].set_ylim(0, 1.3)
        row[0].legend(fontsize=7, ncol=2)
        row[1].axhspan(1 - calibration.TOLERANCE, 1 + calibration.TOLERANCE, color="green",
                       alpha=0.1)
        row[1].set_ylim(0.8, 1.3)
        row[1].set_title(f"p={tree['p']}: measured / predicted with the calibration run's "
                         "t_overhead (band: within 5%)", fontsize=10)
        row[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _bars(ax, xs, rounds, width, label):
    """Bars at the medians, whiskers to the min and max of the rounds."""
    mids = [median(r) for r in rounds]
    ax.bar(xs, mids, width, label=label,
           yerr=[[m - min(r) for m, r in zip(mids, rounds)],
                 [max(r) - m for m, r in zip(mids, rounds)]],
           error_kw={"elinewidth": 0.8, "capsize": 1.5})
