"""Human-readable units for the report's renderers (terminal table, HTML page, plot, run summary)."""

from __future__ import annotations

__all__ = ["human_bytes", "fp32_err_text"]


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


def fp32_err_text(row: dict) -> str:
    """A result row's `logit_err_vs_fp32` for a table: "-" when missing, else e.g. "3.10e-03 (1.02x eager)" (the
    ratio only where `logit_err_vs_fp32_over_eager` is set)."""
    err, ratio = row.get("logit_err_vs_fp32"), row.get("logit_err_vs_fp32_over_eager")
    if err is None:
        return "-"
    return f"{err:.2e}" + (f" ({ratio:.2f}x eager)" if ratio is not None else "")
