"""What a published file (model card, draft manifest) may say about a local path: only its file name.
Torch-free; used by the renderers and by the draft stage's manifest."""
from __future__ import annotations

import os
import re
from pathlib import PurePosixPath, PureWindowsPath
from typing import Any

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
