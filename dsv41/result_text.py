"""Text of a benchmark result row, shared by the terminal table (`dsv41.bench`) and the HTML report
(`dsv41.compiler.html`). A top-level module with no dsv41 imports, so both layers can read it cheaply."""

from __future__ import annotations

__all__ = ["fp32_err_text"]


def fp32_err_text(row: dict) -> str:
    """A result row's `logit_err_vs_fp32` for a table: "-" when missing, else e.g. "3.10e-03 (1.02x eager)" (the
    ratio only where `logit_err_vs_fp32_over_eager` is set)."""
    err, ratio = row.get("logit_err_vs_fp32"), row.get("logit_err_vs_fp32_over_eager")
    if err is None:
        return "-"
    return f"{err:.2e}" + (f" ({ratio:.2f}x eager)" if ratio is not None else "")
