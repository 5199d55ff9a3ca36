"""Calibration coverage per expert (issue #41): the counting maths on tiny tensors, the hooks on tiny random MoE models
built from transformers' own config classes (tests/fixtures/arch), the min_expert_tokens gate (a model whose router
never picks one expert fails it, naming the layer and expert; moe_all_experts passes it), what report.md and the card
say, and what `compress check` refuses."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from pipeline.eval.config import GatesConfig
from pipeline.quant.coverage import expert_token_counts, measure, top_k_counts
from pipeline.model.architecture import architecture_of
from pipeline.recipe import load_recipe
from pipeline.results.coverage_render import coverage_line, coverage_section
from pipeline.results.gates import evaluate_gates
from pipeline.results.schema import Report
from pipeline.stages.calibrate import expert_coverage
from tests.problems import keys, refused
from tests.unit.test_arch_check import recipe, variant

ARCH = Path(__file__).resolve().parents[1] / "fixtures" / "arch"
RUN = {"name": "t", "recipe": "r.toml", "started": "now", "device": "cpu", "seed": 0}


def tiny(model_type: str):
    d = json.loads((ARCH / f"{model_type}.json").read_text())
    torch.manual_seed(0)
    cfg = AutoConfig.for_model(d.pop("model_type"), **d)
    return AutoModelForCausalLM.from_config(cfg).eval(), architecture_of(json.loads((ARCH / f"{model_type}.json")
                                                                                    .read_text()))


def rows(n=4, seq=32):
    return torch.randint(3, 49152, (n, seq), generator=torch.Generator().manual_seed(1))


# ---------------------------------------------------------------- the pure core
def test_counts_each_token_once_per_chosen_expert_and_skips_the_expert_parallel_mask():
    idx = torch.tensor([[0, 2], [2, 1], [0, 2], [4, 2]])  # 4 = num_experts: transformers' "not a local expert"
    assert expert_token_counts(idx, 4).tolist() == [2, 1, 4, 0]
    assert expert_token_counts(idx.reshape(2, 2, 2), 4).tolist() == [2, 1, 4, 0]  # any leading shape


def test_top_k_of_router_logits():
    logits = torch.tensor([[0.1, 2.0, 1.0, -3.0], [5.0, 0.0, 1.0, 0.5]])
    assert top_k_counts(logits, 2).tolist() == [1, 1, 2, 0]
    assert top_k_counts(logits.softmax(-1), 2).tolist() == [1, 1, 2, 0]  # softmax keeps the order


# ---------------------------------------------------------------- the hooks
@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral", "olmoe", "granitemoe", "gpt_oss", "deepseek_v3"])
def test_hooks_count_what_each_block_routed(model_type):
    model, arch = tiny(model_type)
    ids = rows()
    cov = measure(model, ids, arch)
    moe_layers = [i for i in range(2) if i not in arch.experts.dense_layers]
    assert cov["layers"] == moe_layers and cov["num_experts"] == 4 and cov["top_k"] == 2
    assert all(sum(row) == ids.numel() * 2 for row in cov["counts"])  # top-2: every token twice
    assert measure(model, ids, arch, batch_rows=4)["counts"] == cov["counts"]


def test_hooks_agree_with_the_router_logits_of_a_softmax_then_top_k_router():
    model, arch = tiny("qwen3_moe")
    ids = rows()
    logits: dict[int, list] = {0: [], 1: []}
    handles = [model.model.layers[i].mlp.gate.register_forward_hook(
        lambda m, a, out, i=i: logits[i].append(out[0])) for i in (0, 1)]
    with torch.no_grad():
        model(input_ids=ids, use_cache=False)
    for h in handles:
        h.remove()
    assert measure(model, ids, arch)["counts"] == [top_k_counts(torch.cat(logits[i]), 2).tolist() for i in (0, 1)]


def never_expert_3(model):
    """gpt_oss routers have a bias: -1e4 on expert 3 keeps it out of every token's top-2."""
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.router.bias[3] = -1e4
    return model


def starved_report(tmp_path, **params) -> Report:
    model, _ = tiny("gpt_oss")
    never_expert_3(model).save_pretrained(tmp_path / "load")
    ids = rows()
    cov = expert_coverage(tmp_path / "load", ids, "cpu")  # the calibrate stage's wrapper, from the load folder
    assert cov is not None and [row[3] for row in cov["counts"]] == [0, 0]
    variant_params = {"name": "w4", "method": "gptq", **params}
    return Report.model_validate({"run": RUN, "calibration": {"num_samples": 4, "seq_len": 32,
                                                              "expert_coverage": cov},
                                  "variants": {"w4": {"method": "gptq", "params": variant_params},
                                               "rtn": {"method": "rtn", "params": {"name": "rtn", "method": "rtn"}}}})


def test_an_expert_no_token_reached_fails_the_gate_naming_layer_and_expert(tmp_path):
    report = starved_report(tmp_path)
    [g] = evaluate_gates(report, GatesConfig(min_expert_tokens=1, min_smoke_ok=0))  # rtn reads no calibration
    assert (g.model, g.gate, g.value, g.passed) == ("w4", "min_expert_tokens", 0.0, False)
    assert g.reason == "layer 0: expert 3 got 0 token(s); layer 1: expert 3 got 0 token(s)"
    line = coverage_line(report, report.variants["w4"])
    assert line == ("calibration coverage: 2 of 4 experts x 2 MoE layer(s) got no calibration token (layer 0: "
                    "expert 3; layer 1: expert 3); their quantization had no data from them")
    text = "\n".join(coverage_section(report))
    assert "## Calibration coverage per expert" in text and "| 0 |" in text and "**0**" in text


def test_all_expert_calibration_passes_the_gate_and_says_so(tmp_path):
    report = starved_report(tmp_path, moe_all_experts=True, calibration_rows=2)
    [g] = evaluate_gates(report, GatesConfig(min_expert_tokens=64, min_smoke_ok=0))
    assert g.passed and g.value == 64.0  # 2 rows x 32 tokens, every expert
    assert g.reason == ("moe_all_experts: every expert of the 2 MoE layer(s) calibrated on all 64 calibration tokens "
                        "(routed, the fewest would be 0)")
    assert "calibrated on all 64 calibration tokens (moe_all_experts" in coverage_line(report, report.variants["w4"])


def test_a_variant_reading_fewer_rows_is_told_the_counts_are_an_upper_bound():
    cov = {"tokens": 64, "num_experts": 2, "top_k": 1, "layers": [0], "counts": [[40, 24]]}
    report = Report.model_validate({"run": RUN, "calibration": {"num_samples": 2, "seq_len": 32,
                                                                "expert_coverage": cov},
                                    "variants": {"w4": {"params": {"name": "w4", "method": "gptq",
                                                                   "calibration_rows": 1}}}})
    [g] = evaluate_gates(report, GatesConfig(min_expert_tokens=8, min_smoke_ok=0))
    assert g.passed and "reads the first 1 (calibration_rows)" in g.reason


def test_the_gate_without_coverage_in_the_report_fails_with_a_reason():
    report = Report.model_validate({"run": RUN, "calibration": {"num_samples": 2},
                                    "variants": {"w4": {"params": {"name": "w4", "method": "awq"}}}})
    [g] = evaluate_gates(report, GatesConfig(min_expert_tokens=1, min_smoke_ok=0))
    assert not g.passed and "calibration.expert_coverage is not in the report" in g.reason


def test_a_dense_model_measures_nothing(tmp_path):
    model, _ = tiny("llama")
    model.save_pretrained(tmp_path)
    assert expert_coverage(tmp_path, rows(), "cpu") is None


# ---------------------------------------------------------------- compress check
def test_check_refuses_the_gate_and_the_option_on_a_dense_model(tmp_path):
    recipe(tmp_path, f"config:{ARCH / 'llama.json'}", variant("w4", "gptq", moe_all_experts=True))
    path = tmp_path / "r.toml"
    path.write_text(path.read_text() + "\n[validate.gates]\nmin_expert_tokens = 1\n")
    found = refused(load_recipe(path))
    assert ("validate.gates.min_expert_tokens", "moe-gate-on-dense-model") in keys(found)
    assert ("quantize[0].moe_all_experts", "moe-all-experts-unsupported") in keys(found)
    msgs = {p.code: p.message for p in found}
    assert msgs["moe-gate-on-dense-model"] == (
        "[validate.gates].min_expert_tokens counts the calibration tokens routed to each expert, but model_type "
        "'llama' is not a Mixture-of-Experts model (no experts); drop min_expert_tokens")
    assert msgs["moe-all-experts-unsupported"] == (
        "quantize.0 (w4): moe_all_experts = true: model_type 'llama' is not a Mixture-of-Experts model (no experts "
        "to route); drop it")


def test_check_refuses_all_expert_calibration_for_a_method_whose_library_has_none(tmp_path):
    from pipeline.plan import check

    ok = recipe(tmp_path, f"config:{ARCH / 'qwen3_moe.json'}",
                variant("w4", "gptq", moe_all_experts=True) + variant("a4", "awq", moe_all_experts=True))
    check(ok)
    r = recipe(tmp_path, f"config:{ARCH / 'qwen3_moe.json'}", variant("ar", "autoround", moe_all_experts=True))
    found = [p for p in refused(r) if p.code == "moe-all-experts-unsupported"]
    assert [p.message for p in found] == [
        "quantize.0 (ar): moe_all_experts = true: method 'autoround' (auto_round) has no all-expert calibration "
        "option; it is GPTQModel's MoE routing (ExpertsRoutingOverride), taken by gptq and awq; drop it"]


# ---------------------------------------------------------------- the driver
def test_the_option_is_gptqmodels_routing_override_and_is_checked_in_its_log(tmp_path):
    from gptqmodel.quantization.config import ExpertsRoutingOverride

    from pipeline.base.errors import StageError
    from pipeline.quant.gptqmodel_driver import check_all_experts, moe_routing

    assert moe_routing(type("V", (), {"moe_all_experts": False})()) == {}
    routing = moe_routing(type("V", (), {"moe_all_experts": True})())["moe"].routing
    assert isinstance(routing, ExpertsRoutingOverride) and routing.num_experts_per_tok == "all"
    log = tmp_path / "quant_log.csv"
    log.write_text("layer,module,loss,samples,damp,time\n0,self_attn.q_proj,0.1,512,0.05,0.1\n"
                   "0,mlp.experts.0.gate_proj,0.1,512,0.05,0.1\n")
    check_all_experts(log)
    log.write_text(log.read_text() + "0,mlp.experts.1.gate_proj,0.1,178,0.05,0.1\n")
    with pytest.raises(StageError, match="layer 0 mlp.experts.1.gate_proj on 178 of 512 tokens"):
        check_all_experts(log)
