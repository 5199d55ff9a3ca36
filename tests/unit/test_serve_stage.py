"""[validate.serve]: the config, the unit it adds, the serve gates, and the measurement on the tiny model."""
from __future__ import annotations

import pytest
from pydantic import ValidationError

from pipeline.eval.config import GatesConfig
from pipeline.results.gates import evaluate_gates
from pipeline.results.merge import record
from pipeline.results.schema import Report
from pipeline.serve.config import ServeConfig

RUN = {"name": "t", "recipe": "r.toml", "started": "2025-01-01T00:00:00", "device": "cpu", "seed": 0}


def _levels(*pairs, errors=0):
    return [{"concurrency": c, "requests": 10, "errors": errors, "output_tok_s": t} for c, t in pairs]


def test_config_defaults_and_refusals():
    c = ServeConfig()
    assert not c.enabled and c.concurrency == [1, 4, 16] and not c.serves("baseline")
    assert ServeConfig(enabled=True, models=["w4"]).serves("w4") and not ServeConfig(enabled=True,
                                                                                     models=["w4"]).serves("baseline")
    for bad in ({"concurrency": []}, {"concurrency": [0]}, {"max_tokens": 0}, {"unknown": 1}):
        with pytest.raises(ValidationError):
            ServeConfig(**bad)


def test_serve_gates_read_the_lowest_ratio_and_the_error_rate():
    rep = Report.model_validate({"run": RUN, "baseline": {"serve": {"levels": _levels((1, 20.0), (16, 100.0))}},
                                 "variants": {"w4": {"serve": {"levels": _levels((1, 18.0), (16, 60.0), errors=1)}},
                                              "w8": {}}})
    cfg = GatesConfig(min_smoke_ok=None, min_serve_tok_s_ratio=0.7, max_serve_error_rate=0.04)
    g = {(x.model, x.gate): x for x in evaluate_gates(rep, cfg)}
    ratio = g[("w4", "min_serve_tok_s_ratio")]
    assert ratio.value == pytest.approx(0.6) and not ratio.passed and "concurrency 16" in ratio.reason
    err = g[("w4", "max_serve_error_rate")]
    assert err.value == pytest.approx(2 / 20) and not err.passed
    missing = g[("w8", "min_serve_tok_s_ratio")]
    assert missing.value is None and not missing.passed and "[validate.serve]" in missing.reason


def test_serve_unit_recorded_in_the_report():
    rep = Report.model_validate({"run": RUN})
    record(rep, "validate/baseline/serve", {"time_s": 1.0, "peak_rss_bytes": 1, "metrics": {"levels": _levels((1, 5.0))}},
           skipped=False)
    assert rep.baseline.serve["levels"][0]["output_tok_s"] == 5.0


def test_recipe_adds_a_serve_unit_after_quality():
    from pipeline.recipe import load_recipe
    from pipeline.stages import validate

    r = load_recipe("recipes/tiny.toml", ["validate.serve.enabled=true", "validate.serve.models=[\"baseline\"]"])
    units = {u.key: u for u in validate.units(r)}
    assert "validate/baseline/serve" in units
    assert units["validate/baseline/serve"].deps == ["load", "validate/baseline/quality"]
    assert not any(k.endswith("/serve") and k != "validate/baseline/serve" for k in units)
    off = load_recipe("recipes/tiny.toml", [])
    assert not any(u.key.endswith("/serve") for u in validate.units(off))


def test_load_test_prompts_come_from_the_perplexity_corpus():
    from pipeline.data import resolve, rows
    from pipeline.serve.loadtest import corpus_prompts

    prompts = corpus_prompts(4, 8, "wikitext2")
    corpus = " ".join(" ".join(r.split()) for r in rows(resolve("wikitext2")) if r.strip())
    assert len(prompts) == 4 and all(len(p.split()) == 8 and p in corpus for p in prompts)
    assert len(set(prompts)) == 4


@pytest.mark.slow
def test_measure_on_the_tiny_model(tmp_path):
    from pipeline.serve.measure import measure
    from tests.serve_helpers import tiny_export

    folder = tiny_export(tmp_path / "tiny")
    cfg = ServeConfig(enabled=True, concurrency=[1, 4], max_tokens=8, equality_prompts=2, equality_tokens=6,
                      max_model_len=128, timeout_s=60)
    prompts = [" ".join(f"t{(i * 7 + j) % 500 + 3}" for j in range(10)) for i in range(16)]
    (tmp_path / "out").mkdir()
    res = measure(folder, cfg, prompts, tmp_path / "out", threads=1)
    assert res["equality"] == {"prompts": 2, "identical": 2, "dtype": "float32", "first_difference": None}
    assert [lv["concurrency"] for lv in res["levels"]] == [1, 4]
    assert all(lv["errors"] == 0 and lv["output_tokens"] == lv["requests"] * 8 for lv in res["levels"])
    assert res["server_exit"] == 0 and res["levels"][-1]["server_peak_rss_bytes"] > 0
    assert res["engine"].startswith("transformers") and res["device"] == "cpu"  # the card reads the device


def test_card_runtime_rows_say_served_or_expected_and_report_has_a_serving_table():
    from pipeline.results.card import served_note
    from pipeline.results.render import render_markdown
    from pipeline.results.schema import ModelEntry

    serve = {"engine": "transformers (continuous batching)", "versions": {"transformers": "5.24.0"},
             "equality": {"prompts": 3, "identical": 3},
             "levels": [{"concurrency": 1, "requests": 4, "errors": 0, "output_tok_s": 21.0, "requests_s": 0.6,
                         "ttft_p50_s": 0.14, "ttft_p99_s": 0.15, "itl_p50_s": 0.044, "itl_p99_s": 0.052,
                         "server_peak_rss_bytes": 2**30},
                        {"concurrency": 16, "requests": 32, "errors": 0, "output_tok_s": 96.7, "requests_s": 3.0,
                         "ttft_p50_s": 1.1, "ttft_p99_s": 1.8, "itl_p50_s": 0.12, "itl_p99_s": 0.7,
                         "server_peak_rss_bytes": 2**30}]}
    e = ModelEntry(serve=serve)
    assert served_note(e, {"runtime": "transformers (CPU)", "note": ""}).startswith(
        "served here: 96.7 output tok/s at concurrency 16, 0 errors of 32 (transformers 5.24.0)")
    assert served_note(e, {"runtime": "vLLM (CUDA)"}) == "expected from the library's documented support, not tried"
    assert served_note(ModelEntry(), {"runtime": "transformers (CPU)", "note": "measured here"}) == \
        "loaded and measured here (quality, speed), not served"
    md = render_markdown(Report.model_validate({"run": RUN, "baseline": {"serve": serve}}), [])
    assert "## Serving" in md and "| baseline | transformers | 16 | 96.7 | 3.00 | 1100 | 1800 | 120 | 700 | 0/32 |" in md and "3/3" in md
    assert "## Serving" not in render_markdown(Report.model_validate({"run": RUN}), [])


def test_card_rows_served_on_cuda_by_vllm_and_on_cpu_by_llama_cpp():
    """The serve unit records its device (pipeline/serve/measure.py): a GPU run served by vLLM turns the card's
    "vLLM (CUDA)" row into "served here" and leaves the CPU transformers row as it was."""
    from pipeline.results.card import served_note
    from pipeline.results.schema import ModelEntry

    level = {"concurrency": 16, "requests": 32, "errors": 0, "output_tok_s": 900.0}
    vllm = ModelEntry(serve={"engine": "vllm", "versions": {"vllm": "0.11.0"}, "device": "cuda", "levels": [level]})
    assert served_note(vllm, {"runtime": "vLLM (CUDA)"}) == ("served here: 900.0 output tok/s at concurrency 16, "
                                                             "0 errors of 32 (vllm 0.11.0)")
    assert served_note(vllm, {"runtime": "transformers (CPU)"}).startswith("expected")
    gguf = ModelEntry(serve={"engine": "llama.cpp (llama-cpp-python server: one request at a time)",
                             "versions": {"llama-cpp-python": "0.3.36"}, "device": "cpu", "levels": [level]})
    assert served_note(gguf, {"runtime": "llama.cpp"}).startswith("served here")
    assert served_note(gguf, {"runtime": "transformers"}).startswith("expected")
