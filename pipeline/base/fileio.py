"""The one home of file identity and atomic writes: every file compress writes in place goes through
`atomic_path` (a temporary name beside it, renamed over it only when complete), and every sha256 of a
file is `sha256_file`."""
from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


@contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """Yield a temporary path beside `path`; on success it replaces `path` in one rename, on any error it
    is removed, so `path` is either its old content or the complete new one, never half written."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}{path.suffix}")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def atomic_write_text(path: Path, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def atomic_write_json(path: Path, data: Any) -> None:
    atomic_write_text(path, json.dumps(data, indent=2, default=str) + "\n")


def drop_none(obj: Any) -> Any:
    """A JSON-like tree without its None values (TOML has no null)."""
    if isinstance(obj, dict):
        return {k: drop_none(v) for k, v in obj.items() if v is not None}
    if isinstance(obj, list):
        return [drop_none(v) for v in obj]
    return obj


def canonical_safetensors(path: Path) -> bool:
    """Rewrite a .safetensors file's header with its `__metadata__` keys sorted; the tensors' bytes, their entries and
    every value stay as they are. safetensors serializes the metadata from a hash map, whose order changes from
    process to process: a writer with many metadata keys (torchao: one per tensor) writes different bytes for the
    same checkpoint each run. Returns whether the file changed."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
        meta = header.get("__metadata__")
        if not meta or list(meta) == sorted(meta):
            return False
        header["__metadata__"] = dict(sorted(meta.items()))
        text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
        text += b" " * (-len(text) % 8)  # the format aligns the data section to 8 bytes with trailing spaces
        with atomic_path(path) as tmp, open(tmp, "wb") as out:
            out.write(len(text).to_bytes(8, "little") + text)
            while chunk := f.read(1 << 24):
                out.write(chunk)
    return True
