"""Render report.json into report.md and plots/*.png (no recomputation; any section may be missing).

`render_report(run_dir)` is what `compress report artifacts/<run>` and the runner call after each
stage. A run in progress has null or absent sections: those tables say "not measured yet".
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from pipeline.results.query import dig, is_distilled, models, shown_params

PLOTS = {
    "frontier": "ppl_vs_size.png",
    "decode": "decode_tokens_per_s.png",
    "acceptance": "acceptance_by_position.png",
}


# ---------------------------------------------------------------- formatting
def sig(v: float, digits: int) -> str:
    """`digits` significant digits, without an exponent for large numbers (47,345 not 4.735e+04)."""
    if abs(v) >= 10**digits:
        return f"{v:,.0f}"
    return f"{v:.{digits}g}"


def num(v: Any, digits: int = 4) -> str:
    if v is None:
        return "–"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, (int, float)):
        return sig(v, digits) if isinstance(v, float) else f"{v:,}"
    return str(v)


def size(v: Any) -> str:
    if not isinstance(v, (int, float)):
        return "–"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if v >= scale:
            return f"{v / scale:.3g} {unit}"
    return f"{int(v)} B"


def spread(stats: Any, digits: int = 3) -> str:
    """median (min–max) of a summarize() dict."""
    if not isinstance(stats, dict) or stats.get("median") is None:
        return num(stats, digits) if isinstance(stats, (int, float)) else "–"
    return (f"{sig(stats['median'], digits)} ({sig(stats.get('min', 0), digits)}–"
            f"{sig(stats.get('max', 0), digits)})")


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return out + ["| " + " | ".join(str(c).replace("|", "\\|") for c in r) + " |" for r in rows]


def baseline_label(report: dict) -> str:
    model = report.get("model") or {}
    bits = [b for b in (model.get("dtype"), model.get("provenance")) if b]
    if model.get("random_init"):
        bits.append("RANDOM INIT: figures say nothing about quality")
    return "baseline" + (f" ({'; '.join(bits)})" if bits else "")


# ---------------------------------------------------------------- sections
def _header(report: dict) -> list[str]:
    run, model = report.get("run") or {}, report.get("model") or {}
    lines = [f"# compress report: {run.get('name', '?')}", ""]
    lines += [f"- status: **{run.get('status', 'unknown')}** (exit code {num(run.get('exit_code'))})",
              f"- recipe: `{run.get('recipe', '?')}`; seed {num(run.get('seed'))}; device {run.get('device', '?')}",
              f"- started {run.get('started', '?')}, finished {run.get('finished') or 'not yet'}",
              f"- model: `{model.get('source', '?')}` ({model.get('architecture', '?')}, "
              f"{num(model.get('parameters'))} parameters, {model.get('dtype', '?')}); "
              f"provenance: {model.get('provenance') or 'as published'}; license: {model.get('license') or 'unknown'}"]
    if model.get("random_init"):
        lines.append("- **the model is randomly initialised: quality figures are meaningless, only the plumbing is tested**")
    calib = report.get("calibration")
    if isinstance(calib, dict) and calib:
        shown = {k: v for k, v in calib.items() if isinstance(v, (str, int, float)) and not isinstance(v, bool)}
        lines.append("- calibration: " + ", ".join(f"{k}={v}" for k, v in list(shown.items())[:6]))
    versions = run.get("versions") or {}
    if versions:
        lines.append("- versions: " + ", ".join(f"{k} {v}" for k, v in versions.items()))
    return lines + ["", f"Schema version {report.get('schema_version', '?')}. Plots are in `plots/`.", ""]


def _quality(report: dict) -> list[str]:
    lines = ["## Quality", ""]
    rows = models(report)
    if not rows:
        return lines + ["Not measured yet.", ""]
    protocol = dig(report, "baseline", "perplexity") or {}
    if protocol:
        lines += [f"Perplexity protocol: {protocol.get('protocol', '?')} on {protocol.get('dataset', '?')}, "
                  f"{num(protocol.get('tokens'))} tokens, {num(protocol.get('windows'))} windows of "
                  f"{num(protocol.get('window'))} (stride {num(protocol.get('stride'))}). "
                  "KL and top-1 agreement are against the baseline on the same tokens.", ""]
    body = []
    for name, m in rows:
        label = baseline_label(report) if name == "baseline" else name
        body.append([label, m.get("method", "–") if name != "baseline" else "–", _params(m.get("params")),
                     num(dig(m, "perplexity", "value")), num(m.get("ppl_ratio") if name != "baseline" else 1.0),
                     num(m.get("kl")), num(m.get("top1")), _smoke(m.get("smoke"))])
    return lines + table(["model", "method", "params", "perplexity", "ppl ratio", "KL", "top-1", "smoke"], body) + [""]


def _params(p: Any) -> str:
    return ", ".join(f"{k}={v}" for k, v in shown_params(p, ("name", "method", "modules_to_skip")).items()) or "–"


def _smoke(s: Any) -> str:
    if not isinstance(s, dict):
        return "–"
    outputs = s.get("outputs") or [s]
    first = next((o for o in outputs if not o.get("ok", True)), outputs[0]) if outputs else {}
    text = (first.get("text") or "").replace("\n", " ").replace("|", "\\|")[:60]
    problem = f" ({first['problem']})" if first.get("problem") else ""
    return f"{'ok' if s.get('ok') else 'FAILED'}{problem}: “{text}”"


def _size(report: dict) -> list[str]:
    lines = ["## Size", ""]
    base = models(report)
    base_fp = dig(report, "baseline", "footprint_bytes") or dig(report, "model", "footprint_bytes")
    if not base:
        return lines + ["Not measured yet.", ""]
    body = []
    for name, m in base:
        ratio = m["footprint_bytes"] / base_fp if base_fp and m.get("footprint_bytes") else None
        runtimes = "; ".join(f"{r.get('runtime')}: {r.get('kernel') or '–'}" for r in m.get("runtimes") or [])
        body.append([name, size(m.get("size_on_disk_bytes")), size(m.get("footprint_bytes")), num(ratio, 3),
                     num(m.get("quantize_time_s"), 3), runtimes or "–"])
    return lines + table(["model", "on disk", "in memory", "footprint ratio", "quantize s", "runtimes"], body) + [""]


def _speed(report: dict) -> list[str]:
    lines = ["## Speed", ""]
    timed = [(n, m["speed"]) for n, m in models(report) if isinstance(m.get("speed"), dict)]
    if isinstance(dig(report, "draft", "speed"), dict):
        timed.append((report["draft"].get("name", "draft"), report["draft"]["speed"]))
    if not timed:
        return lines + ["Not measured (speed disabled, or not run yet).", ""]
    first = timed[0][1]
    lines += [f"{first.get('device_name', first.get('device', '?'))}, prompt {num(first.get('prompt_len'))} tokens, "
              f"{num(first.get('new_tokens'))} new tokens, median of {num(first.get('repeats'))} runs after "
              f"{num(first.get('warmup'))} warm-up (min–max in brackets). Peak memory is above the "
              "post-import baseline of a fresh process.", ""]
    body = []
    for name, s in timed:
        mb = s.get("max_batch")
        body.append([name, spread(s.get("prefill_tokens_per_s")), num(_ms(dig(s, "ttft_s", "median")), 3),
                     spread(dig(s, "decode", "1", "tokens_per_s")),
                     f"{spread(dig(s, 'decode', str(mb), 'tokens_per_s'))} @{mb}" if mb and mb != 1 else "–",
                     size(s.get("peak_memory_bytes")), num(s.get("roofline_fraction"), 3),
                     num(s.get("kv_cache_speedup"), 3)])
    lines += table(["model", "prefill tok/s", "TTFT ms", "decode tok/s b1", "decode tok/s batch",
                    "peak memory", "roofline", "KV speed-up"], body) + [""]
    bw = [s["copy_bandwidth_bytes_per_s"] for _, s in timed if s.get("copy_bandwidth_bytes_per_s")]
    if bw:
        lines += [f"Roofline = weight bytes read per token / time per token, over the copy bandwidth measured in "
                  f"each model's process ({min(bw) / 1e9:.3g}–{max(bw) / 1e9:.3g} GB/s, read + write bytes).", ""]
    rows = [[name, t, spread(r.get("decode_tokens_per_s")), spread(r.get("prefill_tokens_per_s")),
             num(r.get("speedup_vs_kv_cache"), 3), r.get("skipped") or r.get("error") or r.get("note") or ""]
            for name, s in timed for t, r in (s.get("techniques") or {}).items() if isinstance(r, dict)]
    if rows:
        lines += ["Techniques (batch 1):", ""]
        lines += table(["model", "technique", "decode tok/s", "prefill tok/s", "vs KV cache", "note"], rows) + [""]
    return lines


def _ms(v: Any) -> float | None:
    return v * 1000 if isinstance(v, (int, float)) else None


FP_DISTILLED = "fp-distilled"  # prefix of the rows of the draft distilled against the full-precision model


def speculative_label(mode: str, verifier: Any) -> str:
    """A speculative row's name, saying what its draft is when it is not the distilled draft itself."""
    if mode.startswith(FP_DISTILLED + " "):
        return f"{mode} (distilled against baseline, verified by {verifier or '?'})"
    return mode


def _speculative(report: dict) -> list[str]:
    lines = ["## Speculative decoding", ""]
    draft = report.get("draft")
    if not isinstance(draft, dict):
        return lines + ["No draft in this run (or not distilled yet).", ""]
    verifier = draft.get("verifier", "?")
    head = f", {num(draft['vocab_size'])}-token head" if draft.get("vocab_size") else ", full-vocabulary head"
    what = f"`{draft['source']}`" if draft.get("source") else f"verifier layers {draft.get('layers', '?')}"
    trained = "" if is_distilled(draft) else ", not distilled ([draft.distill] steps = 0)"
    dtype = f", {draft['dtype']} weights" if draft.get("dtype") not in (None, "float32") else ""
    lines += [f"Draft `{draft.get('name', '?')}` ({what}{head}{dtype}{trained}) for verifier "
              f"`{verifier}`. Speed-up is over plain decoding with the verifier in the same run.", ""]
    body = []
    modes = draft.get("speculative") or {}
    for mode, s in modes.items():
        if isinstance(s, dict):
            body.append([speculative_label(mode, verifier), num(s.get("alpha"), 3),
                         num(s.get("tokens_per_target_forward"), 3), num(s.get("speedup"), 3), num(s.get("tokens_per_s"), 3), num(s.get("c_d"), 3),
                         num(s.get("c_v"), 3), num(s.get("break_even_alpha"), 3), num(s.get("repetition_rate"), 3)])
    if not body:
        return lines + ["Not measured yet.", ""]
    lines += table(["mode", "acceptance α", "tokens / target fwd", "speed-up", "tok/s", "c_d", "c_v",
                    "break-even α", "repetition"], body) + [""]
    if any(m.startswith(FP_DISTILLED + " ") for m in modes):
        lines += [f"{FP_DISTILLED} rows: a draft with the same settings and budget distilled against the "
                  f"full-precision baseline instead of `{verifier}`, measured with `{verifier}` on the same prompts "
                  f"(`draft/{FP_DISTILLED}`, not exported) — what distilling against the quantized verifier buys.", ""]
    return lines


def _gates(report: dict) -> list[str]:
    lines = ["## Gates", ""]
    from pipeline.results.gates import fmt_value, gate_status
    from pipeline.results.schema import Gate

    gates = [Gate.model_validate(g) for g in report.get("gates") or []]
    if not gates:
        return lines + ["No gates evaluated.", ""]
    body = [[g.model, g.gate, fmt_value(g.value), f"{g.op} {fmt_value(g.bound)}", f"**{gate_status(g)}**", g.reason]
            for g in gates]
    return lines + table(["model", "gate", "value", "bound", "result", "note"], body) + [""]


def _stages(report: dict) -> list[str]:
    lines = ["## Stages", ""]
    stages = report.get("stages") or {}
    if not stages:
        return lines + ["No stage has run yet.", ""]
    body = [[n, (s or {}).get("status", "?"), num((s or {}).get("time_s"), 3), size((s or {}).get("peak_rss_bytes"))]
            for n, s in stages.items()]
    return lines + table(["stage", "status", "time s", "peak RSS"], body) + [""]


def _exports(report: dict) -> list[str]:
    exports = report.get("exports") or {}
    if not exports:
        return []
    body = [[n, f"`{(e or {}).get('folder', '?')}`", num(len((e or {}).get("files") or {}))] for n, e in exports.items()]
    publish = report.get("publish")
    tail = [f"Publish: {publish.get('status', publish) if isinstance(publish, dict) else publish}", ""] if publish else []
    return ["## Exports", ""] + table(["name", "folder", "files"], body) + [""] + tail


def render_markdown(report: dict, plots: list[str]) -> str:
    lines: list[str] = []
    for section in (_header, _quality, _size, _speed, _speculative, _gates, _stages, _exports):
        lines += section(report)
    lines += ["## Plots", ""] + ([f"![{p}](plots/{p})" for p in plots] or ["No data to plot yet."])
    return "\n".join(lines) + "\n"


def render_report(run_dir: Path) -> None:
    """Write report.md, plots/*.png and the model cards of existing export folders from
    run_dir/report.json and recipe.lock.toml (nothing is recomputed)."""
    from pipeline.fileio import atomic_write_text
    from pipeline.results import schema
    from pipeline.results.card import render_cards
    from pipeline.results.plots import write_plots

    run_dir = Path(run_dir)
    report = schema.load(run_dir).to_dict()
    plots = write_plots(report, run_dir / "plots")
    atomic_write_text(run_dir / "report.md", render_markdown(report, plots))
    render_cards(run_dir, report)
