"""The HTML timelines as a person sees them: rendered by a real browser (Debian's chromium,
headless), screenshotted, and measured in pixels.

scripts/test.sh installs chromium when /usr/bin/chromium is missing (``apt-get install -y
chromium``, as root). Without it these tests fail, saying so: a browser check that did not
run is not a pass.
"""

import os
import shutil
import struct
import subprocess
import zlib
from pathlib import Path

import pytest

from megatron_pp_ext.analysis.render import render_html
from megatron_pp_ext.analysis.simulate import CostModel, simulate
from megatron_pp_ext.schedules import build_schedule

BROWSER_TIMEOUT_S = 120
F_RGB = (0x4E, 0x79, 0xA7)  # render._COLOURS["F"]
B_RGB = (0x59, 0xA1, 0x4F)  # render._COLOURS["B"]
LANE_RGB = [F_RGB, B_RGB, (0xE9, 0xE9, 0xE9), (0xDD, 0xDD, 0xDD), (0x99, 0x99, 0x99)]  # + idle,
# and the hatching's two greys (render._IDLE_FILL, render._COMM_HATCH)


def chromium() -> str:
    path = os.environ.get("CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
    if not Path(path).exists():
        pytest.fail(f"no chromium at {path}: the HTML timelines are checked in a headless "
                    "browser. Install it with `apt-get update && apt-get install -y chromium` "
                    "(as root; bash scripts/test.sh does this) or set $CHROMIUM to a Chromium "
                    "binary")
    return path


def screenshot(page: Path, png: Path, tmp_path: Path, width: int = 1300,
               height: int = 1000) -> None:
    """Load ``page`` in headless chromium and write a ``width`` x ``height`` screenshot."""
    profile = tmp_path / "chromium-profile"
    command = [
        chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
        "--no-first-run", "--disable-background-networking", "--disable-component-update",
        "--disable-sync", f"--user-data-dir={profile}", "--hide-scrollbars",
        "--force-device-scale-factor=1", f"--screenshot={png}",
        f"--window-size={width},{height}", page.resolve().as_uri(),
    ]
    try:
        proc = subprocess.run(command, capture_output=True, text=True,
                              timeout=BROWSER_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"chromium took more than {BROWSER_TIMEOUT_S} s to screenshot {page}")
    assert png.exists() and png.stat().st_size > 0, (
        f"chromium wrote no screenshot (exit {proc.returncode}): {proc.stderr[-2000:]}")


def read_png(path: Path) -> tuple[int, int, list[bytes], int]:
    """(width, height, rows of raw pixel bytes, bytes per pixel) of an 8-bit RGB or RGBA,
    non-interlaced PNG (what chromium writes): chunks, zlib, and the five row filters."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    pos, idat, header = 8, [], None
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + length]
        pos += 12 + length
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat.append(body)
        elif kind == b"IEND":
            break
    width, height, depth, colour, _, _, interlace = header
    assert depth == 8 and colour in (2, 6) and interlace == 0, header
    bpp = 3 if colour == 2 else 4
    raw, stride = zlib.decompress(b"".join(idat)), width * bpp
    rows, prev = [], bytearray(stride)
    for y in range(height):
        kind = raw[y * (stride + 1)]
        line = bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        if kind == 1:  # Sub
            for i in range(bpp, stride):
                line[i] = (line[i] + line[i - bpp]) & 255
        elif kind == 2:  # Up
            line = bytearray((a + b) & 255 for a, b in zip(line, prev))
        elif kind == 3:  # Average
            for i in range(stride):
                left = line[i - bpp] if i >= bpp else 0
                line[i] = (line[i] + ((left + prev[i]) >> 1)) & 255
        elif kind == 4:  # Paeth
            for i in range(stride):
                a = line[i - bpp] if i >= bpp else 0
                b, c = prev[i], (prev[i - bpp] if i >= bpp else 0)
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        rows.append(bytes(line))
        prev = line
    return width, height, rows, bpp


def xs_of(row: bytes, bpp: int, rgb: tuple[int, int, int]) -> list[int]:
    """The x of every pixel in ``row`` that is exactly ``rgb``."""
    want = bytes(rgb)
    return [x for x in range(len(row) // bpp) if row[x * bpp:x * bpp + 3] == want]


def lane_bands(rows: list[bytes], bpp: int, min_pixels: int = 200) -> list[range]:
    """Runs of screen rows with at least ``min_pixels`` pixels in the lanes' exact colours
    (actions, the idle background, the comm-wait hatching): the rank lanes, top to bottom.
    Text (antialiased) and the legend's 12-pixel keys do not come close."""
    bands, start, colours = [], None, {bytes(rgb) for rgb in LANE_RGB}
    for y, row in enumerate(rows + [b""]):
        hit = bool(row) and sum(row[i:i + 3] in colours
                                for i in range(0, len(row), bpp)) >= min_pixels
        if hit and start is None:
            start = y
        elif not hit and start is not None:
            bands.append(range(start, y))
            start = None
    return bands


def test_predicted_and_measured_share_one_scale_in_a_browser(tmp_path):
    """A measured 1F1B step 45% longer than predicted is drawn 45% longer: in the screenshot,
    rank 0's lane (first forward to last backward) of the measured timeline is 1.45 times as
    wide as the predicted one's, to 2%."""
    schedule = build_schedule("1f1b", 4, 8)
    predicted = simulate(schedule, CostModel(t_f=0.010, t_b=0.020, t_comm=0.001))
    measured = simulate(schedule, CostModel(t_f=0.0145, t_b=0.029, t_comm=0.00145))
    predicted.unit = measured.unit = "s"
    measured.source = "measured"
    ratio = measured.makespan / predicted.makespan
    assert ratio == pytest.approx(1.45)

    page = tmp_path / "timeline.html"
    page.write_text(render_html([measured, predicted], title="1f1b: predicted and measured"))
    png = tmp_path / "timeline.png"
    screenshot(page, png, tmp_path)
    width, height, rows, bpp = read_png(png)
    assert (width, height) == (1300, 1000)

    bands = lane_bands(rows, bpp)
    assert len(bands) == 8, f"expected 4 lanes per timeline, found bands at {bands}"
    widths = []
    for band in (bands[0], bands[4]):  # rank 0 of predicted (drawn first), then of measured
        row = rows[band.start + 2]  # above the labels' text
        first_f, last_b = min(xs_of(row, bpp, F_RGB)), max(xs_of(row, bpp, B_RGB))
        widths.append(last_b - first_f + 1)
    drawn = widths[1] / widths[0]
    assert drawn == pytest.approx(ratio, rel=0.02), (
        f"the measured step is {ratio:.3f}x the predicted but drawn {drawn:.3f}x "
        f"({widths[1]} px against {widths[0]} px)")
    assert widths[1] == pytest.approx(1100, abs=3)  # the longest step fills the plot


def test_aggregated_page_draws_every_rank_in_a_browser(tmp_path):
    """p=64, m=512 (aggregated view): a lane per rank, each as wide as the step."""
    timeline = simulate(build_schedule("1f1b", 64, 512), CostModel())
    page = tmp_path / "big.html"
    text = render_html([timeline], title="1f1b p=64 m=512")
    assert "aggregated view" in text
    page.write_text(text)
    png = tmp_path / "big.png"
    screenshot(page, png, tmp_path, height=2000)
    _, _, rows, bpp = read_png(png)
    bands = lane_bands(rows, bpp)
    assert len(bands) == 64, f"expected a lane per rank, found {len(bands)}: {bands}"
    assert all(len(band) == 22 for band in bands), bands  # a lane is 22 px high
    # the makespan is 1725 t; every rank's backwards end at or before it, rank 0's last
    last = [max(xs_of(rows[band.start + band.__len__() // 2], bpp, B_RGB)) for band in bands]
    first_f = min(xs_of(rows[bands[0].start], bpp, F_RGB))
    assert last[0] - first_f + 1 == pytest.approx(1100, abs=3)
    assert all(x <= last[0] for x in last)
