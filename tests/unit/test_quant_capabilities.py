"""Declared capabilities and the checks `compress check` runs before any weight loads (torch-free)."""
from __future__ import annotations

import subprocess
import sys

import pytest
from pydantic import TypeAdapter, ValidationError

from pipeline.base.errors import RecipeError
from pipeline.quant.registry import METHODS, check_variant, needs_calibration, runtimes
from pipeline.quant.shapes import linear_shapes_from_config
from pipeline.quant.registry import QuantVariant
from tests.problems import keys, only

# SmolLM2-135M's config.json (the fields that matter)
SMOL = {"model_type": "llama", "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
        "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152, "tie_word_embeddings": True}
# a Llama shaped for Marlin: every in-feature a multiple of 128
WIDE = dict(SMOL, hidden_size=1024, intermediate_size=2816, num_attention_heads=16, num_key_value_heads=4)


def variant(**kw):
    return TypeAdapter(QuantVariant).validate_python(kw)


@pytest.fixture(scope="module")
def smol():
    return linear_shapes_from_config(SMOL)


def test_linear_shapes_of_a_llama_config(smol):
    assert smol.shapes_known
    assert smol.linear_in_features["self_attn.q_proj"] == 576
    assert smol.linear_in_features["mlp.down_proj"] == 1536
    assert smol.linear_out_features["self_attn.k_proj"] == 3 * 64  # kv heads x head_dim
    assert linear_shapes_from_config({"model_type": "gpt2", "hidden_size": 8}).shapes_known is False


def test_group_size_that_does_not_divide_hidden_size_is_rejected_with_a_suggestion(smol):
    p = only(check_variant(variant(name="w4", method="gptq", group_size=128), smol, "cpu"))
    assert (p.path, p.code) == ("group_size", "group-size-does-not-tile")
    assert "hidden size 576" in p.message and "group_size = 64 or 32" in p.message  # the size and the suggestion
    assert "self_attn.q_proj" in p.message and "mlp.down_proj" not in p.message  # 1536 = 12 x 128 is fine
    assert check_variant(variant(name="w4", method="gptq", group_size=64), smol, "cpu") == []
    rtn = only(check_variant(variant(name="w4", method="rtn", group_size=128), smol, "cpu"))
    assert rtn.message == p.message.replace("gptq", "rtn") and rtn.code == p.code


def test_group_size_outside_the_declared_set_is_rejected(smol):
    p = only(check_variant(variant(name="w4", method="gptq", group_size=48), smol, "cpu"))
    assert (p.path, p.code) == ("group_size", "group-size-unsupported") and "use 64 or 32" in p.message


def test_skipped_modules_are_left_out_of_the_group_size_check(smol):
    only_down = ["lm_head", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                 "mlp.gate_proj", "mlp.up_proj"]
    assert check_variant(variant(name="d", method="gptq", group_size=512, modules_to_skip=only_down), smol, "cpu") == []


def test_unsupported_bits_are_rejected(smol):
    p = only(check_variant(variant(name="w5", method="gptq", bits=5, group_size=64), smol, "cpu"))
    assert (p.path, p.code) == ("bits", "bits-unsupported") and "(supported: 2, 3, 4, 8)" in p.message


def test_bnb_on_a_device_it_cannot_run_on(smol):
    for method in ("bnb-int8", "bnb-nf4", "bnb-fp4"):
        p = only(check_variant(variant(name="b", method=method), smol, "mps"))
        assert (p.path, p.code) == ("method", "method-device-unsupported")
        assert str(p) == f"{method} cannot run on device 'mps' (it runs on: cpu, cuda)"
        assert check_variant(variant(name="b", method=method), smol, "cpu") == []


def test_unknown_method_says_did_you_mean():
    with pytest.raises(ValidationError, match=r"Unknown quantization method 'gtpq'\. Did you mean: gptq\?"):
        variant(name="a", method="gtpq")
    with pytest.raises(RecipeError, match="Did you mean: bnb-nf4"):
        METHODS.get("bnb-nf5")


def test_unknown_key_and_bad_ranges_fail_validation():
    with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
        variant(name="a", method="gptq", bitz=3)
    with pytest.raises(ValidationError, match="damp_percent"):
        variant(name="a", method="gptq", damp_percent=1.5)
    with pytest.raises(ValidationError, match="name"):
        variant(name="../x", method="rtn")


def test_act_order_options_that_exclude_each_other(smol):
    assert keys(check_variant(variant(name="a", method="gptq", desc_act=True, act_group_aware=True), smol,
                              "cpu")) == [("act_group_aware", "act-group-aware-with-desc-act")]
    assert keys(check_variant(variant(name="a", method="gptq", group_size=-1, act_group_aware=True), smol,
                              "cpu")) == [("act_group_aware", "act-group-aware-needs-groups")]
    assert check_variant(variant(name="a", method="gptq", group_size=-1, bits=8), smol, "cpu") == []


def test_misspelled_module_to_skip(smol):
    p = only(check_variant(variant(name="a", method="bnb-int8", modules_to_skip=["lm_head", "mlp.dwn_proj"]),
                           smol, "cpu"))
    assert (p.path, p.code) == ("modules_to_skip", "modules-to-skip-match-nothing")
    assert "['mlp.dwn_proj']" in p.message  # the entries that match nothing


def test_needs_calibration():
    assert needs_calibration(variant(name="a", method="gptq"))
    assert not any(needs_calibration(variant(name="a", method=m)) for m in ("rtn", "bnb-int8", "bnb-nf4", "bnb-fp4"))


def by_runtime(rows):
    return {r["runtime"]: r for r in rows}


def test_runtimes_vllm_marlin_needs_in_features_divisible_by_128(smol):
    rows = by_runtime(runtimes(variant(name="a", method="gptq", group_size=64), smol))
    assert "fallback" in rows["vLLM (CUDA)"]["kernel"] and "576" in rows["vLLM (CUDA)"]["note"]
    assert rows["transformers (CPU)"]["kernel"].startswith("GPTQModel TorchAtenLinear")
    assert rows["llama.cpp"]["kernel"] == "none"
    wide = by_runtime(runtimes(variant(name="a", method="gptq", group_size=128), linear_shapes_from_config(WIDE)))
    assert wide["vLLM (CUDA)"]["kernel"] == "gptq_marlin"


def test_runtimes_for_bits_marlin_does_not_take(smol):
    rows = by_runtime(runtimes(variant(name="a", method="gptq", bits=3, group_size=64), smol))
    assert rows["vLLM (CUDA)"]["kernel"] == "gptq (ExLlama)"
    assert rows["transformers (CPU)"]["kernel"].startswith("GPTQModel TorchLinear")
    rows = by_runtime(runtimes(variant(name="b", method="bnb-nf4"), smol))
    assert rows["GPTQModel"]["kernel"] == "none" and "nf4" in rows["transformers (CPU)"]["kernel"]


def test_config_and_capabilities_import_without_torch():
    code = ("import sys; import pipeline.recipe, pipeline.quant.registry, pipeline.plan; "
            "sys.exit(1 if 'torch' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_architectures_are_data_and_an_unknown_one_is_named():
    from pipeline.model.architecture import missing
    from pipeline.quant.shapes import linear_shapes_from_config, module_names

    cfg = {"model_type": "qwen2", "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
           "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 100}
    arch = linear_shapes_from_config(cfg)
    assert arch.shapes_known and arch.layers == "model.layers"
    assert arch.linear_in_features["self_attn.k_proj"] == 64 and arch.linear_out_features["self_attn.k_proj"] == 32
    assert module_names(arch)[0] == "model.layers.0.self_attn.q_proj" and module_names(arch)[-1] == "lm_head"
    assert arch.architecture.definition.startswith("gptqmodel: definitions/qwen2.py")
    unknown = linear_shapes_from_config({**cfg, "model_type": "nosuchmodel"})
    assert not unknown.shapes_known
    assert "model_type 'nosuchmodel' has no architecture definition" in missing(unknown.architecture)


def test_methods_of_one_checkpoint_format_share_their_load_facts():
    """A checkpoint folder names its format, not its method (config.json quant_method): registry.by_format picks
    any method of that format for the reload hook and load facts, so they must agree."""
    from pipeline.quant.registry import by_format

    for name in METHODS:
        m, chosen = METHODS.get(name), by_format(METHODS.get(name).checkpoint_format)
        for attr in ("before_load", "after_load"):
            assert getattr(type(m), attr) is getattr(type(chosen), attr), (name, attr)
        assert (m.load_module, m.repacked_on_cpu) == (chosen.load_module, chosen.repacked_on_cpu), name
    assert by_format(None) is None and by_format("unknown-format") is None
