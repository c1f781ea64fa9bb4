"""Renderers (ASCII grid, HTML page, Chrome trace) and the command line."""

import json
import re
from dataclasses import replace
from pathlib import Path

import pytest

from support.cli_run import cli_in_process

from megatron_pp_ext.analysis.render import render_ascii, render_chrome_trace, render_html
from megatron_pp_ext.analysis.simulate import CostModel, simulate
from megatron_pp_ext.schedules import build_schedule
from megatron_pp_ext.timeline import COMM_WAIT, P2P, Event, Timeline

PEER_CSV = Path(__file__).parent / "data" / "torch_zb1p_2rank_2stagep_compute.csv"
ONE_F_ONE_B = simulate(build_schedule("1f1b", 4, 8), CostModel(t_f=1, t_b=1))


def measured_copy(timeline: Timeline, seconds_per_t: float = 0.01) -> Timeline:
    """A stand-in for a traced run: the same events, in seconds."""
    events = [replace(e, start=e.start * seconds_per_t, end=e.end * seconds_per_t)
              for e in timeline.events]
    return replace(timeline, events=events, source="measured", unit="s")


def stretched(timeline: Timeline, factor: float, source: str = "measured") -> Timeline:
    """The same events, every time times ``factor``."""
    events = [replace(e, start=e.start * factor, end=e.end * factor) for e in timeline.events]
    return replace(timeline, events=events, source=source)


def with_p2p() -> Timeline:
    """A hand-made 2-rank 1F1B step (p=2, m=2) with its P2P batches, as the NCCL-rules
    simulation reports them: a batch in flight on a rank's stream beside its compute."""
    events = [
        Event(0, "0F0", 0, 1), Event(0, "#0 send_forward", 1, 2, P2P), Event(0, "0F1", 1, 2),
        Event(0, "#1 send_forward_recv_backward", 2, 5, P2P),
        Event(0, "wait batch #1", 2, 5, COMM_WAIT), Event(0, "0B0", 5, 7), Event(0, "0B1", 7, 9),
        Event(1, "#0 recv_forward", 0, 2, P2P), Event(1, "wait batch #0", 0, 2, COMM_WAIT),
        Event(1, "1F0", 2, 3), Event(1, "1B0", 3, 5),
        Event(1, "#1 send_backward_recv_forward", 5, 6, P2P), Event(1, "1F1", 6, 7),
        Event(1, "1B1", 7, 9),
    ]
    return Timeline("1f1b", 2, 2, 1, events=events, peak_activations=[2, 1])


# ---------------------------------------------------------------- ASCII
def test_ascii_grid_is_the_1f1b_table():
    lines = render_ascii(ONE_F_ONE_B).splitlines()
    assert lines[0] == "1f1b p=4 m=8 v=1 (predicted); one cell = 1 t"
    assert lines[1] == ("r0 |0F0 0F1 0F2 0F3 .   .   .   0B0 0F4 0B1 0F5 0B2 0F6 0B3 0F7 0B4 .   "
                        "0B5 .   0B6 .   0B7")
    assert lines[4] == ("r3 |.   .   .   3F0 3B0 3F1 3B1 3F2 3B2 3F3 3B3 3F4 3B4 3F5 3B5 3F6 3B6 "
                        "3F7 3B7 .   .   .  ")
    assert lines[-1] == "makespan=22 bubble=27.27% peak activations per rank: [4, 3, 2, 1]"
    assert len(lines) == 6


def test_ascii_longer_actions_span_cells():
    text = render_ascii(simulate(build_schedule("1f1b", 2, 2), CostModel(t_f=1, t_b=2)))
    assert text.splitlines()[1] == "r0 |0F0 0F1 .   .   0B0---- .   0B1----"
    assert text.splitlines()[2] == "r1 |.   1F0 1B0---- 1F1 1B1---- .   .  "


def test_ascii_scales_uneven_times():
    timeline = simulate(build_schedule("1f1b", 4, 8), CostModel(t_comm=0.1))
    lines = render_ascii(timeline).splitlines()  # 0.1 t messages: off the unit grid
    assert lines[0].endswith("one column = 0.216 t")  # 34.6 t over the default 160 columns
    assert all(len(line) == len("r0 |") + 160 for line in lines[1:5])
    assert lines[1].startswith("r0 |0F0- 0F1 0F2- 0F3 ....")
    narrow = render_ascii(timeline, width=100).splitlines()  # too narrow for labels: kinds
    assert narrow[1].startswith("r0 |FFFFFFFFFFFF....") and len(narrow[1]) == 104
    assert lines[-1].startswith("makespan=34.6 bubble=30.64%")


def test_ascii_measured_timeline_scales_and_shows_seconds():
    text = render_ascii(measured_copy(ONE_F_ONE_B), width=80)
    assert "(measured); one column =" in text
    assert re.search(r"makespan=0\.\d+s bubble=", text.splitlines()[-1])


def test_ascii_draws_p2p_rows():
    lines = render_ascii(with_p2p()).splitlines()
    assert lines[1:6] == [
        "r0     |0F0 0F1 .   .   .   0B0---- 0B1----",
        "r0 p2p |.   === =========== .   .   .   .  ",
        "r1     |.   .   1F0 1B0---- .   1F1 1B1----",
        "r1 p2p |======= .   .   .   === .   .   .  ",
        "p2p rows: = a P2P batch in flight on the rank's communication stream (beside its "
        "compute)",
    ]
    scaled = render_ascii(with_p2p(), width=18).splitlines()
    assert scaled[2] == "r0 p2p |..========........"  # 2 columns per t: 1 to 2, 2 to 5
    assert scaled[-1].startswith("makespan=9 bubble=")


# ---------------------------------------------------------------- HTML
def test_html_is_one_self_contained_page():
    page = render_html([measured_copy(ONE_F_ONE_B), ONE_F_ONE_B], title="1F1B <p=4>")
    assert page.startswith("<!DOCTYPE html>") and page.rstrip().endswith("</html>")
    assert "<title>1F1B &lt;p=4&gt;</title>" in page
    for external in ("<script", "<link", "src=", 'href="http', "@import"):
        assert external not in page
    # predicted above measured, whatever the order given
    assert page.index("1f1b — predicted") < page.index("1f1b — measured")
    assert page.count("<svg") == 2 and page.count(">rank 3</text>") == 2
    assert "<title>0B0 (rank 0): 7 to 8 t (1 t)</title>" in page  # predicted: cost units
    assert "<title>0B0 (rank 0): 70 to 80 ms (10 ms)</title>" in page  # measured: seconds, in ms
    assert 'rect.F{fill:#4e79a7}' in page and 'fill="url(#hatch0)"' in page
    # rank 0: busy 16, waits 6 (3 before 0B0, 1 before each of 0B5..0B7), idle 6, peak 4
    assert "<td>0</td><td>16</td><td>6</td><td>6</td><td>4</td>" in page
    assert "<td>3</td><td>16</td><td>3</td><td>6</td><td>1</td>" in page
    assert "bubble 27.27%" in page


def _idle_widths(page: str) -> list[float]:
    """The width of each timeline's rank-0 lane (its plain idle background spans the step)."""
    return [float(w) for w in re.findall(r'<rect class="idle" x="\d+" y="0" width="([\d.]+)"',
                                         page)]


def test_html_predicted_and_measured_on_one_scale():
    predicted = replace(ONE_F_ONE_B, unit="s")  # 22 "seconds"
    measured = stretched(predicted, 1.45)
    page = render_html([measured, predicted])
    narrow, wide = _idle_widths(page)  # predicted first
    assert wide == pytest.approx(1100, abs=0.01) and wide / narrow == pytest.approx(1.45)
    assert page.count(">time (ms)</text>") == 2 and "time (t)" not in page
    assert page.count(f"drawn at {1100 / 31900:.4g} px per ms") == 2  # 1100 px, 31900 ms
    assert "end of step: 31900 ms" in page and "end of step: 22000 ms" in page
    assert "mixes time units" not in page
    # tooltips and tables in ms
    assert "<title>0F1 (rank 0): 1450 to 2900 ms (1450 ms)</title>" in page
    assert "<th>busy (ms)</th>" in page and "makespan 31900 ms, bubble 27.27%" in page


def test_html_axis_in_cost_units_and_mixed_units_said():
    page = render_html([ONE_F_ONE_B])
    assert ">time (t)</text>" in page and "ms" not in re.sub(r"<style>.*?</style>", "", page)
    assert re.search(r'<text class="tick" x="[\d.]+" y="\d+" text-anchor="middle">20</text>',
                     page)
    mixed = render_html([ONE_F_ONE_B, measured_copy(stretched(ONE_F_ONE_B, 0.5, "predicted"))])
    assert "This page mixes time units: cost-model units t, milliseconds" in mixed
    assert ">time (t)</text>" in mixed and ">time (ms)</text>" in mixed
    # each unit on its own scale: the longest (only) timeline of each unit fills the plot
    assert _idle_widths(mixed) == [pytest.approx(1100, abs=0.01)] * 2


def test_html_legend_names_every_colour_and_p2p_rows():
    page = render_html([with_p2p()])
    svg = "".join(re.findall(r"<svg.*?</svg>", page, re.S))
    used = set()
    for classes in re.findall(r'<rect class="([^"]+)"', svg):
        used.update(c for c in classes.split() if c != "a")
    if re.search(r'<rect fill="url\(#hatch\d+\)"', svg):
        used.add("comm")
    assert used == {"F", "B", "idle", "p2p", "comm"}
    legend = re.search(r'<p class="legend">(.*?)</p>', page).group(1)
    for key in used:
        assert f'<span class="key {key}"></span>' in legend, key
    assert "I" not in re.findall(r'class="key (\w+)"', legend)  # no entry for what is not drawn
    assert "idle: nothing runs" in legend and "P2P batch in flight" in legend
    assert ">rank 0 p2p</text>" in page and ">rank 1 p2p</text>" in page
    # rank 1's P2P row lies under its compute lane: rank 1 starts at 22 + 4 + 7 + 4 = 37 px
    assert ('<rect class="a p2p" x="84.00" y="63" width="244.44" height="7"><title>#0 recv_forward '
            "(rank 1): 0 to 2 t (2 t)</title></rect>") in page
    assert "<th>p2p in flight (t)</th>" in page


def test_html_aggregates_large_timelines():
    timeline = simulate(build_schedule("zb-h1", 64, 256), CostModel())  # 50k events
    full = render_html([timeline], aggregate=False)
    summary = render_html([timeline])  # more than AGGREGATE_EVENTS: aggregated
    assert "aggregated view of" in summary and "aggregated view" not in full
    assert len(summary) < len(full) / 20
    assert _idle_widths(summary) == _idle_widths(full)  # the same scale either way
    # a stretch's tooltip says what share of it each kind took, in the timeline's unit
    assert re.search(r"<g><title>rank 0, 0 to [\d.]+ t: F 100%, idle 0%</title>", summary)


# ---------------------------------------------------------------- Chrome trace
def test_chrome_trace_events():
    trace = render_chrome_trace(ONE_F_ONE_B)
    json.dumps(trace)  # serialisable
    events = trace["traceEvents"]
    names = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert names == {0: "rank 0", 1: "rank 1", 2: "rank 2", 3: "rank 3"}
    b0 = next(e for e in events if e["name"] == "0B0")
    assert (b0["ph"], b0["pid"], b0["tid"], b0["ts"], b0["dur"], b0["cat"]) == (
        "X", 0, 0, 7000.0, 1000.0, "B")
    waits = [e for e in events if e.get("cat") == "comm_wait"]
    assert waits and all(e["ph"] == "X" for e in waits)
    assert sum(1 for e in events if e["ph"] == "X" and e["cat"] != "comm_wait") == 64


def test_chrome_trace_seconds_to_microseconds():
    trace = render_chrome_trace(measured_copy(ONE_F_ONE_B))
    f1 = next(e for e in trace["traceEvents"] if e["name"] == "0F1")
    assert f1["ts"] == pytest.approx(10000.0) and f1["dur"] == pytest.approx(10000.0)
    assert f1["args"]["unit"] == "ms" and f1["args"]["start"] == pytest.approx(10.0)
    assert trace["displayTimeUnit"] == "ms" and trace["otherData"]["time_unit"] == "s"
    process = next(e for e in trace["traceEvents"] if e["name"] == "process_name")
    assert process["args"]["name"] == "1f1b (measured)"


def test_chrome_trace_cost_units_are_not_called_ms():
    """Chrome's format has only wall-clock time (ts in us; displayTimeUnit "ms" or "ns"): cost
    units keep 1 t at 1000 us, and the name, the args and otherData say they are t."""
    trace = render_chrome_trace(ONE_F_ONE_B)
    assert trace["displayTimeUnit"] in ("ms", "ns")
    process = next(e for e in trace["traceEvents"] if e["name"] == "process_name")
    assert "in cost units t" in process["args"]["name"]
    assert "not milliseconds" in process["args"]["name"]
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {e["args"]["unit"] for e in spans} == {"t"}
    b0 = next(e for e in spans if e["name"] == "0B0")
    assert (b0["args"]["start"], b0["args"]["end"], b0["args"]["duration"]) == (7, 8, 1)
    assert trace["otherData"]["time_unit"] == "t" and "not wall-clock" in trace["otherData"]["note"]


def test_chrome_trace_p2p_threads():
    trace = render_chrome_trace(with_p2p())
    names = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"]
             if e["name"] == "thread_name"}
    assert names == {0: "rank 0", 1: "rank 1", 2: "rank 0 p2p", 3: "rank 1 p2p"}
    order = {e["tid"]: e["args"]["sort_index"] for e in trace["traceEvents"]
             if e["name"] == "thread_sort_index"}
    assert sorted(order, key=order.get) == [0, 2, 1, 3]  # each P2P row under its rank
    p2p = [e for e in trace["traceEvents"] if e.get("cat") == "p2p"]
    assert [(e["tid"], e["ts"], e["dur"]) for e in p2p] == [
        (2, 1000.0, 1000.0), (2, 2000.0, 3000.0), (3, 0.0, 2000.0), (3, 5000.0, 1000.0)]


# ---------------------------------------------------------------- command line
def cli(*args, check_rc=None):
    """The command in this process (support.cli_run: what it prints and returns)."""
    result = cli_in_process(*args)
    if check_rc is not None:
        assert result.returncode == check_rc, result.stderr
    return result


def assert_one_line_error(result, fragment):
    assert result.returncode == 2
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert fragment in lines[0], lines[0]
    assert "Traceback" not in result.stderr


def test_cli_simulate_ascii():
    out = cli("simulate", "--schedule", "1f1b", "--ranks", "4", "--microbatches", "8",
              "--t-f", "1", "--t-b", "1", check_rc=0).stdout.splitlines()
    assert out[1].startswith("r0 |0F0 0F1 0F2 0F3 .   .   .   0B0")
    assert out[-1] == "makespan=22 bubble=27.27% peak activations per rank: [4, 3, 2, 1]"


def test_cli_simulate_json_with_stage_costs():
    out = cli("simulate", "--schedule", "1f1b", "-p", "4", "-m", "8", "--t-f", "1,1,2,1",
              "--format", "json", check_rc=0).stdout
    data = json.loads(out)
    assert {"schedule", "ranks", "microbatches", "chunks", "makespan", "bubble_fraction",
            "peak_activations", "actions"} <= set(data)
    assert (data["schedule"], data["ranks"], data["microbatches"], data["chunks"]) == (
        "1f1b", 4, 8, 1)
    assert data["peak_activations"] == [4, 3, 2, 1]
    assert data["actions"][0][:5] == ["0F0", "0F1", "0F2", "0F3", "0B0"]
    # stage 2's forward costs 2, so rank 2 paces the pipeline: it starts at 2, is busy
    # 8 x (2 + 2) = 32, waits 1 for 3B0 and 1 for 3B7, then 1B7 and 0B7 take 2 each
    busy = [r["busy"] for r in data["per_rank"]]
    assert busy == [24, 24, 32, 24]
    assert data["makespan"] == 2 + 32 + 1 + 1 + 2 + 2


def test_cli_simulate_html_and_chrome_to_files(tmp_path):
    html_file, trace_file = tmp_path / "t.html", tmp_path / "t.json"
    cli("simulate", "--schedule", "interleaved", "-p", "4", "-m", "8", "-v", "2",
        "--format", "html", "--out", str(html_file), check_rc=0)
    assert "interleaved — predicted (p=4, m=8, v=2)" in html_file.read_text()
    cli("simulate", "--schedule", "gpipe", "-p", "2", "-m", "3", "--format", "chrome",
        "--out", str(trace_file), check_rc=0)
    trace = json.loads(trace_file.read_text())
    assert sum(1 for e in trace["traceEvents"] if e["ph"] == "X" and e["cat"] == "F") == 6


def test_cli_simulate_html_at_p64_m512_is_small(tmp_path):
    """29 MB of sub-pixel actions before; the aggregated view keeps it under 3 MB."""
    page = tmp_path / "big.html"
    out = cli("simulate", "--schedule", "1f1b", "-p", "64", "-m", "512", "--format", "html",
              "--out", str(page), check_rc=0).stdout
    assert f"wrote {page}" in out
    assert page.stat().st_size < 3_000_000
    text = page.read_text()
    assert "aggregated view of" in text and text.count(">rank 63</text>") == 1


def test_cli_simulate_loads_csv_and_json(tmp_path):
    schedule = build_schedule("1f1b", 3, 4)
    (tmp_path / "s.csv").write_text(schedule.to_csv())
    (tmp_path / "s.json").write_text(schedule.to_json())
    for name in ("s.csv", "s.json"):
        data = json.loads(cli("simulate", "--csv", str(tmp_path / name), "--format", "json",
                              check_rc=0).stdout)
        assert data["actions"] == schedule.text() and data["peak_activations"] == [3, 2, 1]


def test_cli_peer_csv_simulates_and_fails_pair_matching():
    assert_one_line_error(cli("simulate", "--csv", str(PEER_CSV), "--channels", "pair"),
                          "ranks 0 and 1 disagree on the order of their messages")
    out = cli("simulate", "--csv", str(PEER_CSV), check_rc=0).stdout
    assert out.splitlines()[-2:] == [  # a v=2 schedule: each chunk costs half a rank's share
        "makespan=24.5 bubble=2.04% peak activations per rank: [4, 4]",
        "peak activations per rank: [4, 4] chunk-activations (1/2 of a rank's layers each) = "
        "[2, 2] in v=1 units (one microbatch, all of a rank's layers)"]


def test_cli_errors_are_one_line(tmp_path):
    assert_one_line_error(cli("simulate", "--csv", str(tmp_path / "missing.csv")),
                          "cannot read schedule file")
    broken = tmp_path / "broken.csv"
    broken.write_text("0F0,0B0,0F1\n1F0,1B0,1F1,1B1\n")
    assert_one_line_error(cli("simulate", "--csv", str(broken)), "rank 0 is missing 0B1")
    garbage = tmp_path / "garbage.csv"
    garbage.write_text("0F0,hello\n")
    assert_one_line_error(cli("simulate", "--csv", str(garbage)), "cannot load cell 'hello'")
    assert_one_line_error(cli("simulate", "--schedule", "1fb", "-p", "4", "-m", "8"),
                          "unknown schedule '1fb'")
    assert_one_line_error(cli("simulate", "--schedule", "interleaved", "-p", "4", "-m", "8",
                              "-v", "1"), "chunks v=1 is not allowed")
    assert_one_line_error(cli("simulate", "--schedule", "1f1b", "-p", "4"),
                          "needs --ranks P and --microbatches M")
    assert_one_line_error(cli("simulate", "--schedule", "1f1b", "-p", "4", "-m", "8",
                              "--t-f", "1,x"), "not a number")
    assert_one_line_error(cli("simulate", "--schedule", "1f1b", "-p", "2", "-m", "2",
                              "--t-f", "1,2,3"), "t_f has 3 values")
    assert_one_line_error(cli("simulate", "--schedule", "1f1b", "-p", "0", "-m", "2"),
                          "p=0 must be an integer >= 1")


def test_cli_demo():
    result = cli("demo", check_rc=0)
    out = result.stdout
    for name in ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2", "zb-v", "dualpipev"):
        assert re.search(rf"^\| {re.escape(name)} +\|", out, re.M), name
    assert re.search(r"^\| 1f1b +\| 27\.27% +\| \[4, 3, 2, 1\] +\|$", out, re.M)
    assert "r3 |.   .   .   3F0 3B0----" in out
