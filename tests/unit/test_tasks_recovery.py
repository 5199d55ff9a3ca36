"""Task recovery above chance (issue #32): (variant - chance) / (baseline - chance), chance per item from its
number of choices; a task whose baseline is not above chance by its own interval is excluded from the figures and
the gate, and the report says which and why. Hand-computed figures on synthetic per-item records."""
from __future__ import annotations

import json

import numpy as np
import pytest

from pipeline.eval import recovery


def _items(correct: list[float], choices: list[int], metric: str = "acc") -> dict:
    """A task_items.json entry: doc ids, the metric per item, and per-choice log-likelihoods (their count is what
    the chance level is read from)."""
    return {"doc_ids": list(range(len(correct))), metric: [float(x) for x in correct],
            "loglik": [[-1.0] * k for k in choices]}


# 8 items with 2, 2, 4, 4, 4, 4, 5, 5 choices: chance (1/2 + 1/2 + 4 x 1/4 + 2 x 1/5) / 8 = 2.4 / 8 = 0.3
CHOICES = [2, 2, 4, 4, 4, 4, 5, 5] * 25
ARC_BASE = [1, 1, 1, 0, 1, 1, 0, 1] * 25  # 0.75
ARC_VAR = [1, 0, 1, 0, 1, 1, 0, 1] * 25   # 0.625
# Winogrande-like: two-way items, the baseline below chance (0.42), the variant above it (0.56)
WINO_BASE = [1.0] * 42 + [0.0] * 58
WINO_VAR = [1.0] * 56 + [0.0] * 44


def test_recovery_above_chance_hand_computed():
    """(0.625 - 0.3) / (0.75 - 0.3) = 0.325 / 0.45 = 13/18, not the plain ratio 0.625 / 0.75 = 0.833."""
    out = recovery.recoveries({"arc": _items(ARC_BASE, CHOICES)}, {"arc": _items(ARC_VAR, CHOICES)},
                              {"arc": "acc"}, iters=500)
    r = out["tasks"]["arc"]
    assert out["definition"] == "above-chance" and out["excluded"] == {} and r["excluded"] is None
    assert r["chance"] == pytest.approx(0.3) and r["baseline"] == 0.75 and r["variant"] == 0.625
    assert r["recovery"] == pytest.approx(13 / 18)
    assert r["baseline_above_chance"] == pytest.approx(0.45) and r["baseline_above_chance_low"] > 0
    assert r["diff"] == pytest.approx(-0.125)  # the score difference: chance cancels
    # a second task, two-way, 0.8 -> 0.7: (0.2) / (0.3) = 2/3 alone; the average weighs the tasks equally:
    # mean(0.325, 0.2) / mean(0.45, 0.3) = 0.2625 / 0.375 = 0.7
    b2, v2 = [1.0] * 80 + [0.0] * 20, [1.0] * 70 + [0.0] * 30
    out = recovery.recoveries({"arc": _items(ARC_BASE, CHOICES), "piqa": _items(b2, [2] * 100)},
                              {"arc": _items(ARC_VAR, CHOICES), "piqa": _items(v2, [2] * 100)},
                              {"arc": "acc", "piqa": "acc"}, iters=500)
    assert out["tasks"]["piqa"]["recovery"] == pytest.approx(2 / 3)
    avg = out["average"]
    assert avg["recovery"] == pytest.approx(0.7) and avg["chance"] == pytest.approx(0.4)
    assert avg["included"] == ["arc", "piqa"] and avg["tasks"] == 2 and avg["n"] == 300
    assert avg["low"] <= avg["recovery"] <= avg["high"]


def test_pass_at_1_has_chance_zero_and_a_choice_task_without_choice_counts_is_refused():
    base, var = [1.0] * 6 + [0.0] * 4, [1.0] * 5 + [0.0] * 5
    he = {"doc_ids": list(range(10)), "pass@1": base}
    out = recovery.recoveries({"humaneval": he}, {"humaneval": dict(he, **{"pass@1": var})},
                              {"humaneval": "pass@1"}, iters=300)
    assert out["tasks"]["humaneval"]["chance"] == 0.0 and out["tasks"]["humaneval"]["recovery"] == pytest.approx(5 / 6)
    plain = {"doc_ids": [0, 1], "acc": [1.0, 0.0]}
    with pytest.raises(ValueError, match="no choice counts"):
        recovery.recoveries({"t": plain}, {"t": plain}, {"t": "acc"})
    with pytest.raises(ValueError, match="different choices"):
        recovery.recoveries({"t": _items([1, 0], [2, 4])}, {"t": _items([1, 0], [2, 3])}, {"t": "acc"})


def test_a_task_whose_baseline_is_at_chance_is_excluded_and_named():
    """The default run's Winogrande: baseline 0.42 on two-way items, GPTQ 0.56: the plain ratio 1.333 lifted the
    average; above chance the baseline has nothing to recover, so the task is out of the figures and the gate."""
    base = {"arc": _items(ARC_BASE, CHOICES), "winogrande": _items(WINO_BASE, [2] * 100)}
    var = {"arc": _items(ARC_VAR, CHOICES), "winogrande": _items(WINO_VAR, [2] * 100)}
    out = recovery.recoveries(base, var, {"arc": "acc", "winogrande": "acc"}, iters=500)
    w = out["tasks"]["winogrande"]
    assert w["recovery"] is None and w["low"] is None and w["high"] is None
    assert "baseline 0.420 is not above chance 0.500" in w["excluded"]
    assert out["excluded"] == {"winogrande": w["excluded"]}
    assert out["average"]["included"] == ["arc"] and out["average"]["tasks"] == 1
    assert out["average"]["recovery"] == pytest.approx(13 / 18)  # ARC's alone, not lifted by Winogrande
    # a baseline just above chance but not by its interval (0.52 on 100 two-way items) is excluded too
    near = recovery.task_recovery([1.0] * 52 + [0.0] * 48, WINO_VAR, iters=500, chance=0.5)
    assert near["baseline_above_chance"] > 0 and near["baseline_above_chance_low"] <= 0 and near["excluded"]
    # every task at chance: no average at all
    only = recovery.recoveries({"w": base["winogrande"]}, {"w": var["winogrande"]}, {"w": "acc"}, iters=300)
    assert "average" not in only and list(only["excluded"]) == ["w"]


def test_bootstrap_interval_contains_the_point_and_is_paired():
    rng = np.random.default_rng(0)
    k = rng.integers(2, 6, size=1000)
    base = (rng.random(1000) < 0.7).astype(float)
    c = 1.0 / k
    same = recovery.task_recovery(list(base), list(base), iters=500, chance=list(c))
    assert same["recovery"] == same["low"] == same["high"] == 1.0  # one draw of items for both models
    var = base.copy()
    var[np.flatnonzero(base == 1)[:30]] = 0  # 30 of 1000 items lost
    r = recovery.task_recovery(list(base), list(var), iters=1000, seed=1, chance=list(c))
    assert r["low"] < r["recovery"] < r["high"] < 1.0
    assert r["recovery"] == pytest.approx((var - c).mean() / (base - c).mean())
    # unpaired (each model's items drawn separately) the interval is several times wider
    i, j = rng.integers(0, 1000, size=(2, 1000, 1000))
    unpaired = np.quantile((var - c)[i].mean(axis=1) / (base - c)[j].mean(axis=1), [0.025, 0.975])
    assert r["high"] - r["low"] < 0.5 * (unpaired[1] - unpaired[0])
    assert recovery.task_recovery(list(base), list(var), iters=1000, seed=1, chance=list(c)) == r  # seeded
    avg = recovery.average_recovery({"a": (list(base), list(var)), "b": (list(base), list(base))}, iters=500,
                                    chances={"a": list(c), "b": list(c)})
    assert avg["low"] < avg["recovery"] < avg["high"]
    m = (base - c).mean()
    assert avg["recovery"] == pytest.approx(((var - c).mean() + m) / (2 * m))


# ---------------------------------------------------------------- the gate and the report
def _report_with_winogrande(tmp_path=None):
    from pipeline.results.schema import Report

    base = {"arc": _items(ARC_BASE, CHOICES), "winogrande": _items(WINO_BASE, [2] * 100)}
    var = {"arc": _items(ARC_VAR, CHOICES), "winogrande": _items(WINO_VAR, [2] * 100)}
    rec = recovery.recoveries(base, var, {"arc": "acc", "winogrande": "acc"}, iters=500)

    def task(score):
        return {"metric": "acc", "score": score, "stderr": 0.03, "n": 200, "split": "validation", "time_s": 1.0}
    data = {"run": {"name": "t", "recipe": "r.toml", "started": "2025-01-01T00:00:00", "device": "cpu", "seed": 0},
            "baseline": {"tasks": {"arc": task(0.75), "winogrande": task(0.42)}},
            "variants": {"w4": {"tasks": {"arc": task(0.625), "winogrande": task(0.56)}, "task_recovery": rec}}}
    return Report.model_validate(json.loads(json.dumps(data))), rec


def test_the_gate_leaves_out_an_excluded_task_and_says_why():
    from pipeline.eval.config import GatesConfig
    from pipeline.results.gates import evaluate_gates

    rep, rec = _report_with_winogrande()
    gates = evaluate_gates(rep, GatesConfig(min_smoke_ok=None, min_task_recovery=0.7))
    assert [g.metric for g in gates] == ["task_recovery[arc]", "task_recovery[average]"]
    assert [g.value for g in gates] == [pytest.approx(13 / 18)] * 2 and all(g.passed for g in gates)
    assert "above chance 0.300" in gates[1].reason
    assert "excluded: winogrande: baseline 0.420 is not above chance 0.500" in gates[1].reason
    each = evaluate_gates(rep, GatesConfig(min_smoke_ok=None, min_task_recovery=0.7, task_recovery_scope="each"))
    assert [g.metric for g in each] == ["task_recovery[arc]"] and "excluded: winogrande" in each[0].reason
    # every task at chance: nothing to judge is a failed gate that says so, not a pass
    rep.variants["w4"].task_recovery = {**rec, "tasks": {"winogrande": rec["tasks"]["winogrande"]},
                                        "average": None, "excluded": {"winogrande": rec["excluded"]["winogrande"]}}
    none = evaluate_gates(rep, GatesConfig(min_smoke_ok=None, min_task_recovery=0.7))
    assert len(none) == 1 and not none[0].passed and none[0].value is None
    assert "every task's baseline is not above chance" in none[0].reason and "winogrande" in none[0].reason


def test_report_and_card_name_the_excluded_task(tmp_path):
    from pipeline.results.card import card_data
    from pipeline.results.tasks_render import tasks_section

    rep, _ = _report_with_winogrande()
    md = "\n".join(tasks_section(rep))
    assert "Recovery is measured above chance: (variant score - chance) / (baseline score - chance)" in md
    assert "| w4 | winogrande | acc | 0.5600 ± 0.030 | 200 | validation | excluded (baseline at chance) |" in md
    assert "| w4 | arc | acc | 0.6250 ± 0.030 | 200 | validation | 0.722 [" in md
    assert "Chance: arc 0.300, winogrande 0.500." in md
    assert "- **w4 winogrande excluded** from recovery and the gate: baseline 0.420 is not above chance 0.500" in md
    avg = next(line for line in md.splitlines() if "**average**" in line)
    assert "| 0.722 [" in avg  # the average is ARC's alone
    data = card_data(rep, {"kind": "variant", "name": "w4"})
    names = [r.metric_name for r in data.eval_results if r.metric_type == "recovery"]
    assert len(names) == 1 and names[0].startswith("arc recovery above chance vs the baseline")
