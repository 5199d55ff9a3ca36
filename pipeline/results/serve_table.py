"""report.md's "Serving" section: each served model's engine, greedy equality and load-test levels
(validate/<model>/serve), and a line for each model whose serving was skipped (and why). Absent from the report
when no model was served or skipped."""
from __future__ import annotations

from pipeline.results.format import num, size, table
from pipeline.results.query import models
from pipeline.results.schema import Report


def _ms(v) -> str:
    return "—" if v is None else f"{v * 1000:.0f}"


def _engine(s: dict) -> str:
    return str(s.get("engine", "?")).split(" ")[0]  # "transformers (continuous batching)" -> "transformers"


def _same(eq: dict) -> str:
    if not eq.get("prompts"):
        return "—"
    cell = f"{eq.get('identical')}/{eq.get('prompts')}"
    return cell if eq.get("exact", True) else cell + " (text, vs dequantized)"


def serving(report: Report) -> list[str]:
    entries = [(n, m.serve) for n, m in models(report) if isinstance(m.serve, dict)]
    served = [(n, s) for n, s in entries if s.get("levels")]
    skipped = [(n, s) for n, s in entries if s.get("skipped")]
    if not served and not skipped:
        return []
    engines = {}
    for _, s in served:
        engines.setdefault(str(s.get("engine", "?")), s.get("versions") or {})
    lines = ["## Serving", "", "`compress serve` (" + "; ".join(
        f"{e}: " + ", ".join(f"{k} {v}" for k, v in vs.items()) for e, vs in engines.items())
        + "), streaming /v1/completions, fixed output length (ignore_eos / min_tokens), closed loop: each client "
          "sends its next request when the last one ends. Latencies in ms; peak memory is the server's VmHWM.", ""]
    if any(_engine(s) == "llama.cpp" for _, s in served):
        lines += ["llama.cpp rows: llama-cpp-python's server runs one request at a time (the others queue), so a "
                  "level above 1 measures queueing, not continuous batching. Its greedy output is compared with "
                  "transformers generate on the dequantized file by text (different kernels: not expected to be "
                  "identical on every prompt); transformers rows are compared token for token.", ""]
    body = []
    for name, s in served:
        same = _same(s.get("equality") or {})
        for lv in s["levels"]:
            body.append([name, _engine(s), num(lv["concurrency"]), f"{lv['output_tok_s']:.1f}",
                         f"{lv['requests_s']:.2f}", _ms(lv.get("ttft_p50_s")), _ms(lv.get("ttft_p99_s")),
                         _ms(lv.get("itl_p50_s")), _ms(lv.get("itl_p99_s")), f"{lv['errors']}/{lv['requests']}",
                         size(lv.get("server_peak_rss_bytes")) if lv.get("server_peak_rss_bytes") else "—", same])
    header = ["model", "engine", "concurrency", "output tok/s", "req/s", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99",
              "errors", "peak memory", "greedy = generate"]
    out = lines + (table(header, body) + [""] if body else [])
    out += [f"- {name} ({s.get('engine', '?')}): skipped: {s['skipped']}" for name, s in skipped]
    return out + ([""] if skipped else [])
