"""Formatting shared by report.md, the model cards and the plots: numbers, sizes, tables, the speculative
row labels, the plot file names, and what a published file may say about a local path (only its name).

Nothing here reads a report: renderers pass in the values. No torch, no matplotlib.
"""
from __future__ import annotations

import os
import re
from pathlib import PurePosixPath, PureWindowsPath
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
    """median (min–max) of a summarize() dict."""
    if not isinstance(stats, dict) or stats.get("median") is None:
        return num(stats, digits) if isinstance(stats, (int, float)) else "–"
    return (f"{sig(stats['median'], digits)} ({sig(stats.get('min', 0), digits)}–"
            f"{sig(stats.get('max', 0), digits)})")


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return out + ["| " + " | ".join(str(c).replace("|", "\\|") for c in r) + " |" for r in rows]


def speculative_label(mode: str, verifier: Any) -> str:
    """A speculative row's name, saying what its draft is when it is not the distilled draft itself."""
    if mode.startswith(FP_DISTILLED + " "):
        return f"{mode} (distilled against baseline, verified by {verifier or '?'})"
    return mode


# ---------------------------------------------------------------- local paths in published files
_PREFIX = re.compile(r"^([a-z][a-z0-9+-]{1,15}):(.*)$", re.S)  # gguf:/x, config:/x (not C:\x, not https://)
_WINDOWS_ABS = re.compile(r"^[A-Za-z]:[\\/]")


def _is_abs(path: str) -> bool:
    return path.startswith(("/", "~")) or bool(_WINDOWS_ABS.match(path)) or path.startswith("\\\\")


def _split(value: str) -> tuple[str, str]:
    """("gguf:", "/a/b.gguf") for a prefixed source, ("", value) otherwise."""
    m = _PREFIX.match(value)
    if m and not m.group(2).startswith("//") and not _WINDOWS_ABS.match(value):
        return m.group(1) + ":", m.group(2)
    return "", value


def _name(path: str) -> str:
    kind = PureWindowsPath if ("\\" in path or _WINDOWS_ABS.match(path)) else PurePosixPath
    return kind(path.rstrip("/\\")).name or path


def local_path(value: Any) -> str | None:
    """The absolute local path in a source or dataset value ("gguf:/a/b.gguf", "/a/dir", "~/x"), else None."""
    if not isinstance(value, str):
        return None
    path = _split(value)[1]
    return path if _is_abs(path) else None


def local_name(value: Any) -> str | None:
    """The file (or folder) name of the absolute local path in `value`, else None."""
    path = local_path(value)
    return None if path is None else _name(path)


def public(value: Any) -> Any:
    """`value` as a published file may show it: an absolute local path becomes its file name (prefix kept:
    "gguf:/home/me/m.gguf" -> "gguf:m.gguf"); anything else is returned unchanged."""
    path = local_path(value)
    if path is None:
        return value
    return _split(value)[0] + _name(path)


def public_tree(obj: Any) -> Any:
    """A copy of a TOML/JSON-like tree with every absolute local path (in values and keys) made `public`."""
    if isinstance(obj, dict):
        return {public(k): public_tree(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [public_tree(v) for v in obj]
    return public(obj)


def public_text(text: str, value: Any) -> str:
    """`text` with the absolute local path of `value` (as written, and expanded) replaced by its file name."""
    path = local_path(value)
    if path is None or not text:
        return text
    for p in sorted({path, os.path.expanduser(path), _split(str(value))[0] + path, str(value)}, key=len, reverse=True):
        text = text.replace(p, public(value) if p == str(value) else _name(path))
    return text
