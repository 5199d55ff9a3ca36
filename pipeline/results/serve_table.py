"""report.md's "Serving" section: each served model's engine, greedy equality and load-test levels
(validate/<model>/serve), and a line for each model whose serving was skipped (and why). Absent from the report
when no model was served or skipped.

Also the one owner of the techniques rows (`technique_rows`): plain decoding, KV cache, static batching (padded
`generate` at batch N), continuous batching (the server at concurrency N) and speculative decoding, per model, read
by report.md's techniques table (`techniques_section`) and its plot (pipeline/results/plots.py techniques_plot)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pipeline.results.format import FP_DISTILLED, num, size, table
from pipeline.results.metrics import Equality, Real, Served, Speed, Stat, Technique
from pipeline.results.query import models
from pipeline.results.schema import Report
from pipeline.serve import engines

TECHNIQUES_PLOT = "techniques_throughput_latency.png"


def _ms(v) -> str:
    return "—" if v is None else f"{v * 1000:.0f}"


def _fixed(v, digits: int) -> str:
    return "—" if v is None else f"{v:.{digits}f}"


def _engine(s: Served) -> str:
    return str(s.given("engine", "?")).split(" ")[0]  # "transformers (continuous batching)" -> "transformers"


def _same(eq: Equality | None) -> str:
    if not eq or not eq.prompts:
        return "—"
    cell = f"{eq.identical}/{eq.prompts}"
    if eq.given("exact", True):
        return cell
    return cell + (" (text, vs dequantized)" if eq.compared == "text" else " (other kernels)")


def served(report: Report) -> list[tuple[str, Served]]:
    """(model, serve record) for every model and engine, each model's engines together."""
    return [(n, s) for n, m in models(report) for s in (m.served or {}).values()]


def serving(report: Report) -> list[str]:
    entries = served(report)
    served_ = [(n, s) for n, s in entries if s.levels]
    skipped = [(n, s) for n, s in entries if s.skipped]
    if not served_ and not skipped:
        return []
    versions: dict[str, dict[str, Any]] = {}
    for _, s in served_:
        versions.setdefault(str(s.given("engine", "?")), s.versions or {})
    lines = ["## Serving", "", "`compress serve` (" + "; ".join(
        f"{e}: " + ", ".join(f"{k} {v}" for k, v in vs.items()) for e, vs in versions.items())
        + "), streaming /v1/completions, fixed output length (ignore_eos / min_tokens), closed loop: each client "
          "sends its next request when the last one ends. Latencies in ms; peak memory is the server's VmHWM.", ""]
    present = {_engine(s) for _, s in served_}
    for name in reversed(engines.REGISTERED):  # each served engine's note, the latest registered first
        note = engines.get(name).report_note
        lines += [note, ""] if note and name in present else []
    reference = engines.reference()
    hf = {(name, lv.concurrency): lv.output_tok_s for name, s in served_ if _engine(s) == reference
          for lv in s.levels or []}
    body = []
    for name, s in served_:
        same = _same(s.equality)
        for lv in s.levels or []:
            ref = hf.get((name, lv.concurrency))
            ratio = (f"{lv.output_tok_s / ref:.2f}"
                     if ref and lv.output_tok_s is not None and _engine(s) != reference else "—")
            body.append([name, _engine(s), num(lv.concurrency), _fixed(lv.output_tok_s, 1), ratio,
                         _fixed(lv.requests_s, 2), _ms(lv.ttft_p50_s), _ms(lv.ttft_p99_s),
                         _ms(lv.itl_p50_s), _ms(lv.itl_p99_s), f"{lv.errors}/{lv.requests}",
                         size(lv.server_peak_rss_bytes) if lv.server_peak_rss_bytes else "—", same])
    header = ["model", "engine", "concurrency", "output tok/s", f"× {reference}", "req/s", "TTFT p50", "TTFT p99",
              "ITL p50", "ITL p99", "errors", "peak memory", "greedy = generate"]
    out = lines + (table(header, body) + [""] if body else [])
    scored = [(name, s) for name, s in served_ if s.perplexity is not None and s.perplexity.value is not None]
    if scored:
        out += ["Perplexity through the server: the quality stage's evaluation windows (the same token ids) sent "
                "to the server, scored from its prompt log-probabilities, beside the quality stage's in-process "
                "figure for the same checkpoint (its kernels and precision against ours).", ""]
        out += table(["model", "engine", "served perplexity", "in process", "served / in process", "tokens",
                      "windows"],
                     [[name, _engine(s), _fixed(p.value, 4), _fixed(p.in_process, 4), _fixed(p.ratio, 4),
                       num(p.tokens), num(p.windows)] for name, s in scored if (p := s.perplexity) is not None]) + [""]
    unscored = [f"- {name} ({_engine(s)}): perplexity through the server not scored: {p.skipped}"
                for name, s in served_ if (p := s.perplexity) is not None and p.skipped]
    out += unscored + ([""] if unscored else [])
    out += [f"- {name} ({s.given('engine', '?')}): skipped: {s.skipped}" for name, s in skipped]
    return out + ([""] if skipped else [])


# ---------------------------------------------------------------- the techniques table (report.md and its plot)
@dataclass(frozen=True)
class TechRow:
    """One technique of one model at batch size / concurrency n: the row of report.md's techniques table and a
    point of its plot (pipeline/results/plots.py techniques_plot). tok_s: output tokens/s of all sequences;
    p99_ms: p99 time per output token of one sequence; kind: which measurement produced it (KIND_NOTES)."""

    model: str
    technique: str
    n: Real
    tok_s: float | None
    p99_ms: float | None
    ttft_p99_ms: float | None
    kind: str
    note: str = ""


PLAIN, KV, STATIC, CB, SPEC = ("plain decoding", "KV cache", "static batching", "continuous batching",
                               "speculative decoding")
KIND_NOTES = {
    "generate": "`generate`, decode steps only (median of the timed runs); p99 ms/token and TTFT p99: the slowest "
                "timed run (nearest rank over so few runs)",
    "server": "`compress serve` under the load test: completion tokens over the level's wall time (prefill and "
              "queueing included); p99 ms/token: inter-token latency p99",
    "speculative": "the verifier with its draft in the speculative decoder's loop: new tokens over whole-call time "
                   "(prefill included), batch 1",
}


def _median(stats: Stat | None) -> float | None:
    return stats.median if stats is not None else None


def _slowest_ms(stats: Stat | None, n: int) -> float | None:
    """ms per output token of one sequence in the slowest timed run (n sequences decoded together)."""
    low = stats.min if stats is not None else None
    return 1000.0 * n / low if low else None


def _generate_rows(name: str, speed: Speed) -> list[TechRow]:
    """Plain decoding, KV cache, the other batch-1 technique rows and static batching, from a speed payload."""
    rows, tech = [], speed.techniques or {}
    note = lambda r: r.skipped or r.error or ""  # noqa: E731
    plain = tech.get("no_kv_cache")
    if plain is not None:
        tps = plain.decode_tokens_per_s
        rows.append(TechRow(name, PLAIN, 1, _median(tps), _slowest_ms(tps, 1), None, "generate",
                            note(plain) or "no KV cache: every step re-runs the whole sequence"))
    for key, dec in sorted((speed.decode or {}).items(), key=lambda kv: int(kv[0])):
        n, tps = int(key), dec.tokens_per_s
        ttft = dec.ttft_s.max if dec.ttft_s else None
        rows.append(TechRow(name, KV if n == 1 else STATIC, n, _median(tps), _slowest_ms(tps, n),
                            ttft * 1000 if ttft is not None else None, "generate",
                            "dynamic KV cache, batch 1" if n == 1 else
                            f"padded `generate`: {n} prompts of different lengths left-padded into one batch"))
        if n == 1:  # the other batch-1 rows follow the one they are compared with
            for t, r in tech.items():
                if t not in ("kv_cache", "no_kv_cache"):
                    tps = r.decode_tokens_per_s
                    rows.append(TechRow(name, _batch1_label(t, r), 1, _median(tps), _slowest_ms(tps, 1), None,
                                        "generate", note(r) or r.given("note", "")))
    return rows


def _batch1_label(name: str, row: Technique) -> str:
    """A batch-1 row's technique cell: tensor parallelism by its size and process-group backend (it is a split of
    the model over processes, not a kernel beside the KV cache); the others as "KV cache + <name>"."""
    if name != "tensor_parallel":
        return f"KV cache + {name}"
    how = [f"TP={row.given('tp_size')}" if row.given("tp_size") else None, row.given("backend")]
    return "tensor parallel" + (f" ({', '.join(h for h in how if h)})" if any(how) else "")


def _served_rows(name: str, serve: Served) -> list[TechRow]:
    engine, eng = _engine(serve), engines.find(_engine(serve))
    label = (f"served ({engine}, one request at a time)" if eng is None or not eng.batches
             else CB if eng.reference else f"{CB} ({eng.display()})")
    return [TechRow(name, label, lv.concurrency, lv.output_tok_s,
                    lv.itl_p99_s * 1000 if lv.itl_p99_s is not None else None,
                    lv.ttft_p99_s * 1000 if lv.ttft_p99_s is not None else None, "server",
                    f"{lv.given('errors', 0)}/{lv.given('requests', '?')} errors")
            for lv in serve.levels or []]


def _speculative_rows(report: Report) -> list[TechRow]:
    """The distilled draft's rows (greedy, each temperature) under its verifier's name."""
    d = report.draft
    if d is None or not d.verifier or d.speculative is None:
        return []
    rows = []
    for mode, s in d.speculative.items():
        if mode.split(" ")[0] in ("undistilled", FP_DISTILLED):  # comparisons only
            continue
        speedup, gamma = s.speedup, s.gamma
        rows.append(TechRow(d.verifier, SPEC, 1, s.tokens_per_s, None, None, "speculative",
                            f"draft `{d.name}`, {mode}" + (f", gamma {gamma}" if gamma else "")
                            + (f", {speedup:.2f}× plain decoding in the same loop" if speedup else "")))
    return rows


def technique_rows(report: Report) -> list[TechRow]:
    """Every model's technique rows, each model's together: plain decoding, KV cache (and the other batch-1 rows),
    static batching at each batch size, continuous batching at each concurrency level, speculative decoding."""
    timed = [(n, m.speed, list((m.served or {}).values())) for n, m in models(report)]
    if report.draft is not None:
        timed.append((report.draft.name, report.draft.speed, []))
    spec = _speculative_rows(report)
    rows = []
    for name, speed, serve in timed:
        if speed is not None and "skipped" not in speed.model_fields_set:
            rows += _generate_rows(name, speed)
        for one in serve:
            if one.levels:
                rows += _served_rows(name, one)
        rows += [r for r in spec if r.model == name]
    return rows


def techniques_section(report: Report) -> list[str]:
    """report.md's techniques table: one table, a row per model, technique and batch size / concurrency."""
    rows = technique_rows(report)
    if not rows:
        return []
    kv = {r.model: r.tok_s for r in rows if r.technique == KV and r.tok_s}
    body = [[r.model, r.technique, num(r.n), num(r.tok_s, 3), num(r.p99_ms, 3), num(r.ttft_p99_ms, 3),
             num(r.tok_s / kv[r.model], 3) if r.tok_s and r.model in kv else "–", r.kind, r.note] for r in rows]
    kinds = sorted({r.kind for r in rows}, key=list(KIND_NOTES).index)
    lines = ["## Techniques", "", "Output tokens/s of every technique, per model, at batch size / concurrency N "
             "(plotted in `plots/" + TECHNIQUES_PLOT + "`). × KV cache: over the same model's batch-1 KV-cache "
             "decode. Rows a model lacks were not measured for it: plain decoding and the other batch-1 rows "
             "([validate.speed] technique_models), continuous batching ([validate.serve]), speculative decoding "
             "(the [draft] verifier only).", ""]
    lines += [f"- {k}: {KIND_NOTES[k]}" for k in kinds] + [""]
    header = ["model", "technique", "N", "output tok/s", "p99 ms/token", "TTFT p99 ms", "× KV cache", "measured by",
              "note"]
    return lines + table(header, body) + [""]
