"""The cross-step figure alone, on the emulated device (``bench.emulated_device``): its own
command, so that the device model does not import the report (which imports the calibration,
which imports the device model)."""

from __future__ import annotations

from bench.emulated_device import CROSS_STEP, labelled_schedule, run


def cross_step_main(argv=None) -> int:
    """``python -m bench.cross_step``: the cross-step figure alone (p=4, m=8 by default):
    1f1b, zb-h2 and zb-v single steps, back to back with nothing in the optimizer step, and
    back to back with clipping and loss scaling emulated (sync / post-validated); writes
    ``bench/results/cross_step.json`` and ``.md`` and prints the table."""
    import argparse
    import json
    from pathlib import Path

    parser = argparse.ArgumentParser(description=cross_step_main.__doc__)
    parser.add_argument("-p", type=int, default=4)
    parser.add_argument("-m", type=int, default=8)
    parser.add_argument("--t", type=float, default=0.020)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--b2b-reps", type=int, default=3)
    # 8: run ahead, the ranks' offsets take a few steps to settle; over 4 steps the ramp
    # counted (zb-h2 run ahead 0.76-0.79 of 1F1B over 4 steps, 0.74 over 8)
    parser.add_argument("--k-steps", type=int, default=8)
    parser.add_argument("--niceness", type=int, default=-20)
    parser.add_argument("--rollback-steps", default="2",
                        help="comma-separated steps (of --k-steps) whose norm is above the clip; "
                        "'' for none")
    parser.add_argument("--out", default="bench/results/cross_step")
    args = parser.parse_args(argv)
    rollbacks = tuple(int(x) for x in args.rollback_steps.split(",") if x.strip())
    from bench import provenance

    prov = provenance.current(argv)  # before the run: a later edit would not be measured
    tree = run(args.p, (args.m,), t=args.t, reps=args.reps, back_to_back_ms=(args.m,),
               k_steps=args.k_steps, b2b_reps=args.b2b_reps, megatron=False,
               niceness=args.niceness, only=tuple(CROSS_STEP), rollback_steps=rollbacks,
               timeline_labels=("zb-h2", "zb-v w=2p-1"))
    from bench.report import cross_step_table
    from bench.time_breakdown import breakdown_table

    text = "\n".join(cross_step_table([tree]))
    text += f"\n\nRun: {provenance.short(prov)}\n"
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    timelines = tree.pop("cross_timelines", [])
    if timelines:
        from megatron_pp_ext.analysis.render import render_html

        html_path = out.parent / (out.name + "_timeline.html")
        html_path.write_text(render_html(
            timelines, title=f"Consecutive steps, p={args.p}, m={args.m}: Megatron's step "
            "against run-ahead post-validation (measured, emulated device)"))
        text += f"\nTimelines: {html_path}"
        traced = []
        for timeline in timelines:
            label, mode = timeline.schedule.split(f" x{args.k_steps} back to back, ")
            if mode == "run-ahead":  # sync: the optimizer event holds the blocking reductions
                traced.append((label, mode, timeline, labelled_schedule(label, args.p, args.m)))
        text += ("\n\n#### Where each rank's time goes (the traced run-ahead round, steps 2 "
                 f"to {args.k_steps - 1})\n\n`bench/time_breakdown.py`: *device busy* is the "
                 "actions and the optimizer step, *waiting* the waits on a peer, *host between "
                 "actions* the rest of the rank's time (posting each message over gloo, the "
                 "executor's bookkeeping), which the emulated device puts on its timeline.\n\n")
        text += "\n".join(breakdown_table(traced, args.k_steps))
    out.with_suffix(".json").write_text(json.dumps(tree, indent=1, default=str))
    out.with_suffix(".md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(cross_step_main())
