"""Human-readable units for the report's renderers (terminal table, HTML page, plot, run summary)."""

from __future__ import annotations

__all__ = ["human_bytes"]


def human_bytes(n: float | None, digits: int = 2) -> str:
    """`n` bytes as "12.51 MB" (decimal units: GB = 1e9, MB = 1e6, kB = 1e3; `digits` after the point), whole
    bytes below 1 kB, and "-" for None (a count that was not measured)."""
    if n is None:
        return "-"
    n = float(n)
    for unit, div in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.{digits}f} {unit}"
    return f"{n:.0f} B"
