"""Task data is re-hashed at use: an edited cached file (one ARC answerKey changed) is refused before anything is
scored, with the file and both hashes named; an intact file is hashed once a process."""
from __future__ import annotations

import shutil

import pytest

from pipeline.eval import taskdata
from pipeline.eval.taskdata import TASKS, TaskDataCorrupt, TaskDataMissing


def _cached_copy(name: str, tmp_path, monkeypatch):
    spec = TASKS.get(name)
    try:
        real = taskdata.data_file(spec)
    except TaskDataMissing as e:
        pytest.skip(str(e))
    monkeypatch.setenv("COMPRESS_TASKDATA_DIR", str(tmp_path / "cache"))
    copy = tmp_path / "cache" / taskdata.VERSION / spec.member
    copy.parent.mkdir(parents=True)
    shutil.copyfile(real, copy)
    return spec, copy


def _job(spec, path) -> dict:
    return {"task": spec.name, "include": "unused.yaml", "data_file": str(path), "sha256": spec.sha256,
            "split": spec.split, "items": spec.items, "metric": spec.metric, "format": spec.format}


def test_an_edited_answer_key_is_refused_at_use(tmp_path, monkeypatch):
    from pipeline.eval.tasks import score_model

    spec, copy = _cached_copy("arc_easy_test", tmp_path, monkeypatch)
    assert taskdata.data_file(spec, verify=True) == copy  # intact: accepted
    text = copy.read_text()
    first = text.index('"answerKey": "') + len('"answerKey": "')
    wrong = "B" if text[first] != "B" else "C"
    copy.write_text(text[:first] + wrong + text[first + 1:])  # one answer key changed, same size
    with pytest.raises(TaskDataCorrupt) as e:
        taskdata.data_file(spec, verify=True)
    got = taskdata.sha256_file(copy)
    assert str(copy) in str(e.value) and spec.sha256 in str(e.value) and got in str(e.value)
    assert "pipeline.eval.taskdata fetch" in str(e.value)
    with pytest.raises(TaskDataCorrupt, match=spec.sha256):  # the scorer refuses before it touches a model
        score_model(None, None, [_job(spec, copy)], {"batch_size": 1}, tmp_path, "cpu")


def test_an_edited_arrow_file_is_refused(tmp_path, monkeypatch):
    pa = pytest.importorskip("pyarrow")
    spec, copy = _cached_copy("arc_easy", tmp_path, monkeypatch)
    table = pa.ipc.open_stream(copy.read_bytes()).read_all()  # from memory: the file is rewritten below
    keys = table.column("answerKey").to_pylist()
    keys[0] = "B" if keys[0] != "B" else "C"
    table = table.set_column(table.schema.get_field_index("answerKey"), "answerKey", pa.array(keys))
    with pa.OSFile(str(copy), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    with pytest.raises(TaskDataCorrupt, match="arc_easy"):
        taskdata.verify_job(_job(spec, copy))


def test_verified_once_a_process_per_file_version(tmp_path, monkeypatch):
    spec, copy = _cached_copy("arc_challenge", tmp_path, monkeypatch)
    calls = []
    real = taskdata.sha256_file
    monkeypatch.setattr(taskdata, "sha256_file", lambda p: calls.append(p) or real(p))
    monkeypatch.setattr(taskdata, "_VERIFIED", {})
    for _ in range(3):
        taskdata.verify_job(_job(spec, copy))
    assert len(calls) == 1
    data = bytearray(copy.read_bytes())
    data[len(data) // 2] ^= 1
    copy.write_bytes(bytes(data))  # edited: a new version, hashed again and refused
    with pytest.raises(TaskDataCorrupt):
        taskdata.verify_job(_job(spec, copy))
    assert len(calls) == 2
    taskdata.verify_job({"task": "local", "data_file": str(copy)})  # no pin (a test's local file): read as is
