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
    rep = Report.model_validate({
        "run": RUN, "baseline": {"served": {"transformers": {"levels": _levels((1, 20.0), (16, 100.0))},
                                            "vllm": {"levels": _levels((1, 40.0), (16, 200.0))}}},
        "variants": {"w4": {"served": {"transformers": {"levels": _levels((1, 18.0), (16, 60.0), errors=1)},
                                       "vllm": {"levels": _levels((1, 40.0), (16, 180.0))}}},
                     "w8": {}}})
    cfg = GatesConfig(min_smoke_ok=None, min_serve_tok_s_ratio=0.7, max_serve_error_rate=0.04)
    g = {(x.model, x.gate): x for x in evaluate_gates(rep, cfg)}
    ratio = g[("w4", "min_serve_tok_s_ratio")]
    # each engine against the baseline in the same engine: transformers 60/100, vLLM 180/200
    assert ratio.value == pytest.approx(0.6) and not ratio.passed and "concurrency 16 (transformers)" in ratio.reason
    err = g[("w4", "max_serve_error_rate")]
    assert err.value == pytest.approx(2 / 20) and not err.passed and "highest in transformers" in err.reason
    missing = g[("w8", "min_serve_tok_s_ratio")]
    assert missing.value is None and not missing.passed and "[validate.serve]" in missing.reason


def test_serve_unit_recorded_in_the_report():
    rep = Report.model_validate({"run": RUN})
    for engine, tok_s in (("transformers", 5.0), ("vllm", 9.0)):
        record(rep, f"validate/baseline/serve/{engine}", {"time_s": 1.0, "peak_rss_bytes": 1,
                                                          "metrics": {"levels": _levels((1, tok_s))}}, skipped=False)
    assert rep.baseline.served["transformers"].levels[0].output_tok_s == 5.0
    assert rep.baseline.served["vllm"].levels[0].output_tok_s == 9.0


def test_recipe_adds_a_serve_unit_after_quality():
    from pipeline.recipe import load_recipe
    from pipeline.stages import validate

    r = load_recipe("recipes/tiny.toml", ["validate.serve.enabled=true", "validate.serve.models=[\"baseline\"]"])
    units = {u.key: u for u in validate.units(r)}
    assert "validate/baseline/serve/transformers" in units  # engines = ["auto"]: the format's default engine
    assert units["validate/baseline/serve/transformers"].deps == ["load", "validate/baseline/quality"]
    assert [k for k in units if "/serve/" in k] == ["validate/baseline/serve/transformers"]
    off = load_recipe("recipes/tiny.toml", [])
    assert not any("/serve/" in u.key for u in validate.units(off))


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
    procs = res["levels"][-1]["server_processes"]  # each process's own peak, parent first, adding up to the total
    assert procs and all(p["process"] and p["peak_rss_bytes"] > 0 for p in procs)
    assert sum(p["peak_rss_bytes"] for p in procs) == res["levels"][-1]["server_peak_rss_bytes"]
    assert "tensor_parallel_size" not in res  # one rank: not recorded
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
    e = ModelEntry(served={"transformers": serve})
    assert served_note(e, {"runtime": "transformers (CPU)", "note": ""}) == (
        "served here (transformers 5.24.0, CPU): 96.7 output tok/s at concurrency 16, 0 errors of 32, "
        "greedy = generate 3/3")
    assert served_note(e, {"runtime": "vLLM (CUDA)"}) == "expected from the library's documented support, not tried"
    assert served_note(ModelEntry(), {"runtime": "transformers (CPU)", "note": "measured here"}) == \
        "loaded and measured here (quality, speed), not served"
    md = render_markdown(Report.model_validate({"run": RUN, "baseline": {"served": {"transformers": serve}}}), [])
    assert "## Serving" in md and "| baseline | transformers | 16 | 96.7 | — | 3.00 | 1100 | 1800 | 120 | 700 | 0/32 |" in md and "3/3" in md
    assert "## Serving" not in render_markdown(Report.model_validate({"run": RUN}), [])


def test_card_rows_served_on_cuda_by_vllm_and_on_cpu_by_llama_cpp():
    """The serve unit records its device (pipeline/serve/measure.py): a GPU run served by vLLM turns the card's
    "vLLM (CUDA)" row into "served here" and leaves the CPU transformers row as it was."""
    from pipeline.results.card import served_note
    from pipeline.results.schema import ModelEntry

    level = {"concurrency": 16, "requests": 32, "errors": 0, "output_tok_s": 900.0}
    vllm = ModelEntry(served={"vllm": {"engine": "vllm", "versions": {"vllm": "0.11.0"}, "device": "cuda",
                                       "levels": [level]}})
    assert served_note(vllm, {"runtime": "vLLM (CUDA)"}) == ("served here (vllm 0.11.0, CUDA): 900.0 output tok/s at "
                                                             "concurrency 16, 0 errors of 32")
    assert served_note(vllm, {"runtime": "vLLM (CPU)"}).startswith("expected")
    assert served_note(vllm, {"runtime": "transformers (CPU)"}).startswith("expected")
    gguf = ModelEntry(served={"llama.cpp": {"engine": "llama.cpp", "versions": {"llama-cpp-python": "0.3.36"},
                                            "device": "cpu", "levels": [level]}})
    assert served_note(gguf, {"runtime": "llama.cpp"}).startswith("served here")
    assert served_note(gguf, {"runtime": "transformers"}).startswith("expected")


def test_the_served_model_is_scored_a_served_perplexity_over_the_bound_fails_the_gate(tmp_path):
    """#42: the default run gated the model it scored in process (ratio 1.261 < 1.3) while vLLM's CPU W4A8 path
    served it at 1.321 (int8 activations). max_ppl_ratio now also judges each engine's served perplexity against the
    baseline's on the same windows; the failing engine is named, the card does not recommend it and
    `compress serve --engine auto` never picks it."""
    from pipeline.results.gates import served_gate_failures
    from pipeline.serve import measured

    levels = _levels((1, 20.0), (4, 60.0))
    rep = Report.model_validate({
        "run": RUN, "baseline": {"perplexity": {"value": 22.69}},
        "variants": {"w4": {"perplexity": {"value": 28.649}, "ppl_ratio": 1.261, "served": {
            "transformers": {"levels": levels, "perplexity": {"value": 28.64, "ratio": 0.9997}},
            "vllm": {"levels": _levels((1, 40.0), (4, 256.8)), "int8_activations": True,
                     "perplexity": {"value": 29.995, "ratio": 1.047}}}}}})
    gates = [g for g in evaluate_gates(rep, GatesConfig(min_smoke_ok=None, max_ppl_ratio=1.3))]
    by_metric = {g.metric: g for g in gates}
    assert by_metric["ppl_ratio"].passed and by_metric["ppl_ratio"].value == pytest.approx(1.261)
    assert by_metric["ppl_ratio[served: transformers]"].passed
    vllm = by_metric["ppl_ratio[served: vllm]"]
    assert not vllm.passed and vllm.value == pytest.approx(29.995 / 22.69) and "int8 activations" in vllm.reason
    rep.gates = gates
    failed = served_gate_failures(rep, "w4")
    assert list(failed) == ["vllm"] and "ppl_ratio[served: vllm] 1.322 > 1.3" in failed["vllm"]
    served = {k: s.model_dump() for k, s in rep.variants["w4"].served.items()}
    assert measured.write(tmp_path, served, failed)
    # vLLM measured faster, but what it serves failed the gate: auto picks transformers
    engine, why = measured.pick(measured.read(tmp_path), "cpu", 4, ["transformers", "vllm"])
    assert engine == "transformers" and "vllm" not in why
