"""Gates: pass, fail, warn-only, per-model overrides, missing metrics (pure logic over a typed report)."""
import math

import pytest
from pydantic import ValidationError

from pipeline.eval.config import GatesConfig, SpeedConfig, gate_problems
from tests.problems import keys
from pipeline.results.gates import blocks, evaluate_gates, failed_gates, gates_table
from pipeline.results.schema import Report

RUN = {"name": "t", "recipe": "r.toml", "started": "2025-01-01T00:00:00", "device": "cpu", "seed": 0}


def typed(rep: dict) -> Report:
    return Report.model_validate({"run": RUN, **rep})


def failing(gates):
    """failed_gates over a report holding these gates."""
    return failed_gates(Report(run=RUN, gates=gates))


def report(**variant_overrides):
    variant = {"perplexity": {"value": 22.0}, "ppl_ratio": 1.1, "kl": 0.05, "top1": 0.9,
               "footprint_bytes": 150, "speed": {"decode_tokens_per_s_b1": 12.0}}
    variant.update(variant_overrides)
    return {
        "baseline": {"perplexity": {"value": 20.0}, "footprint_bytes": 500, "speed": {"decode_tokens_per_s_b1": 15.0}},
        "variants": {"w4": variant},
        "draft": {"name": "draft", "verifier": "w4",
                  "speculative": {"greedy": {"alpha": 0.6, "speedup": 1.3}, "t0.7": {"alpha": 0.4, "speedup": 0.9}}},
    }


def gates_cfg(**bounds) -> GatesConfig:
    """The gates asked for, without the smoke gate that is on by default (tested on its own below)."""
    return GatesConfig(**{"min_smoke_ok": None, **bounds})


def by_gate(gates):
    return {g.gate: g for g in gates}


def test_all_gates_pass_with_values_bounds_and_ops():
    cfg = gates_cfg(max_ppl_ratio=1.2, max_kl=0.1, min_top1=0.8, max_footprint_ratio=0.5,
                      min_decode_speed_ratio=0.5, min_acceptance=0.5, min_spec_speedup=1.1)
    gates = evaluate_gates(typed(report()), cfg)
    assert len(gates) == 7 and not failing(gates)
    g = by_gate(gates)
    assert g["max_footprint_ratio"].value == pytest.approx(0.3) and g["max_footprint_ratio"].op == "<="
    assert g["min_decode_speed_ratio"].value == pytest.approx(0.8) and g["min_decode_speed_ratio"].op == ">="
    assert g["min_acceptance"].model == "draft" and g["min_acceptance"].verifier == "w4"
    assert g["min_acceptance"].value == 0.6  # greedy mode by default
    assert all(x.passed and x.severity == "fail" for x in gates)


def test_failures_and_boundaries():
    cfg = gates_cfg(max_ppl_ratio=1.1, max_kl=0.01, min_top1=0.9)  # ppl and top1 exactly on the bound pass
    g = by_gate(evaluate_gates(typed(report()), cfg))
    assert g["max_ppl_ratio"].passed and g["min_top1"].passed
    assert not g["max_kl"].passed
    assert [x.gate for x in failing(list(g.values()))] == ["max_kl"]


def test_warn_only_gates_never_fail_the_run():
    cfg = gates_cfg(min_spec_speedup=2.0, min_acceptance=0.9, warn_only=["min_spec_speedup", "min_acceptance"])
    gates = evaluate_gates(typed(report()), cfg)
    assert all(not g.passed and g.severity == "warn" for g in gates)
    assert failing(gates) == [] and not any(blocks(g) for g in gates)
    assert "WARN" in gates_table(gates)


def test_per_model_override_replaces_the_global_bound():
    rep = report()
    rep["variants"]["w3"] = dict(rep["variants"]["w4"], ppl_ratio=1.4)
    cfg = gates_cfg(max_ppl_ratio=1.2, models={"w3": {"max_ppl_ratio": 1.5}, "draft": {"min_acceptance": 0.7}})
    gates = evaluate_gates(typed(rep), cfg)
    assert {(g.model, g.bound, g.passed) for g in gates if g.gate == "max_ppl_ratio"} == {
        ("w4", 1.2, True), ("w3", 1.5, True)}
    acc = [g for g in gates if g.gate == "min_acceptance"]
    assert len(acc) == 1 and acc[0].bound == 0.7 and not acc[0].passed


def test_speculative_mode_is_selectable():
    g = by_gate(evaluate_gates(typed(report()), gates_cfg(min_spec_speedup=1.0, speculative_mode="t0.7")))
    assert g["min_spec_speedup"].value == 0.9 and not g["min_spec_speedup"].passed


@pytest.mark.parametrize("gate, breaks, needle", [
    ("max_kl", lambda r: r["variants"]["w4"].pop("kl"), "variants.w4.kl"),
    ("min_decode_speed_ratio", lambda r: r["variants"]["w4"].update(speed=None), "decode_tokens_per_s_b1"),
    ("min_decode_speed_ratio", lambda r: r["baseline"].update(speed=None), "baseline's value is missing"),
    ("min_decode_speed_ratio", lambda r: r["baseline"].update(speed={"skipped": "not timed: over the limit"}),
     "baseline was not timed: not timed: over the limit"),
    ("max_footprint_ratio", lambda r: r["baseline"].pop("footprint_bytes"), "baseline's value is missing"),
    ("max_ppl_ratio", lambda r: r["variants"]["w4"].pop("ppl_ratio"), None),  # recomputed from perplexities
    ("min_acceptance", lambda r: r.update(draft=None), "no draft section"),
    ("min_spec_speedup", lambda r: r["draft"]["speculative"].pop("greedy"), "draft.speculative.greedy.speedup"),
])
def test_missing_metric_is_a_failed_gate_with_a_reason(gate, breaks, needle):
    rep = report()
    breaks(rep)
    (g,) = evaluate_gates(typed(rep), gates_cfg(**{gate: 100.0 if gate.startswith("max") else 0.0001}))
    if needle is None:
        assert g.passed and g.value == pytest.approx(1.1)
    else:
        assert not g.passed and g.value is None and needle in g.reason
        assert "missing" in gates_table([g])


def test_nan_metric_fails():
    (g,) = evaluate_gates(typed(report(kl=math.nan)), gates_cfg(max_kl=1.0))
    assert not g.passed and "not finite" in g.reason


def test_no_gates_configured_and_empty_report():
    assert evaluate_gates(typed(report()), gates_cfg()) == []
    assert evaluate_gates(typed({}), gates_cfg(max_kl=0.1)) == []
    assert gates_table([]) == "no gates configured"


def test_table_lists_every_gate_and_a_summary():
    gates = evaluate_gates(typed(report()), gates_cfg(max_kl=0.01, min_top1=0.5, min_acceptance=0.9,
                                                 warn_only=["min_acceptance"]))
    text = gates_table(gates)
    lines = text.splitlines()
    assert lines[0].split()[:5] == ["model", "gate", "value", "bound", "result"]
    assert len(lines) == 2 + 3 + 1
    assert lines[-1] == "3 gates: 1 passed, 1 failed, 1 warnings"
    assert "draft (verifier w4)" in text


def test_config_validation():
    with pytest.raises(ValidationError, match="unknown gates"):
        gates_cfg(warn_only=["min_speedup"])
    with pytest.raises(ValidationError, match="extra"):
        gates_cfg(max_perplexity=1.2)
    with pytest.raises(ValidationError):
        gates_cfg(min_top1=1.5)


def test_gate_problems_for_compress_check():
    cfg = gates_cfg(min_acceptance=0.5, min_decode_speed_ratio=0.5, models={"w9": {"max_kl": 0.1}})
    problems = gate_problems(cfg, SpeedConfig(models=["w4"]), ["w4"], None)
    assert keys(problems) == [("validate.gates.models.w9", "gate-model-unknown"),
                              ("validate.gates.min_acceptance", "draft-gate-without-draft"),
                              ("validate.gates.min_decode_speed_ratio", "speed-gate-model-not-timed")]
    assert "'baseline'" in problems[2].message  # the model [validate.speed] does not time
    assert gate_problems(gates_cfg(max_kl=0.1), SpeedConfig(), ["w4"], "draft") == []


def test_smoke_gate_is_on_by_default_and_names_the_failed_prompt():
    ok = {"outputs": [{"prompt": "Hi", "text": "Hello! How can I help?", "ok": True, "problem": None}] * 2}
    bad = {"outputs": [ok["outputs"][0], {"prompt": "Name a colour", "text": "the the the the", "ok": False,
                                          "problem": "repeats one 4-gram"}]}
    assert GatesConfig().min_smoke_ok == 1.0
    [g] = evaluate_gates(typed(report(smoke=ok)), GatesConfig())
    assert g.gate == "min_smoke_ok" and g.passed and g.value == 1.0
    [g] = evaluate_gates(typed(report(smoke=bad)), GatesConfig())
    assert not g.passed and g.value == 0.5 and "1 of 2 smoke prompts failed: repeats one 4-gram" in g.reason
    [g] = evaluate_gates(typed(report()), GatesConfig())
    assert not g.passed and "smoke is not in the report" in g.reason
    assert evaluate_gates(typed(report(smoke=bad)), GatesConfig(min_smoke_ok=0.5))[0].passed
    rand = report(smoke=bad)
    rand["model"] = {"random_init": True}
    assert evaluate_gates(typed(rand), GatesConfig()) == []  # random weights: the smoke test says nothing


def test_smoke_gate_without_the_smoke_test_is_refused_at_check():
    problems = gate_problems(GatesConfig(), None, ["w4"], None, smoke=False)
    assert keys(problems) == [("validate.gates.min_smoke_ok", "smoke-gate-without-smoke")]
    assert gate_problems(GatesConfig(min_smoke_ok=0), None, ["w4"], None, smoke=False) == []
    assert evaluate_gates(typed(report()), GatesConfig(min_smoke_ok=0)) == []


def test_smoke_gate_excuses_prompts_the_baseline_failed_and_says_so():
    good = {"prompt": "Hi", "text": "Hello! How can I help?", "ok": True, "problem": None}
    loop = {"prompt": "Name a colour", "text": "the the the the", "ok": False, "problem": "repeats one 4-gram"}
    rep = report(smoke={"outputs": [good, loop]})
    rep["baseline"]["smoke"] = {"outputs": [good, loop]}
    [g] = evaluate_gates(typed(rep), GatesConfig())
    assert g.passed and g.value == 1.0 and "1 prompt(s) the baseline also failed not counted" in g.reason
    rep["baseline"]["smoke"] = {"outputs": [dict(good, ok=False), loop]}
    [g] = evaluate_gates(typed(rep), GatesConfig())
    assert g.passed and "the baseline itself failed every smoke prompt" in g.reason


def test_every_gate_is_one_row_of_the_table():
    """The recipe's fields, the per-model overrides and the evaluation all come from eval.config.GATES."""
    from pipeline.eval.config import GATES, GateBounds, GatesConfig
    from pipeline.results.gates import READERS

    names = [g.name for g in GATES]
    assert len(set(names)) == len(names)
    assert sorted(READERS) == sorted(names)  # each row's reader is a callable, none without a row
    with pytest.raises(TypeError):
        READERS["max_kl"] = READERS["min_top1"]  # type: ignore[index]  # read-only once defined
    for g in GATES:
        assert g.name in GateBounds.model_fields and g.name in GatesConfig.model_fields
        assert GateBounds.model_fields[g.name].default is None
        assert GatesConfig.model_fields[g.name].default == g.default
        assert g.op == ("<=" if g.name.startswith("max_") else ">=")
        assert callable(READERS[g.name])
        assert g.needs_serve == g.metric.startswith("serve_") and (not g.serve_baseline or g.needs_serve)
    assert GatesConfig().bounds_for("any") == {g.name: g.default for g in GATES if g.default is not None}
