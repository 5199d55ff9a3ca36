"""Inputs by content, not by path: the identity of a local file or folder a unit reads.

    content_id(path) -> sha256 hex   a file's sha256, or a folder's (every file's relative path, size, sha256)

Editing a calibration file or a checkpoint folder in place changes its identity, so the units that read it
rerun; moving it does not. Hashing a multi-GB model folder on every run would be slow, so each file's sha256
is cached in <cache>/compress/content-ids.json under its resolved path with the file's (size, mtime_ns,
ctime_ns, inode): an edit in place changes mtime and ctime, a replaced file changes the inode, and any
change misses the cache and hashes the file again. A file modified in the last RACY_S seconds is hashed but
not cached: within the clock's granularity a second write could leave the same stats behind (git's "racy"
index entries). Torch-free.
"""
from __future__ import annotations

import json
import logging
import os
import time
from hashlib import sha256
from pathlib import Path

from pipeline.base.env import cache_root
from pipeline.base.fileio import atomic_write_json, sha256_file

CACHE_FILE = "content-ids.json"
RACY_S = 2.0
LOG_ABOVE_BYTES = 1 << 28  # say so before hashing a big file (seconds per GB), once per file and edit
log = logging.getLogger("compress")


def cache_path() -> Path:
    return cache_root() / "compress" / CACHE_FILE


def folder_files(folder: Path) -> list[Path]:
    """The files of a folder that identify it: every file below it (symlinks followed, as a loader reads them),
    except hidden ones (.git, .cache/huggingface download metadata)."""
    return sorted(p for p in folder.rglob("*")
                  if p.is_file() and not any(part.startswith(".") for part in p.relative_to(folder).parts))


def content_id(path: Path) -> str:
    """sha256 of a file's bytes, or of a folder's listing of (relative path, size, sha256) for every file."""
    path = Path(path).expanduser()
    cache = _Cache()
    try:
        if path.is_dir():
            listing = [(p.relative_to(path).as_posix(), p.stat().st_size, cache.sha256(p)) for p in folder_files(path)]
            return sha256(json.dumps(listing).encode()).hexdigest()
        return cache.sha256(path)
    finally:
        cache.save()


class _Cache:
    """Per-file sha256 keyed by the file's stats; read once, written back once if anything was added."""

    def __init__(self) -> None:
        self.path, self.changed = cache_path(), False
        try:
            self.entries: dict[str, list] = json.loads(self.path.read_text())
        except (OSError, ValueError):
            self.entries = {}

    def sha256(self, file: Path) -> str:
        key = str(file.resolve())
        st = os.stat(key)
        stats = [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]
        hit = self.entries.get(key)
        if isinstance(hit, list) and hit[:4] == stats:
            return hit[4]
        if st.st_size > LOG_ABOVE_BYTES:
            log.info("hashing %s (%.1f GB) to identify it; cached until the file changes", key, st.st_size / 1e9)
        digest = sha256_file(Path(key))
        if time.time_ns() - st.st_mtime_ns > RACY_S * 1e9 and os.stat(key).st_mtime_ns == st.st_mtime_ns:
            self.entries[key] = stats + [digest]
            self.changed = True
        return digest

    def save(self) -> None:
        if not self.changed:
            return
        live = {k: v for k, v in self.entries.items() if os.path.exists(k)}  # forget files that are gone
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_json(self.path, live)
        except OSError:
            pass  # a read-only cache only costs the hashing again
