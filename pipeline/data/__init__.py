"""Text corpora: the shipped registry (calibration/datasets.toml), local files, HF datasets (offline).

    resolve("c4")            -> DatasetRef for a shipped corpus (sha256 verified on read)
    resolve("my.jsonl")      -> a local .txt / .jsonl / .parquet file
    resolve("hf:org/name")   -> a dataset in the local HF datasets cache
    FORMATS                  -> the row readers by format name (wikitext-raw, text, jsonl, parquet, hf): what a
                                local file's suffix or a name's prefix selects, and how its rows are read
    identity(ref)            -> what a stage that reads it depends on (a local file's sha256, not its path)
    documents(ref)           -> list[str]
    eval_text(ref)           -> the GPTQ-protocol evaluation text ("\\n\\n".join(rows))
"""
from __future__ import annotations

import json
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from pipeline.base.errors import RecipeError, StageError
from pipeline.base.fileio import sha256_file
from pipeline.base.identity import content_id
from pipeline.base.registry import Registry

CALIBRATION_DIR = Path(__file__).resolve().parents[2] / "calibration"


@dataclass(frozen=True)
class DatasetRef:
    name: str
    path: Path | None
    format: str  # wikitext-raw | text | jsonl | parquet | hf
    text_field: str = "text"
    sha256: str | None = None
    license: str | None = None
    role: str | None = None

    def describe(self) -> dict:
        return {"name": self.name, "file": str(self.path) if self.path else None, "format": self.format,
                "sha256": self.sha256, "license": self.license}


@lru_cache(maxsize=1)
def shipped() -> Registry[DatasetRef]:
    reg: Registry[DatasetRef] = Registry("dataset")
    table = tomllib.loads((CALIBRATION_DIR / "datasets.toml").read_text())
    for name, d in table.items():
        reg.register(name)(DatasetRef(name, CALIBRATION_DIR / d["file"], d["format"], d.get("text_field", "text"),
                                      d.get("sha256"), d.get("license"), d.get("role")))
    return reg


def resolve(name: str, text_field: str = "text") -> DatasetRef:
    for fmt in PREFIXED_FORMATS:
        if fmt.prefix and name.startswith(fmt.prefix):  # (every PREFIXED_FORMATS entry has one)
            return DatasetRef(name, None, fmt.name, text_field)
    p = Path(name).expanduser()
    if p.suffix in LOCAL_FORMATS:
        if not p.is_file():
            raise RecipeError(f"dataset file not found: {p}")
        return DatasetRef(str(p), p, LOCAL_FORMATS[p.suffix], text_field)
    reg = shipped()
    if name not in reg:
        raise RecipeError(reg.unknown_message(name) + f" (or give a {'/'.join(LOCAL_FORMATS)} path, "
                          + ", ".join(f"or {f.prefix}<id>" for f in PREFIXED_FORMATS) + ")")
    return reg.get(name)


def _verified(ref: DatasetRef) -> Path:
    if ref.path is None or not ref.path.is_file():
        raise StageError(f"dataset {ref.name!r}: file missing: {ref.path}")
    if ref.sha256 and sha256_file(ref.path) != ref.sha256:
        raise StageError(f"dataset {ref.name!r}: {ref.path} does not match its pinned sha256 "
                         "(corrupted or edited copy)")
    return ref.path


def rows(ref: DatasetRef) -> list[str]:
    """The dataset as rows, as its canonical loader gives them (its format's reader, FORMATS)."""
    fmt = FORMATS.get(ref.format) if ref.format in FORMATS else None
    if fmt is not None and fmt.prefix:  # not a file: read by name
        return fmt.read(ref, None)
    path = _verified(ref)
    if fmt is None:
        close = FORMATS.close_matches(ref.format)
        raise StageError(f"dataset {ref.name!r}: unknown format {ref.format!r}"
                         + (f". Did you mean: {', '.join(close)}?" if close else ""))
    return fmt.read(ref, path)


@dataclass(frozen=True)
class Format:
    """How one dataset format is selected and read: a local file's `suffix` or a name's `prefix` (None: only
    named in calibration/datasets.toml) and `read(ref, path)` -> rows (path: the verified file; None for a prefix)."""
    name: str
    read: Callable[[DatasetRef, Path | None], list[str]]
    suffix: str | None = None
    prefix: str | None = None


FORMATS: Registry[Format] = Registry("dataset format")
_ORDER: list[Format] = []  # registration order: the order messages list suffixes in


def _format(name: str, suffix: str | None = None, prefix: str | None = None):
    def add(read: Callable[[DatasetRef, Path | None], list[str]]) -> Callable:
        _ORDER.append(FORMATS.register(name)(Format(name, read, suffix, prefix)))
        return read

    return add


@_format("wikitext-raw")
def _wikitext_raw(ref: DatasetRef, path: Path) -> list[str]:
    # rows as the HF wikitext-2-raw-v1 split gives them: blank lines are empty rows
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    return [line if line.strip() else "" for line in lines]


@_format("text", suffix=".txt")
def _text(ref: DatasetRef, path: Path) -> list[str]:
    return path.read_text(encoding="utf-8").split("\n\n")


@_format("jsonl", suffix=".jsonl")
def _jsonl(ref: DatasetRef, path: Path) -> list[str]:
    out = []
    for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.strip():
            rec = json.loads(line)
            if ref.text_field not in rec:
                raise StageError(f"{path}:{i}: no field {ref.text_field!r} (fields: {sorted(rec)})")
            out.append(str(rec[ref.text_field]))
    return out


@_format("parquet", suffix=".parquet")
def _parquet(ref: DatasetRef, path: Path) -> list[str]:
    # late: one input format's reader; `compress check` imports this module
    import pyarrow.parquet as pq

    table = pq.read_table(path)
    if ref.text_field not in table.column_names:
        raise StageError(f"{path}: no column {ref.text_field!r} (columns: {table.column_names})")
    return [str(x) for x in table.column(ref.text_field).to_pylist()]


@_format("hf", prefix="hf:")
def _hf_rows(ref: DatasetRef, path: None = None) -> list[str]:
    # late: one input format's reader; `compress check` imports this module
    import datasets

    repo, _, split = ref.name[3:].partition("@")
    try:
        ds = datasets.load_dataset(repo, split=split or "train", download_mode="reuse_cache_if_exists")
    except Exception as e:  # datasets raises many types for "not cached and offline"
        raise StageError(f"dataset {ref.name!r} could not be loaded from the local cache (offline): "
                         f"{type(e).__name__}: {str(e).splitlines()[0][:200]}") from None
    if ref.text_field not in ds.column_names:
        raise StageError(f"dataset {ref.name!r}: no column {ref.text_field!r} (columns: {ds.column_names})")
    return [str(x) for x in ds[ref.text_field]]


LOCAL_FORMATS = {f.suffix: f.name for f in _ORDER if f.suffix}  # {".txt": "text", ".jsonl": "jsonl", ...}
PREFIXED_FORMATS = [f for f in _ORDER if f.prefix]  # hf:


def documents(ref: DatasetRef) -> list[str]:
    """Non-empty documents (for calibration and distillation)."""
    return [r for r in rows(ref) if r.strip()]


def eval_text(ref: DatasetRef) -> str:
    """GPTQ-paper evaluation text: the rows joined by a blank line."""
    return "\n\n".join(rows(ref))


def fingerprint(ref: DatasetRef) -> str | None:
    """sha256 of the data file (None for HF-cache datasets), cached by the file's stats (pipeline/base/identity.py)."""
    return content_id(ref.path) if ref.path is not None and ref.path.is_file() else None


def identity(ref: DatasetRef) -> dict:
    """What a unit that reads this dataset depends on: its content, not where it lies. A shipped corpus is
    its pinned sha256 (verified when read); a local file is hashed, so an edit in place changes it; an hf:
    dataset is its name only (the cached copy is not hashed)."""
    return {"format": ref.format, "text_field": ref.text_field, "license": ref.license,
            "sha256": ref.sha256 or fingerprint(ref), "hf": ref.name if ref.format == "hf" else None}
