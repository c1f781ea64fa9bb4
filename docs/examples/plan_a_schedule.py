"""The pure Python API (no torch.distributed, no GPU): build, validate, simulate, draw, select.

    .venv/bin/python docs/examples/plan_a_schedule.py
"""

from megatron_pp_ext.analysis.render import render_ascii, render_chrome_trace, render_html
from megatron_pp_ext.analysis.select import MiB, select_schedules
from megatron_pp_ext.analysis.simulate import CostModel, simulate
from megatron_pp_ext.schedules.validate import peak_activations, validate_schedule
from megatron_pp_ext.ir import Action, Schedule, ScheduleError
from megatron_pp_ext.schedules import REGISTRY, build_schedule

# A registered schedule: a pure function (p, m, v, options) -> Schedule, validated on the way out.
schedule = build_schedule("zb-h1", 4, 8)
print(schedule.name, schedule.num_ranks, schedule.num_stages, schedule.chunks)  # zb-h1 4 4 1
print(" ".join(schedule.text()[3][:6]))              # rank 3 starts: 3F0 3I0 3F1 3I1 3F2 3I2
print(peak_activations(schedule))                     # [4, 4, 4, 4]
print(REGISTRY["zb-v"].constraints)                   # what a builder demands, in words

# Predict it under a cost model (per action of one stage; t_b defaults to t_i + t_w).
timeline = simulate(schedule, CostModel(t_f=1.0, t_i=1.0, t_w=0.5, t_comm=0.1))
print(f"makespan {timeline.makespan:.1f} t, bubble {100 * timeline.bubble_fraction:.1f}%")
print(render_ascii(timeline))
html = render_html([timeline], title="zb-h1")          # one self-contained page
trace = render_chrome_trace(timeline)                  # dict with "traceEvents"

# Schedules are data: CSV / JSON in and out, checked by the same validator.
again = Schedule.from_csv(schedule.to_csv(), name="mine")
validate_schedule(again)
broken = Schedule.from_csv("0F0,0B0,0F1,0B1\n1F0,1F1,1B0,1B1\n", name="broken")
try:
    validate_schedule(broken)
except ScheduleError as error:
    print("rejected:", error)
print(Action.parse("5I2"))                           # stage 5, input-gradient half, microbatch 2

# Rank every schedule for these costs under a per-rank activation budget.
selection = select_schedules(4, 8, CostModel(t_f=1, t_i=1, t_w=1),
                             activation_bytes=64 * MiB, memory_budget_bytes=320 * MiB)
best = selection.ranked[0]
print(f"best: {best.name} v={best.chunks} makespan {best.makespan} bubble {best.bubble:.3f}")
for left_out in selection.excluded:
    print("excluded:", left_out.name, left_out.chunks, left_out.reason)
