"""report.md's "Serving" section: each served model's greedy equality and load-test levels (validate/<model>/serve).
Absent from the report when no model was served."""
from __future__ import annotations

from pipeline.results.format import num, size, table
from pipeline.results.query import models
from pipeline.results.schema import Report


def _ms(v) -> str:
    return "—" if v is None else f"{v * 1000:.0f}"


def serving(report: Report) -> list[str]:
    served = [(n, m.serve) for n, m in models(report) if isinstance(m.serve, dict) and m.serve.get("levels")]
    if not served:
        return []
    first = served[0][1]
    lines = ["## Serving", "", f"`compress serve` ({first.get('engine', '?')}; "
             + ", ".join(f"{k} {v}" for k, v in (first.get("versions") or {}).items())
             + "), streaming /v1/completions, fixed output length (ignore_eos), closed loop: each client sends its "
               "next request when the last one ends. Latencies in ms; peak memory is the server's VmHWM.", ""]
    body = []
    for name, s in served:
        eq = s.get("equality") or {}
        same = f"{eq.get('identical')}/{eq.get('prompts')}" if eq.get("prompts") else "—"
        for lv in s["levels"]:
            body.append([name, num(lv["concurrency"]), f"{lv['output_tok_s']:.1f}", f"{lv['requests_s']:.2f}",
                         _ms(lv.get("ttft_p50_s")), _ms(lv.get("ttft_p99_s")), _ms(lv.get("itl_p50_s")),
                         _ms(lv.get("itl_p99_s")), f"{lv['errors']}/{lv['requests']}",
                         size(lv.get("server_peak_rss_bytes")) if lv.get("server_peak_rss_bytes") else "—", same])
    header = ["model", "concurrency", "output tok/s", "req/s", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99",
              "errors", "peak memory", "greedy = generate"]
    return lines + table(header, body) + [""]
