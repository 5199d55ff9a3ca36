"""[validate.tasks]: lm-eval offline on a three-item local task (scores computed by hand), the item choice,
the paired recovery interval on synthetic items, the recovery gate both ways, and `compress check`'s errors."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

from pipeline.eval import recovery
from pipeline.eval.tasks import item_indices

DOCS = [{"q": "t5 t6 t7", "choices": ["t8", "t9 t10 t11"], "label": 0},
        {"q": "t12 t13", "choices": ["t14 t15", "t16", "t17"], "label": 2},
        {"q": "t20", "choices": ["t21", "t22 t23"], "label": 1}]

BASE_YAML = """task: hub_task
dataset_path: some/hub-dataset
dataset_name: null
output_type: multiple_choice
training_split: train
validation_split: validation
test_split: test
doc_to_text: "{{q}}"
doc_to_target: "{{label}}"
doc_to_choice: "{{choices}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
"""


def _loglik(model, tok, context: str, cont: str) -> float:
    import torch

    ctx = tok(context, add_special_tokens=False)["input_ids"]
    whole = tok(context + cont, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([whole])).logits[0].double(), -1)
    return float(sum(logp[i - 1, whole[i]] for i in range(len(ctx), len(whole))))


def test_lm_eval_offline_three_items_by_hand(tmp_path, monkeypatch):
    """lm-eval's acc/acc_norm on a local JSON task reached through an `include:`d task yaml equal the
    loglikelihoods computed here directly with torch."""
    pytest.importorskip("lm_eval")
    import torch
    from lm_eval.models.huggingface import HFLM
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipeline.eval.tasks import run_lm_eval, write_task_yaml
    from tests.tiny_models import tiny_llama

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    torch.set_num_threads(1)
    model_dir = tiny_llama(tmp_path / "m")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(model_dir)
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    (tmp_path / "base").mkdir()
    base = tmp_path / "base" / "hub_task.yaml"
    base.write_text(BASE_YAML)
    yamls = tmp_path / "yamls"
    write_task_yaml(yamls, "local3", base, data, "validation", fmt="json")

    acc, acc_norm = [], []
    for d in DOCS:
        ll = [_loglik(model, tok, d["q"], " " + c) for c in d["choices"]]
        acc.append(float(int(np.argmax(ll)) == d["label"]))
        norm = [x / len(c) for x, c in zip(ll, d["choices"])]  # lm-eval: by the choice's length in characters
        acc_norm.append(float(int(np.argmax(norm)) == d["label"]))

    lm = HFLM(pretrained=model, tokenizer=tok, batch_size=2, device="cpu")
    res = run_lm_eval(lm, yamls, {"local3": None}, num_fewshot=0, seed=0)["local3"]
    assert res["items"]["doc_ids"] == [0, 1, 2]
    assert res["items"]["acc"] == acc
    assert res["items"]["acc_norm"] == acc_norm
    assert res["metrics"]["acc"] == pytest.approx(sum(acc) / 3)
    assert res["metrics"]["acc_norm"] == pytest.approx(sum(acc_norm) / 3)
    # the chosen items through lm-eval's `samples`: the same documents, their own indices kept
    two = run_lm_eval(lm, yamls, {"local3": [0, 2]}, num_fewshot=0, seed=0)["local3"]
    assert two["items"]["doc_ids"] == [0, 2]
    assert two["items"]["acc"] == [acc[0], acc[2]]


def test_item_indices_same_for_every_model_and_limit_over_split():
    assert item_indices(10, None, 0) is None
    assert item_indices(10, 10, 0) is None and item_indices(10, 50, 0) is None  # all of them
    assert item_indices(10, 3, None) == [0, 1, 2]  # lm-eval's own --limit: the first N
    a = item_indices(1000, 50, 7)
    assert a == item_indices(1000, 50, 7) and a == sorted(a) and len(set(a)) == 50
    assert a != item_indices(1000, 50, 8)


def test_paired_interval_synthetic():
    rng = np.random.default_rng(1)
    base = (rng.random(2000) < 0.6).astype(float)
    same = recovery.task_recovery(list(base), list(base), iters=500)
    assert same["recovery"] == 1.0 and same["low"] == 1.0 and same["high"] == 1.0 and same["diff_se"] == 0.0
    # the variant flips 5 % of the items from right to wrong: recovery (0.6 - 0.05) / 0.6 by construction
    var = base.copy()
    right = np.flatnonzero(base == 1)
    var[right[: 100]] = 0
    r = recovery.task_recovery(list(base), list(var), iters=1000, seed=3)
    assert r["recovery"] == pytest.approx(var.mean() / base.mean())
    assert r["low"] < r["recovery"] < r["high"] < 1.0  # paired: the interval excludes 1
    d = var - base
    assert r["diff_se"] == pytest.approx(d.std(ddof=1) / math.sqrt(2000))
    assert r["resolvable"] == pytest.approx(1.959963984540054 * r["diff_se"])
    # unpaired, each score's own error (sqrt(p(1-p)/n) ~ 0.011) is far larger than the paired one (~0.005)
    assert r["diff_se"] < 0.5 * math.sqrt(base.mean() * (1 - base.mean()) / 2000) * math.sqrt(2)
    assert recovery.task_recovery(list(base), list(var), iters=1000, seed=3) == r  # seeded
    avg = recovery.average_recovery({"a": (list(base), list(var)), "b": (list(base), list(base))}, iters=500)
    assert avg["recovery"] == pytest.approx((var.mean() + base.mean()) / (2 * base.mean()))
    assert avg["low"] < avg["recovery"] < avg["high"]
    with pytest.raises(ValueError, match="same non-empty items"):
        recovery.task_recovery([1.0, 0.0], [1.0])


def test_recoveries_refuse_different_items():
    b = {"t": {"doc_ids": [0, 1, 2], "acc": [1.0, 1.0, 0.0]}}
    v = {"t": {"doc_ids": [0, 1, 3], "acc": [1.0, 0.0, 0.0]}}
    with pytest.raises(ValueError, match="different items"):
        recovery.recoveries(b, v, {"t": "acc"})
    v["t"]["doc_ids"] = [0, 1, 2]
    out = recovery.recoveries(b, v, {"t": "acc"}, iters=200)
    assert out["tasks"]["t"]["recovery"] == 0.5 and out["average"]["recovery"] == 0.5
