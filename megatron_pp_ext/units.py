"""Units for people: byte counts in binary units. No torch (the simulator, the renderers and
the runtime all print bytes)."""

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
