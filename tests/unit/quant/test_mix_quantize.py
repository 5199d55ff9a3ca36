"""A [quantize.mix] GPTQ variant end to end on the tiny random Llama: sensitivity measured (two estimators, cached
by identity), allocation within the budget, GPTQModel's per-module `dynamic` overrides in the checkpoint, the
checkpoint reloaded (GPTQModel: transformers' loader refuses per-module bits) and matching the in-memory model."""
from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import pytest
import torch
from pydantic import TypeAdapter

from pipeline.base.env import tame
from pipeline.eval.bits import linear_bits_per_weight
from pipeline.quant.api import implementation, quantize_variant
from pipeline.quant.checkpoint import load_checkpoint
from pipeline.quant.gptqmodel_driver import inference_model
from pipeline.quant.mix.config import mix_units
from pipeline.quant.mix.plan import CACHE_DIR
from pipeline.quant.mix.sensitivity import Solver, fake_quantize, mean_kl
from pipeline.quant.registry import QuantVariant
from pipeline.quant.shapes import linear_shapes_from_config
from tests.tiny_models import tiny_llama

tame()
VOCAB = 512
CALIB = torch.randint(0, VOCAB, (8, 64), generator=torch.Generator().manual_seed(0))
PROBE = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
MIX = {"budget": {"bits_per_weight": 4.5}, "bits": [2, 3, 4, 8], "group_sizes": [32, 64], "probe_rows": 4,
       "hessian_rows": 8}


def make(name: str, **mix):
    return TypeAdapter(QuantVariant).validate_python(
        {"name": name, "method": "gptq", "bits": 4, "group_size": 64, "mse": 0.0, "mix": {**MIX, **mix}})


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return tiny_llama(tmp_path_factory.mktemp("tiny-llama"), VOCAB)


@pytest.fixture(scope="module")
def mixed(tiny, tmp_path_factory):
    """(folder, metrics, in-memory logits) of the mixed variant, quantized through the method's module."""
    root = tmp_path_factory.mktemp("quantize")
    v = make("mixed")
    impl, out = implementation(v), root / "mixed"
    out.mkdir()
    with impl.session(out):
        model = impl.quantize(tiny, v, CALIB, sys.stderr, "cpu")
        details = impl.save(model, tiny, out, v)
        with torch.no_grad():
            logits = inference_model(model)(PROBE).logits.float()
    return out, details, logits


def test_the_allocation_keeps_the_budget_and_the_checkpoint_measures_what_it_spent(mixed, tiny):
    out, details, _ = mixed
    mix = details["mix"]
    assert mix["spent"]["bytes"] <= mix["budget"]["bytes"]
    assert mix["spent"]["bits_per_weight"] <= 4.5
    assert linear_bits_per_weight(out) == pytest.approx(mix["spent"]["bits_per_weight"], abs=1e-3)
    chosen = {(a["bits"], a["group_size"]) for a in mix["allocation"].values()}
    assert len(chosen) > 1, f"a budget between the candidates should mix them: {mix['allocation']}"
    record = json.loads((out / "mix.json").read_text())
    assert set(record["sensitivity"]) >= {"kl", "hessian", "time_s", "key"}
    assert record["sensitivity"]["time_s"]["kl"] > 0 and record["sensitivity"]["time_s"]["hessian"] > 0


def test_the_checkpoint_holds_each_modules_bits(mixed):
    from safetensors import safe_open

    out, details, _ = mixed
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["dynamic"], "the per-module overrides are in the checkpoint's config"
    arch = linear_shapes_from_config(json.loads((out / "config.json").read_text()))
    with safe_open(out / "model.safetensors", "pt") as f:
        for unit in mix_units(arch, ["lm_head"], "block"):
            a = details["mix"]["allocation"][unit.name]
            for name, in_f, _ in unit.modules:
                assert f.get_slice(f"{name}.qweight").get_shape()[0] == in_f * a["bits"] // 32, name
                groups = in_f // a["group_size"]
                assert f.get_slice(f"{name}.scales").get_shape()[0] == groups, name


def test_the_checkpoint_reloads_with_per_module_bits_and_matches_in_memory(mixed):
    from gptqmodel.nn_modules.qlinear import BaseQuantLinear

    out, details, in_memory = mixed
    model = load_checkpoint(out)
    bits = {n.split("model.", 1)[1].rsplit(".", 1)[0]: (m.bits, m.group_size) for n, m in model.named_modules()
            if isinstance(m, BaseQuantLinear)}
    for unit, a in details["mix"]["allocation"].items():
        assert {v for k, v in bits.items() if k == unit} <= {(a["bits"], a["group_size"])}
        assert any(k == unit for k in bits), unit
    with torch.no_grad():
        reloaded = model(PROBE).logits.float()
    assert (reloaded - in_memory).abs().max().item() < 5e-2  # GPTQModel's CPU kernels round to bfloat16


def test_transformers_own_loader_refuses_per_module_bits(mixed):
    """Recorded, not hidden: optimum builds every module with the base bits (hence load_own)."""
    from transformers import AutoModelForCausalLM

    with pytest.raises(Exception, match="mismatched|size"):
        AutoModelForCausalLM.from_pretrained(mixed[0])


def test_the_sensitivity_table_is_cached_by_model_and_calibration(tiny, tmp_path):
    log = logging.getLogger("test")
    a = quantize_variant(tiny, make("a", budget={"bits_per_weight": 4.0}), CALIB, tmp_path / "a", log, 0, "cpu")
    b = quantize_variant(tiny, make("b", budget={"bits_per_weight": 3.5}), CALIB, tmp_path / "b", log, 0, "cpu")
    assert not a["mix"]["sensitivity_cached"] and b["mix"]["sensitivity_cached"]
    assert len(list((tmp_path / CACHE_DIR).glob("*.json"))) == 1
    other = CALIB.roll(1, dims=1)
    c = quantize_variant(tiny, make("c", budget={"bits_per_weight": 3.5}), other, tmp_path / "c", log, 0, "cpu")
    assert not c["mix"]["sensitivity_cached"]  # another calibration set: measured again
    assert len(list((tmp_path / CACHE_DIR).glob("*.json"))) == 2
    assert a["mix"]["spent"]["bits_per_weight"] > b["mix"]["spent"]["bits_per_weight"]


def test_fake_quantize_is_gptqmodels_rtn_grid(tiny, tmp_path):
    """The probe's RTN weights equal what GPTQModel's RTN writes (dequantized), module by module."""
    from transformers import AutoModelForCausalLM

    from pipeline.quant.gptqmodel_driver import dequantize_to_linear

    v = TypeAdapter(QuantVariant).validate_python({"name": "r", "method": "rtn", "bits": 3, "group_size": 32})
    impl = implementation(v)
    (tmp_path / "r").mkdir()
    with impl.session(tmp_path / "r"):
        model = inference_model(impl.quantize(tiny, v, None, sys.stderr, "cpu"))
    dequantize_to_linear(model)
    base = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    name = "model.layers.1.mlp.down_proj"
    ours = fake_quantize(base.get_submodule(name).weight.data, 3, 32)
    theirs = model.get_submodule(name).weight.data
    assert (ours - theirs).abs().max().item() < 1e-2 * ours.abs().max().item()


def test_mean_kl_is_zero_for_the_same_distribution_and_positive_otherwise():
    logits = torch.randn(5, 11)
    ref = torch.log_softmax(logits, -1)
    assert mean_kl(ref, logits) == pytest.approx(0.0, abs=1e-6)
    assert mean_kl(ref, logits + torch.randn(5, 11)) > 0.01


def test_replaying_the_layers_before_a_unit_gives_the_full_forwards_logits(tiny):
    from transformers import AutoModelForCausalLM

    from pipeline.quant.mix.sensitivity import _layer_outputs, _logits, _logits_from

    model = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    layers = model.get_submodule("model.layers")
    outputs = _layer_outputs(layers, model, CALIB[:2])
    m = model.get_submodule("model.layers.1.mlp.up_proj")
    m.weight.data.copy_(fake_quantize(m.weight.data, 2, 32))  # a unit of layer 1 quantized
    full = _logits(model, CALIB[:2])
    assert torch.allclose(_logits_from(model, layers, 1, outputs, CALIB[:2]), full, atol=1e-5)
    assert all(type(layers[j]).__name__ == "LlamaDecoderLayer" for j in range(2))  # restored
    assert mean_kl(torch.log_softmax(full, -1), _logits(model, CALIB[:2])) == pytest.approx(0.0, abs=1e-6)


@pytest.mark.parametrize("granularity", ["module", "fused", "block"])
def test_unit_hessians_equal_the_all_at_once_pass_to_the_bit(tiny, granularity):
    """UnitHessians (a unit's linears at a time, its layer run on the kept outputs of the layers before, the layers
    after not run) gives input_hessians' X^T X exactly, for every unit; nothing is left swapped or hooked."""
    from transformers import AutoModelForCausalLM

    from pipeline.quant.mix.sensitivity import UnitHessians, input_hessians

    model = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    units = mix_units(linear_shapes_from_config(json.loads((tiny / "config.json").read_text())), [], granularity)
    names = [n for u in units for n, _, _ in u.modules]
    every, tokens = input_hessians(model, CALIB[:3], names)
    per_unit = UnitHessians(model, CALIB[:3], "model.layers")
    assert per_unit.tokens == tokens
    for u in units:
        got = per_unit.of(u)
        assert sorted(got) == sorted(n for n, _, _ in u.modules)
        assert all(torch.equal(got[n], every[n]) for n in got), u.name
    layers = model.get_submodule("model.layers")
    assert all(type(layer).__name__ == "LlamaDecoderLayer" and not layer._forward_hooks for layer in layers)
    assert not any(m._forward_hooks for m in model.modules())


def test_kl_scaled_probes_one_group_size_and_scales_the_others_by_their_hessian_ratio(tiny):
    """estimator = "kl-scaled": the probed column equals the full KL probe's; every other group size is that KL times
    the unit's own Hessian error ratio at the same bits; fewer forward passes; the cache keys differ."""
    from pipeline.quant.mix.sensitivity import cache_key, measure

    arch = linear_shapes_from_config(json.loads((tiny / "config.json").read_text()))
    units = mix_units(arch, ["lm_head"], "module")
    cands = make("k").mix.candidates(64)
    assert make("k", estimator="kl-scaled").mix.probe_group_size(64) == 64 and make("k").mix.probe_group_size(64) is None
    lines: list[str] = []
    full = measure(tiny, CALIB, units, cands, 2, 4, Solver(), arch.layers, None, lambda s: None)
    scaled = measure(tiny, CALIB, units, cands, 2, 4, Solver(), arch.layers, None, lines.append, 64)
    assert scaled["hessian"] == full["hessian"]
    assert f"({len(units) * 4 + 1} forward passes)" in lines[-1]  # 4 bits at g64, not 8 candidates
    for u in range(len(units)):
        for j, (b, g) in enumerate(cands):
            ref = cands.index((b, 64))
            want = full["kl"][u][ref] * (1 if g == 64 else full["hessian"][u][j] / full["hessian"][u][ref])
            assert scaled["kl"][u][j] == pytest.approx(want, rel=1e-5)
    # the scaled entries are estimates, not copies: at equal bits g32 is predicted better than g64
    assert all(scaled["kl"][u][cands.index((3, 32))] < scaled["kl"][u][cands.index((3, 64))] for u in range(len(units)))
    assert "scaled by the Hessian error ratio" in scaled["probe"]["kl_probed"]
    k = (tiny, CALIB, units, cands, (2, 4), Solver())
    assert cache_key(*k) != cache_key(*k, 64)
    # the same calibration bytes in another shape are other rows: another table (#42)
    reshaped = CALIB.reshape(CALIB.shape[0] // 2, -1) if CALIB.shape[0] % 2 == 0 else CALIB.reshape(1, -1)
    assert cache_key(tiny, reshaped, *k[2:]) != cache_key(*k)


def test_gptq_probe_weights_are_the_checkpoints_where_no_error_feeds_back(tiny, tmp_path):
    """probe_weights = "gptq": layer 0's q_proj sees the unquantized embeddings in GPTQ's sequential pass too, so the
    probe's solve on the same calibration rows gives the weights GPTQModel writes; the Hessian error of the GPTQ
    weights is below RTN's (the objective GPTQ minimises); the cache key tells the two apart."""
    from transformers import AutoModelForCausalLM

    from pipeline.quant.gptqmodel_driver import dequantize_to_linear
    from pipeline.quant.mix.sensitivity import Weights, cache_key, hessian_root, input_hessians, measure

    v = TypeAdapter(QuantVariant).validate_python({"name": "g", "method": "gptq", "bits": 4, "group_size": 32,
                                                   "mse": 0.0})
    impl = implementation(v)
    (tmp_path / "g").mkdir()
    with impl.session(tmp_path / "g"):
        model = inference_model(impl.quantize(tiny, v, CALIB, sys.stderr, "cpu"))
    dequantize_to_linear(model)
    base = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    name = "model.layers.0.self_attn.q_proj"
    hess, _ = input_hessians(base, CALIB, [name])
    solver = Solver("gptq", damp_percent=v.damp_percent, act_group_aware=True)
    w = base.get_submodule(name).weight.data
    ours = Weights(solver, hess, set())(name, w, 4, 32)
    theirs = model.get_submodule(name).weight.data.float()
    step = (w.abs().amax() * 2 / 15).item()  # about one 4-bit step
    assert (ours - theirs).abs().max().item() < 0.05 * step, "the probe's GPTQ solve is the checkpoint's"
    r = hessian_root(hess[name])
    assert torch.allclose(r.T @ r, hess[name], rtol=1e-3, atol=1e-3 * hess[name].abs().max().item())

    arch = linear_shapes_from_config(json.loads((tiny / "config.json").read_text()))
    units = mix_units(arch, ["lm_head"], "module")
    cands = [(3, 32), (4, 32)]
    rtn = measure(tiny, CALIB, units, cands, 2, 8, Solver(), arch.layers, None, lambda s: None)
    lines: list[str] = []
    gptq = measure(tiny, CALIB, units, cands, 2, 8, solver, arch.layers, None, lines.append)
    assert sum(map(sum, gptq["hessian"])) < 0.9 * sum(map(sum, rtn["hessian"]))
    assert sum(map(sum, gptq["kl"])) < sum(map(sum, rtn["kl"]))
    assert any("GPTQ solves" in line for line in lines) and gptq["probe"]["weights"].startswith("GPTQModel's GPTQ solve")
    k = (tiny, CALIB, units, cands, (2, 8))
    assert cache_key(*k, Solver()) != cache_key(*k, solver)
    assert cache_key(*k, solver) != cache_key(*k, Solver("gptq", damp_percent=0.1))
