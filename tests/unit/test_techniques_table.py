"""The techniques table and its plot: plain decoding, KV cache, static batching (padded generate at batch N),
continuous batching (the server at concurrency N) and speculative decoding, per model, in ONE table of report.md
and ONE plot (throughput vs concurrency, p99 latency vs throughput). Torch-free."""
from __future__ import annotations

import pytest

from pipeline.results.plots import techniques_plot, write_plots
from pipeline.results.render import render_markdown
from pipeline.results.schema import Report
from pipeline.results.serve_table import TECHNIQUES_PLOT, technique_rows

RUN = {"name": "t", "recipe": "r.toml", "started": "2025-01-01T00:00:00", "device": "cpu", "seed": 0}


def _stats(m: float) -> dict:
    return {"median": m, "min": m * 0.8, "max": m * 1.2, "n": 3}


def _speed(b1: float, b4: float, plain: float | None) -> dict:
    tech = {"kv_cache": {"decode_tokens_per_s": _stats(b1)}}
    if plain is not None:
        tech["no_kv_cache"] = {"decode_tokens_per_s": _stats(plain)}
    tech["flash_attention_2"] = {"skipped": "flash_attention_2 needs CUDA"}
    return {"device": "cpu", "new_tokens": 32, "prompt_len": 64, "repeats": 3, "warmup": 1,
            "decode": {"1": {"batch": 1, "tokens_per_s": _stats(b1), "ttft_s": _stats(0.1)},
                       "4": {"batch": 4, "tokens_per_s": _stats(b4), "ttft_s": _stats(0.3)}},
            "max_batch": 4, "techniques": tech}


def _serve(*levels: tuple[int, float, float]) -> dict:
    return {"engine": "transformers (continuous batching)", "versions": {"transformers": "5.24.0"},
            "equality": {"prompts": 3, "identical": 3},
            "levels": [{"concurrency": c, "requests": 2 * c, "errors": 0, "output_tok_s": t, "requests_s": t / 32,
                        "ttft_p50_s": 0.1, "ttft_p99_s": 0.2 * c, "itl_p50_s": itl / 2, "itl_p99_s": itl}
                       for c, t, itl in levels]}


def report() -> Report:
    spec = {"alpha": 0.7, "speedup": 1.4, "tokens_per_s": 28.0, "gamma": 4}
    return Report.model_validate({
        "run": RUN,
        "baseline": {"speed": _speed(20.0, 50.0, 3.0), "served": {"transformers": _serve(
            (1, 21.0, 0.05), (4, 60.0, 0.09), (16, 96.7, 0.7))}},
        "variants": {"w4": {"speed": _speed(12.0, 35.0, None), "served": {"transformers": _serve(
            (1, 11.0, 0.1), (16, 60.0, 0.9))}}},
        "draft": {"name": "draft", "verifier": "w4",
                  "speculative": {"greedy": spec, "undistilled greedy": {**spec, "speedup": 0.9}}},
    })


def test_one_table_has_every_technique_per_model():
    md = render_markdown(report(), [])
    assert md.count("## Techniques") == 1
    section = md[md.index("## Techniques"):].split("\n## ")[0]
    assert section.count("| model | technique | N |") == 1  # one table, not one per model or per technique
    rows = [r for r in section.splitlines() if r.startswith("| ") and not r.startswith("| model")]
    got = {(r.split(" | ")[0][2:], r.split(" | ")[1], r.split(" | ")[2]) for r in rows}
    for want in [("baseline", "plain decoding", "1"), ("baseline", "KV cache", "1"),
                 ("baseline", "static batching", "4"), ("baseline", "continuous batching", "1"),
                 ("baseline", "continuous batching", "4"), ("baseline", "continuous batching", "16"),
                 ("w4", "KV cache", "1"), ("w4", "static batching", "4"), ("w4", "continuous batching", "16"),
                 ("w4", "speculative decoding", "1")]:
        assert want in got, want
    assert ("w4", "plain decoding", "1") not in got  # not timed for w4: no row, said in the preamble
    assert "technique_models" in section
    # a row's figures: median tok/s, p99 ms/token, TTFT p99, the ratio over the model's KV-cache decode
    assert "| baseline | static batching | 4 | 50 | 100 | 360 | 2.5 | generate |" in section
    assert "| baseline | continuous batching | 16 | 96.7 | 700 | 3,200 | 4.83 | server | 0/32 errors |" in section
    assert "| w4 | speculative decoding | 1 | 28 | – | – | 2.33 | speculative | draft `draft`, greedy, gamma 4, " \
           "1.40× plain decoding in the same loop |" in section
    assert "undistilled" not in section  # comparison drafts stay in the speculative section
    assert "flash_attention_2 needs CUDA" in section
    assert "Techniques (batch 1)" not in md  # the old batch-1-only table is replaced, not kept beside it


def test_rows_are_grouped_by_model_in_technique_order():
    rows = technique_rows(report())
    order = [(r.model, r.technique, r.n) for r in rows]
    assert order[:7] == [("baseline", "plain decoding", 1), ("baseline", "KV cache", 1),
                         ("baseline", "KV cache + flash_attention_2", 1), ("baseline", "static batching", 4),
                         ("baseline", "continuous batching", 1), ("baseline", "continuous batching", 4),
                         ("baseline", "continuous batching", 16)]
    assert order[-1] == ("w4", "speculative decoding", 1)
    kv = next(r for r in rows if r.model == "baseline" and r.technique == "KV cache")
    assert kv.tok_s == 20.0 and kv.p99_ms == pytest.approx(1000 / 16.0) and kv.ttft_p99_ms == pytest.approx(120)


def test_one_plot_throughput_vs_concurrency_and_p99_latency_vs_throughput(tmp_path):
    fig = techniques_plot(report())
    left, right = fig.axes
    assert left.get_xlabel().startswith("batch size") and "tokens/s" in left.get_ylabel()
    assert "tokens/s" in right.get_xlabel() and "p99" in right.get_ylabel()
    lines = {ln.get_label(): ln for ln in left.get_lines()}
    cb = lines["baseline: continuous batching"]
    assert list(cb.get_xdata()) == [1, 4, 16] and list(cb.get_ydata()) == [21.0, 60.0, 96.7]
    static = lines["baseline: static batching (N=1: KV cache)"]
    assert list(static.get_xdata()) == [1, 4] and list(static.get_ydata()) == [20.0, 50.0]
    assert list(lines["w4: speculative decoding"].get_ydata()) == [28.0]
    assert list(lines["baseline: plain decoding"].get_ydata()) == [3.0]
    lat = {ln.get_label(): ln for ln in right.get_lines()}["baseline: continuous batching"]
    assert list(lat.get_xdata()) == [21.0, 60.0, 96.7]
    assert list(lat.get_ydata()) == pytest.approx([50.0, 90.0, 700.0])
    assert TECHNIQUES_PLOT in write_plots(report(), tmp_path)
    assert (tmp_path / TECHNIQUES_PLOT).stat().st_size > 10_000


def test_no_rows_no_section_and_no_plot(tmp_path):
    empty = Report.model_validate({"run": RUN})
    assert "## Techniques" not in render_markdown(empty, [])
    assert techniques_plot(empty) is None
    (tmp_path / TECHNIQUES_PLOT).write_bytes(b"stale")
    assert TECHNIQUES_PLOT not in write_plots(empty, tmp_path) and not (tmp_path / TECHNIQUES_PLOT).exists()
