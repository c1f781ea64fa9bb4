"""Bench (a)'s predictions, out of sample.

A *calibration run* (its own process tree per p) runs what a judged tree runs at one m_cal
(same processes, process groups and rotation, so the machine is loaded the same way), but keeps
only the plugin's ``1f1b`` steps and the ping-pongs. From them come every number the cost model
takes from the machine:

* ``t_comm``: half the mean gloo round trip of one activation (ping-pongs in that tree);
* ``post``: the mean time to post one fused send+receive call (same ping-pongs);
* ``t_overhead``: a per-action runtime cost, (1F1B's step - its prediction without overhead)
  over the 2(m + p - 1) F/B actions on 1F1B's critical path, the median over the rounds.

The *judged run* is a fresh process tree per p that runs every schedule at every m. Its rows
are predicted with the calibration's numbers, unchanged. Accuracy is counted on held-out rows
only: every row except those predicted by the calibrated model itself (1F1B, whichever
implementation, at the calibration's (p, m)).
"""

from __future__ import annotations

from bench import emulated_device
from bench.stats import median

TOLERANCE = 0.05
CALIBRATION_SCHEDULE = ("1f1b", 1)
MODELS = ("t_comm", "post", "calibrated")  # the three predictions, least to most fitted


def spec_of(label: str) -> tuple[str, int] | None:
    """(registry name, v) that predicts a row's schedule (Megatron's runs included); None for
    torch.pipelining's rows, which are measured beside the others but not predicted."""
    specs = {label: (name, v) for label, name, v in emulated_device.PLUGIN}
    specs.update({label: pred for label, _, _, pred in emulated_device.MEGATRON})
    specs.update({label: None for label, *_ in emulated_device.TORCH})
    return specs[label]


def critical_actions(p: int, m: int) -> int:
    """F and B actions on 1F1B's critical path: 2(m + p - 1)."""
    return 2 * (m + p - 1)


def calibrate(tree: dict, m: int) -> dict:
    """The machine's numbers from one calibration tree (1F1B alone at (p, m))."""
    p, t = tree["p"], tree["t"]
    row = next(r for r in tree["rows"] if r["schedule"] == "1f1b" and r["m"] == m)
    bare = emulated_device.predict("1f1b", 1, p, m, t, tree["t_comm"])["makespan"]
    # one value per round, so the calibration's own spread is on record
    per_round = [max(0.0, (x - bare) / critical_actions(p, m)) for x in row["times"]]
    return {"p": p, "m": m, "t": t, "t_comm": tree["t_comm"], "rtt": tree["rtt"],
            "post": tree["post"], "t_overhead": median(per_round),
            "t_overhead_rounds": per_round, "times": row["times"],
            "utc_start": tree.get("utc_start"), "utc_end": tree.get("utc_end")}


def per_action(cal: dict, model: str) -> float:
    """What a prediction adds to every F, I and B."""
    return {"t_comm": 0.0, "post": cal["post"], "calibrated": cal["t_overhead"]}[model]


def is_held_out(row: dict, cal: dict) -> bool:
    return not (row["m"] == cal["m"] and spec_of(row["schedule"]) == CALIBRATION_SCHEDULE)


def apply(tree: dict, cal: dict, k_steps: int) -> None:
    """Attach the calibration's predictions to a judged tree's rows (in place)."""
    p, t = tree["p"], tree["t"]
    for row in tree["rows"]:
        if spec_of(row["schedule"]) is None:
            row["held_out"], row["predicted"] = None, None  # not predicted, not judged
            continue
        name, v = spec_of(row["schedule"])
        row["held_out"] = is_held_out(row, cal)
        row["predicted"] = {model: emulated_device.predict(
            name, v, p, row["m"], t, cal["t_comm"], per_action(cal, model))["makespan"]
            for model in MODELS}
    for row in tree["back_to_back"]:
        name, v = spec_of(row["schedule"])
        row["held_out"] = is_held_out(row, cal)
        row["predicted"] = {model: emulated_device.predict(
            name, v, p, row["m"], t, cal["t_comm"], per_action(cal, model), k=k_steps)["period"]
            for model in MODELS}
    tree["calibration"] = {key: cal[key] for key in ("p", "m", "t_comm", "post", "t_overhead")}


def error_rounds(row: dict, model: str, key: str = "times") -> list[float]:
    """Measured / predicted, one value per round."""
    return [x / row["predicted"][model] for x in row[key]]


def accuracy(trees: list, model: str, keep=lambda row: True) -> dict:
    """Held-out rows (those ``keep`` accepts) within TOLERANCE of the prediction: by their
    median, and in every round."""
    held = [r for tree in trees for r in tree["rows"] if r["held_out"] and keep(r)]
    off, every_round = [], 0
    for r in held:
        ratio = r["median"] / r["predicted"][model]
        if abs(ratio - 1) > TOLERANCE:
            off.append(f"{r['schedule']} p={r['p']} m={r['m']}: {ratio:.3f}")
        if all(abs(x - 1) <= TOLERANCE for x in error_rounds(r, model)):
            every_round += 1
    errors = [abs(r["median"] / r["predicted"][model] - 1) for r in held]
    return {"rows": len(held), "within": len(held) - len(off), "every_round": every_round,
            "off": off, "worst": max(errors, default=0.0), "median_error": median(errors)
            if errors else 0.0}
