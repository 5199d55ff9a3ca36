"""The tensor_parallel and attention rows in report.md's techniques table and in the model card: each says what it
did here, on which device (torch-free: from a report)."""
from __future__ import annotations

from pipeline.results.render import render_markdown
from tests.unit.test_report import LOCK, full_report, typed
from pipeline.results.card import card_text

TP_NOTE = ("TP=2 on 2 CPU cores, one thread per rank (gloo): 0.60x one process's decode on 2 threads, 0.52x its peak "
           "memory per rank; greedy 3/3 identical, max |Δlogit| 3.1e-05 (tolerance 0.02)")


def _report():
    data = full_report()
    speed = data["baseline"]["speed"]
    speed["device_name"] = "cpu (2 threads)"
    speed["techniques"] = {
        "kv_cache": {"decode_tokens_per_s": {"median": 20.0, "min": 19.0, "max": 21.0, "n": 3}},
        "tensor_parallel": {"decode_tokens_per_s": {"median": 12.0, "min": 11.0, "max": 13.0, "n": 3},
                            "tp_size": 2, "backend": "gloo", "greedy_identical": 3, "prompts": 3, "note": TP_NOTE},
        "eager": {"max_abs_logit_diff": 0.5, "equality_atol": 0.02,
                  "error": "eager differs from sdpa: max |Δlogit| 0.5 over the tolerance 0.02 "
                           "([validate.speed] equality_atol); not timed"}}
    return typed(data)


def test_the_techniques_table_carries_the_rows_with_what_they_did():
    md = render_markdown(_report(), [])
    section = md[md.index("## Techniques"):].split("\n## ")[0]
    tp = [r for r in section.splitlines() if "tensor parallel" in r]
    assert len(tp) == 1 and "| 12 |" in tp[0] and TP_NOTE.replace("|", "\\|") in tp[0]  # cells escape |
    assert "| tensor parallel (TP=2, gloo) |" in tp[0] and "KV cache + tensor_parallel" not in section
    eager = [r for r in section.splitlines() if "KV cache + eager" in r]
    assert len(eager) == 1 and "eager differs from sdpa" in eager[0]


def test_the_card_says_each_runtime_technique_in_a_sentence():
    text = card_text(_report(), {"kind": "variant", "name": "gptq-w4g64"}, "x = 1", LOCK)
    assert "Runtime techniques measured on these models:" in text
    assert f"- baseline, tensor_parallel on cpu (2 threads): {TP_NOTE}" in text
    assert "- baseline, eager on cpu (2 threads): eager differs from sdpa" in text
