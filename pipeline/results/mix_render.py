"""The mixed-precision section of report.md and of a mixed variant's card: the budget and what was spent, the
predicted and measured quality, and the allocation (bits and group size per decoder layer and block). Reads the
`mix` record a [quantize.mix] variant's quantize unit wrote (pipeline/quant/mix/plan.py summary)."""
from __future__ import annotations

import math
import re

from pipeline.quant.registry import METHODS
from pipeline.results.format import num, table
from pipeline.results.schema import ModelEntry, Report


def mix_of(entry: ModelEntry | None) -> dict | None:
    return (entry.quantize or {}).get("mix") if entry is not None else None


def predicted_kl(report: Report) -> list[tuple[str, float, float]]:
    """(model, predicted KL, measured KL) of every variant a mixed record predicts: the mixed variants (their summed
    sensitivities) and the uniform variants of a mixed record's method whose (bits, group_size) is one of its
    candidates (the candidate's sensitivities summed over every unit). Predicted: RTN probe on calibration rows;
    measured: the variant itself on the evaluation text."""
    records = [(e.method, m) for e in report.variants.values() if (m := mix_of(e))]
    out = []
    for name, e in report.variants.items():
        m = mix_of(e)
        if m is not None:
            pred = m["predicted"]["kl"]
        else:  # a uniform variant: the candidate of its method's mixed record it is, if any
            key = (METHODS.get(e.method).mix_candidate(e.params or {})
                   if e.method is not None and e.method in METHODS else None)
            same = [r for method, r in records if method == e.method and key in r.get("predicted_uniform", {})]
            if key is None or not same:
                continue
            pred = same[0]["predicted_uniform"][key]["kl"]
        if e.kl is not None:
            out.append((name, float(pred), float(e.kl)))
    return out


def pearson(xs: list[float], ys: list[float]) -> float | None:
    n = len(xs)
    if n < 3:
        return None
    mx, my = sum(xs) / n, sum(ys) / n
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True))
    sxx, syy = sum((x - mx) ** 2 for x in xs), sum((y - my) ** 2 for y in ys)
    return sxy / math.sqrt(sxx * syy) if sxx > 0 and syy > 0 else None


def allocation_grid(mix: dict) -> tuple[list[list[dict | None]], list[str]]:
    """(rows: one per decoder layer 0..n-1, each a cell per column: the unit's {"bits", "group_size"} or None;
    the columns: the units of a layer, self_attn and mlp, or each linear)."""
    cells: dict[int, dict[str, dict]] = {}
    for unit, a in mix["allocation"].items():
        m = re.match(r"^[^.]+\.(\d+)\.(.+)$", unit)
        if m:
            cells.setdefault(int(m.group(1)), {})[m.group(2)] = a
    cols = list(dict.fromkeys(c for row in cells.values() for c in row))
    return [[cells.get(i, {}).get(c) for c in cols] for i in range(max(cells) + 1 if cells else 0)], cols


def cell_label(cell: dict) -> str:
    """A unit's setting: its llama.cpp type (a GGUF mix), else w<bits>g<group>."""
    return cell["type"] if "type" in cell else f"w{cell['bits']}g{cell['group_size']}"


def allocation_table(mix: dict) -> list[str]:
    """Rows: decoder layers; columns: the units of a layer (self_attn, mlp, or each linear); cells: w<bits>g<group>
    or the llama.cpp type."""
    rows, cols = allocation_grid(mix)
    body = [[str(i)] + [cell_label(c) if c else "–" for c in row] for i, row in enumerate(rows)]
    return table(["layer", *cols], body)


def budget_line(entry: ModelEntry, mix: dict) -> str:
    b, s = mix["budget"], mix["spent"]
    if "latency_ms_per_token" in b:
        lat = mix.get("latency") or {}
        per_type = ", ".join(f"{t} {num(ms, 4)}" for t, ms in (lat.get("ms") or {}).items())
        as_type = f" (the {b['latency_as']} file's)" if b.get("latency_as") else ""
        return (f"Budget {num(b['latency_ms_per_token'], 4)} ms per token{as_type} in {b.get('engine')} "
                f"({lat.get('threads')} threads; each type's file measured: {per_type} ms per token, median of "
                f"{len(lat.get('rounds') or [])} rounds of {lat.get('tokens')} tokens); predicted "
                f"{num(s.get('latency_ms_per_token'), 4)} ms per token; {served_latency(entry, b)} "
                f"{num(s['bits_per_weight'], 4)} bits per weight ({num(s['bytes'] / 1e6, 4)} MB of decoder linears); "
                f"measured on the file: {num(entry.bits_per_weight, 4)}.")
    return (f"Budget {num(b['bits_per_weight'], 4)} bits per weight ({num(b['bytes'] / 1e6, 4)} MB of decoder "
            f"linears); spent {num(s['bits_per_weight'], 4)} ({num(s['bytes'] / 1e6, 4)} MB); measured on the "
            f"checkpoint: {num(entry.bits_per_weight, 4)}.")


def served_itl_ms(entry: ModelEntry, engine: str) -> float | None:
    """Median time between tokens at concurrency 1 when the serve stage served this model in `engine`, in ms."""
    for s in (entry.served or {}).values():
        if s.engine_name == engine.split(" ")[0] and s.levels:
            one = [lv.itl_p50_s for lv in s.levels if lv.concurrency == 1 and lv.itl_p50_s is not None]
            if one and one[0] is not None:
                return 1000 * float(one[0])
    return None


def served_latency(entry: ModelEntry, budget: dict) -> str:
    ms = served_itl_ms(entry, str(budget.get("engine") or ""))
    if ms is None:
        return "not served in it by this run;"
    over = ms / budget["latency_ms_per_token"] - 1
    verdict = "within the budget" if over <= 0 else f"{100 * over:.1f} % over the budget"
    return f"served there (the serve stage, concurrency 1): {num(ms, 4)} ms between tokens, {verdict};"


def mix_lines(name: str, entry: ModelEntry, mix: dict) -> list[str]:
    sens_t = mix.get("sensitivity_time_s") or {}
    probe = mix.get("probe") or {}
    cached = " (read from the cache: same model, calibration and candidates)" if mix.get("sensitivity_cached") else ""
    probed = ("; KL probed at " + probe["kl_probed"]
              if probe.get("kl_probed", "every candidate") != "every candidate" else "")
    unit = "cells" if str(mix["solver"].get("cost", "")).startswith("latency") else "bytes"
    return [f"### {name}", "",
            f"{budget_line(entry, mix)} Allocation by `{mix['estimator']}` sensitivity per "
            f"{mix['granularity']}, {mix['solver']['kind']}, "
            f"{'exact' if mix['solver']['exact'] else 'exact at a resolution of '}"
            f"{'' if mix['solver']['exact'] else str(mix['solver']['resolution_bytes']) + ' ' + unit}.",
            f"Predicted KL (summed sensitivities, {probe_weights_label(probe)} probe on {probe.get('kl_rows')} "
            f"calibration row(s)"
            f"{probed}) {num(mix['predicted']['kl'])}; measured KL (this checkpoint, evaluation text) "
            f"{num(entry.kl)}. Sensitivity cost: KL probe {num(sens_t.get('kl'), 3)} s, Hessian estimator "
            f"{num(sens_t.get('hessian'), 3)} s{cached}.", ""] + allocation_table(mix) + [""]


def probe_weights_label(probe: dict) -> str:
    """How the record's probe quantized the weights (records before probe_weights: RTN)."""
    if "gguf" in str(probe.get("weights", "")):
        return "llama.cpp-rounded"
    return "GPTQ-solved" if (probe.get("solver") or {}).get("weights") == "gptq" else "RTN"


def mix_section(report: Report) -> list[str]:
    mixed = [(n, e, m) for n, e in report.variants.items() if (m := mix_of(e))]
    if not mixed:
        return []
    lines = ["## Mixed precision", ""]
    rows = predicted_kl(report)
    if rows:
        r = pearson([p for _, p, _ in rows], [k for _, _, k in rows])
        lines += table(["model", "predicted KL (summed, calibration probe)", "measured KL"],
                       [[n, num(p), num(k)] for n, p, k in rows])
        lines += ["", f"Pearson correlation of predicted and measured KL over these {len(rows)} models: "
                      f"{num(r, 3)}.", ""]
    for name, e, m in mixed:
        lines += mix_lines(name, e, m)
    return lines
