"""Render report.json into report.md and plots/*.png (no recomputation; any section may be missing).

`render_report(run_dir)` is what `compress report artifacts/<run>` and the runner call after each
stage. A run in progress has null or absent sections: those tables say "not measured yet".
"""
from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pipeline.base.fileio import atomic_write_text
from pipeline.eval.measures import all_measurements
from pipeline.results import schema
from pipeline.results.card import render_cards
from pipeline.results.coverage_render import coverage_section
from pipeline.results.format import FP_DISTILLED, num, size, speculative_label, spread, table
from pipeline.results.gates import fmt_value, gate_status
from pipeline.results.metrics import Smoke, SmokeOutput, Speed
from pipeline.results.mix_render import mix_section
from pipeline.results.plots import write_plots
from pipeline.results.query import is_distilled, models, planned, shown_params
from pipeline.results.schema import ModelEntry, ModelInfo, Report
from pipeline.results.serve_table import serving, techniques_section


def baseline_label(report: Report) -> str:
    model = report.model or ModelInfo()
    bits = [b for b in (model.dtype, model.provenance) if b]
    if model.random_init:
        bits.append("RANDOM INIT: figures say nothing about quality")
    return "baseline" + (f" ({'; '.join(bits)})" if bits else "")


# ---------------------------------------------------------------- sections
def _header(report: Report) -> list[str]:
    run, model = report.run, report.model or ModelInfo()
    lines = [f"# compress report: {run.name}", ""]
    lines += [f"- status: **{run.status}** (exit code {num(run.exit_code)})",
              f"- recipe: `{run.recipe}`; seed {num(run.seed)}; device {run.device}",
              f"- started {run.started}, finished {run.finished or 'not yet'}",
              f"- model: `{model.source or '?'}` ({model.architecture or '?'}, "
              f"{num(model.parameters)} parameters, {model.dtype or '?'}); "
              f"provenance: {model.provenance or 'as published'}; license: {model.license or 'unknown'}"]
    lines += _failures(report)
    if model.random_init:
        lines.append("- **the model is randomly initialised: quality figures are meaningless, only the plumbing is "
                     "tested**")
    if report.calibration is not None:
        calib = report.calibration.model_dump()
        shown = {k: v for k, v in calib.items() if isinstance(v, (str, int, float)) and not isinstance(v, bool)}
        if shown:
            lines.append("- calibration: " + ", ".join(f"{k}={v}" for k, v in list(shown.items())[:6]))
    if run.versions:
        lines.append("- versions: " + ", ".join(f"{k} {v}" for k, v in run.versions.items()))
    return lines + ["", f"Schema version {report.schema_version}. Plots are in `plots/`.", ""]


def _failures(report: Report) -> list[str]:
    """The units that failed (each with its error line) and how many did not run because of them."""
    failed = {k: s.error for k, s in report.stages.items() if s.status == "failed"}
    blocked = [k for k, s in report.stages.items() if s.status == "blocked"]
    lines = [f"- **failed: `{k}`**: {e}" for k, e in failed.items()]
    if blocked:
        lines.append(f"- not run because an upstream unit failed: {', '.join(f'`{k}`' for k in blocked)}")
    return lines


def _quality(report: Report) -> list[str]:
    lines = ["## Quality", ""]
    rows = models(report)
    if not rows:
        return lines + ["Not measured yet.", ""]
    protocol = report.baseline.perplexity if report.baseline else None
    if protocol:
        lines += [f"Perplexity protocol: {protocol.given('protocol', '?')} on {protocol.given('dataset', '?')}, "
                  f"{num(protocol.tokens)} tokens, {num(protocol.windows)} windows of "
                  f"{num(protocol.window)} (stride {num(protocol.stride)}). "
                  "KL and top-1 agreement are against the baseline on the same tokens.", ""]
    base_failed = _failed_prompts(report.baseline)
    body = []
    for name, m in rows:
        base = name == "baseline"
        body.append([baseline_label(report) if base else name, "–" if base else m.method or "–", _params(m.params),
                     num(m.perplexity.value if m.perplexity else None), num(1.0 if base else m.ppl_ratio),
                     num(m.kl), num(m.top1), _smoke(m.smoke, set() if base else base_failed)])
    lines += table(["model", "method", "params", "perplexity", "ppl ratio", "KL", "top-1", "smoke"], body) + [""]
    how = [f"{name}: {m.compute}" + (f", {size(m.offload.in_memory_bytes)} of its weights in memory, the rest "
                                     "read from disk at each forward (the memory limit)" if m.offload else "")
           for name, m in rows if m.compute or m.offload]
    if how:
        lines += ["Computed in: " + "; ".join(how) + ".", ""]
    return lines + _smoke_notes(rows, base_failed)


def _params(p: Any) -> str:
    return ", ".join(f"{k}={v}" for k, v in shown_params(p, ("name", "method", "modules_to_skip")).items()) or "–"


def _outputs(s: Smoke | None) -> list[SmokeOutput]:
    """A smoke result's per-prompt outputs (an old single-output result is its own one output)."""
    return s.all_outputs() if s is not None else []


def _bad(o: SmokeOutput) -> bool:
    return not o.given("ok", True)


def _failed_prompts(entry: ModelEntry | None) -> set:
    return {o.prompt for o in _outputs(entry.smoke if entry else None) if _bad(o)}


def _smoke(s: Smoke | None, base_failed: set) -> str:
    """ok, or FAILED with how many prompts failed and how many of those the baseline failed as well (the smoke
    gate does not count those against a variant), then the first failure's problem and text."""
    outputs = _outputs(s)
    if s is None or not outputs:
        return "–"
    bad = [o for o in outputs if _bad(o)]
    first = bad[0] if bad else outputs[0]
    text = (first.text or "").replace("\n", " ").replace("|", "\\|")[:60]
    problem = f" ({first.problem})" if first.problem else ""
    if s.ok and not bad:
        return f"ok{problem}: “{text}”"
    count = f" {len(bad)} of {len(outputs)}" if len(outputs) > 1 and bad else ""
    shared = sum(1 for o in bad if o.prompt in base_failed)
    excused = f", {shared} also failed by the baseline" if shared else ""
    return f"FAILED{count}{excused}{problem}: “{text}”"


def _smoke_notes(rows: list[tuple[str, ModelEntry]], base_failed: set) -> list[str]:
    raw = [name for name, m in rows if m.smoke is not None and m.smoke.chat_template is False]
    lines = []
    if raw:
        lines.append(f"Smoke test: {', '.join(f'`{n}`' for n in raw)} had no chat template: the smoke prompts were "
                     "sent as raw text (a base model may continue them rather than answer).")
    if base_failed:
        lines.append(f"The baseline itself failed {len(base_failed)} smoke prompt(s); the smoke gate does not count "
                     "those prompts against the variants (the smoke column still shows them).")
    return lines + [""] if lines else []


def _size(report: Report) -> list[str]:
    lines = ["## Size", ""]
    rows = models(report)
    base_fp = (report.baseline and report.baseline.footprint_bytes) or (report.model and report.model.footprint_bytes)
    if not rows:
        return lines + ["Not measured yet.", ""]
    body = []
    for name, m in rows:
        ratio = m.footprint_bytes / base_fp if base_fp and m.footprint_bytes else None
        runtimes = "; ".join(f"{r.get('runtime')}: {r.get('kernel') or '–'}" for r in m.runtimes)
        body.append([name, size(m.size_on_disk_bytes), num(m.bits_per_weight, 3), size(m.footprint_bytes),
                     num(ratio, 3), num(m.quantize_time_s, 3), runtimes or "–"])
    return lines + table(["model", "on disk", "bits/weight", "in memory", "footprint ratio", "quantize s", "runtimes"],
                         body) + ["", "bits/weight: the decoder blocks' linear layers as stored (quantized values, "
                                  "scales, zero points, skipped layers at their float size).", ""]


def _timed(report: Report) -> list[tuple[str, Speed]]:
    timed = [(n, m.speed) for n, m in models(report)
             if m.speed is not None and "skipped" not in m.speed.model_fields_set]
    if report.draft is not None and report.draft.speed is not None:
        timed.append((report.draft.name, report.draft.speed))
    return timed


def _speed(report: Report) -> list[str]:
    lines = ["## Speed", ""]
    timed = _timed(report)
    untimed = [f"- {n}: {m.speed.skipped}" for n, m in models(report) if m.speed is not None
               and "skipped" in m.speed.model_fields_set]
    if untimed:
        lines += ["Not timed:", ""] + untimed + [""]
    if not timed:
        return lines + ([] if untimed else ["Not measured (speed disabled, or not run yet).", ""])
    first = timed[0][1]
    lines += [f"{first.given('device_name', first.given('device', '?'))}, prompt {num(first.prompt_len)} tokens, "
              f"{num(first.new_tokens)} new tokens, median of {num(first.repeats)} runs after "
              f"{num(first.warmup)} warm-up (min–max in brackets). Peak memory is above the "
              "post-import baseline of a fresh process.", ""]
    body = []
    for name, s in timed:
        mb = s.max_batch
        body.append([name, spread(s.prefill_tokens_per_s), num(_ms(s.ttft_s.median if s.ttft_s else None), 3),
                     spread(s.decode_at(1)), f"{spread(s.decode_at(mb))} @{mb}" if mb and mb != 1 else "–",
                     size(s.peak_memory_bytes), num(s.roofline_fraction, 3), num(s.kv_cache_speedup, 3)])
    lines += table(["model", "prefill tok/s", "TTFT ms", "decode tok/s b1", "decode tok/s batch",
                    "peak memory", "roofline", "KV speed-up"], body) + [""]
    bw = [s.copy_bandwidth_bytes_per_s for _, s in timed if s.copy_bandwidth_bytes_per_s]
    if bw:
        lines += [f"Roofline = weight bytes read per token / time per token, over the copy bandwidth measured in "
                  f"each model's process ({min(bw) / 1e9:.3g}–{max(bw) / 1e9:.3g} GB/s, read + write bytes).", ""]
    prefill = [[name, t, spread(r.prefill_tokens_per_s)] for name, s in timed
               for t, r in (s.techniques or {}).items() if r.prefill_tokens_per_s]
    if prefill:  # attention kernels also time prefill; their decode rows are in the techniques table
        lines += ["Prefill tok/s by attention kernel (batch 1):", ""]
        lines += table(["model", "technique", "prefill tok/s"], prefill) + [""]
    return lines


def _ms(v: Any) -> float | None:
    return v * 1000 if isinstance(v, (int, float)) else None


def _speculative(report: Report) -> list[str]:
    lines = ["## Speculative decoding", ""]
    draft = report.draft
    if draft is None:
        return lines + ["No draft in this run (or not distilled yet).", ""]
    verifier = draft.verifier or "?"
    head = f", {num(draft.vocab_size)}-token head" if draft.vocab_size else ", full-vocabulary head"
    what = f"`{draft.source}`" if draft.source else f"verifier layers {draft.layers or '?'}"
    trained = "" if is_distilled(draft) else ", not distilled ([draft.distill] steps = 0)"
    dtype = f", {draft.dtype} weights" if draft.dtype not in (None, "float32") else ""
    lines += [f"Draft `{draft.name}` ({what}{head}{dtype}{trained}) for verifier "
              f"`{verifier}`. Speed-up is over plain decoding with the verifier in the same run.", ""]
    modes = draft.speculative or {}
    body = [[speculative_label(mode, verifier), num(s.alpha, 3), num(s.tokens_per_target_forward, 3),
             num(s.speedup, 3), num(s.tokens_per_s, 3), num(s.c_d, 3), num(s.c_v, 3),
             num(s.break_even_alpha, 3), num(s.repetition_rate, 3)]
            for mode, s in modes.items()]
    if not body:
        return lines + ["Not measured yet.", ""]
    lines += table(["mode", "acceptance α", "tokens / target fwd", "speed-up", "tok/s", "c_d", "c_v",
                    "break-even α", "repetition"], body) + [""]
    if any(m.startswith(FP_DISTILLED + " ") for m in modes):
        lines += [f"{FP_DISTILLED} rows: a draft with the same settings and budget distilled against the "
                  f"full-precision baseline instead of `{verifier}`, measured with `{verifier}` on the same prompts "
                  f"(`draft/{FP_DISTILLED}`, not exported) — what distilling against the quantized verifier buys.", ""]
    return lines


def _gates(report: Report) -> list[str]:
    lines = ["## Gates", ""]
    if not report.gates:
        return lines + ["No gates evaluated.", ""]
    body = [[g.model, g.gate, fmt_value(g.value), f"{g.op} {fmt_value(g.bound)}", f"**{gate_status(g)}**", g.reason]
            for g in report.gates]
    return lines + table(["model", "gate", "value", "bound", "result", "note"], body) + [""]


def _stages(report: Report) -> list[str]:
    lines = ["## Stages", ""]
    if not report.stages:
        return lines + ["No stage has run yet.", ""]
    predicted = report.run.predicted_peak_bytes
    body = []
    for n, s in report.stages.items():
        guess = planned(predicted, n)
        off = " (offloaded)" if planned(dict.fromkeys(report.run.offloaded, 1), n) else ""
        body.append([n, s.status, num(s.time_s, 3), size(s.peak_rss_bytes),
                     (size(guess) + off) if guess is not None else "-",
                     f"{s.peak_rss_bytes / guess:.2f}" if guess and s.status == "done" else "-"])
    limit = report.run.memory_limit_bytes
    note = (["Peak RSS is the largest resident set of the stage's process or worker; predicted is `compress check`'s "
             "estimate" + (f"; the limit ([run] max_memory_gb) is {size(limit)}." if limit else "."), ""])
    head = ["stage", "status", "time s", "peak RSS", "predicted", "measured/predicted"]
    if any(s.node for s in report.stages.values()):  # executor = "ray": the node that ran each unit
        head, body = head + ["node"], [row + [s.node or "-"]
                                       for row, s in zip(body, report.stages.values(), strict=True)]
    return lines + note + table(head, body) + [""]


def _exports(report: Report) -> list[str]:
    if not report.exports:
        return []
    body = [[n, f"`{e.folder}`", num(len(e.files))] for n, e in report.exports.items()]
    tail = [f"Publish: {report.publish.status}", ""] if report.publish else []
    return ["## Exports", ""] + table(["name", "folder", "files"], body) + [""] + tail


def render_module(key: str) -> str:
    """The module of a plug-in measurement's report.md section (its declaration says `renders`): `section(report)`
    in pipeline/results/<key>_render.py, imported by name so that its declaration names no report code (a
    measuring unit's identity holds none)."""
    return f"pipeline.results.{key}_render"


def measurement_sections() -> list[Callable[[Report], list[str]]]:
    """The plug-in measurements' report.md sections, in their registry's order (after the quality table)."""
    return [importlib.import_module(render_module(m.key)).section for m in all_measurements() if m.renders]


def render_markdown(report: Report, plots: list[str]) -> str:
    lines: list[str] = []

    for section in (_header, _quality, *measurement_sections(), mix_section, coverage_section, _size, _speed,
                    _speculative, serving, techniques_section, _gates, _stages, _exports):
        lines += section(report)
    lines += ["## Plots", ""] + ([f"![{p}](plots/{p})" for p in plots] or ["No data to plot yet."])
    return "\n".join(lines) + "\n"


def render_report(run_dir: Path) -> None:
    """Write report.md, plots/*.png and the model cards of existing export folders from
    run_dir/report.json and recipe.lock.toml (nothing is recomputed)."""
    run_dir = Path(run_dir)
    report = schema.load(run_dir)
    plots = write_plots(report, run_dir / "plots")
    atomic_write_text(run_dir / "report.md", render_markdown(report, plots))
    render_cards(run_dir, report)
