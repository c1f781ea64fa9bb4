"""Units for people: byte counts in binary units, tables in aligned columns. No torch (the
simulator, the renderers and the runtime all print bytes)."""

from __future__ import annotations


def format_bytes_iec(value: float | None) -> str:
    """Bytes with a binary unit (B, KiB, MiB, GiB, TiB)."""
    if value is None:
        return "-"
    size = float(value)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(size) < 1024 or unit == "GiB":
            break
        size /= 1024
    else:  # pragma: no cover
        unit = "GiB"
    if unit == "B":
        return f"{int(value)} B"
    return f"{size:.1f} {unit}" if size < 100 else f"{size:.0f} {unit}"


def format_bytes_list(values) -> str:
    return "[" + ", ".join(format_bytes_iec(v) for v in values) + "]"


def human_bytes(num: float) -> str:
    """Bytes with a binary unit and two decimals (``21.00 GiB``), as the plan prints them."""
    value = float(num)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    return f"{num} B"


def aligned_columns(rows: list) -> list[str]:
    """Rows of text cells (the header first) as lines, each column as wide as its widest cell,
    two spaces apart."""
    widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
