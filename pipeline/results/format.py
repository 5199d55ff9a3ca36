"""Formatting shared by report.md, the model cards and the plots: numbers, sizes, tables, the speculative
row labels, the plot file names. (What a published file may say about a local path: pipeline/base/public.py.)

Nothing here reads a report: renderers pass in the values. No torch, no matplotlib.
"""
from __future__ import annotations

from typing import Any

PLOTS = {
    "frontier": "ppl_vs_size.png",
    "decode": "decode_tokens_per_s.png",
    "acceptance": "acceptance_by_position.png",
}
FP_DISTILLED = "fp-distilled"  # prefix of the rows of the draft distilled against the full-precision model


# ---------------------------------------------------------------- numbers and tables
def sig(v: float, digits: int) -> str:
    """`digits` significant digits, without an exponent for large numbers (47,345 not 4.735e+04)."""
    if abs(v) >= 10**digits:
        return f"{v:,.0f}"
    return f"{v:.{digits}g}"


def num(v: Any, digits: int = 4) -> str:
    if v is None:
        return "–"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, (int, float)):
        return sig(v, digits) if isinstance(v, float) else f"{v:,}"
    return str(v)


def size(v: Any) -> str:
    if not isinstance(v, (int, float)):
        return "–"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if v >= scale:
            return f"{v / scale:.3g} {unit}"
    return f"{int(v)} B"


def spread(stats: Any, digits: int = 3) -> str:
    """median (min–max) of a timing summary (pipeline/results/metrics.py Stat)."""
    if getattr(stats, "median", None) is None:
        return num(stats, digits) if isinstance(stats, (int, float)) else "–"
    return f"{sig(stats.median, digits)} ({sig(stats.given('min', 0), digits)}–{sig(stats.given('max', 0), digits)})"


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return out + ["| " + " | ".join(str(c).replace("|", "\\|") for c in r) + " |" for r in rows]


def speculative_label(mode: str, verifier: Any) -> str:
    """A speculative row's name, saying what its draft is when it is not the distilled draft itself."""
    if mode.startswith(FP_DISTILLED + " "):
        return f"{mode} (distilled against baseline, verified by {verifier or '?'})"
    return mode
