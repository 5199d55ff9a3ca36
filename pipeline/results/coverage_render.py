"""Calibration coverage per expert in report.md (a heat map: MoE layer x expert, tokens routed to each) and the
one line the model card and report.md say about it; read from report.json's calibration.expert_coverage."""
from __future__ import annotations

from pipeline.results.format import table
from pipeline.results.gates import calibrates
from pipeline.results.schema import ExpertCoverage, ModelEntry, Report

SHADES = "▁▂▃▄▅▆▇█"  # a cell's count against an even split (tokens x top_k / experts): ▄ about even, █ twice or more
WIDE = 16  # more experts than this: one summary row per layer instead of a column per expert


def _shade(n: int, even: float) -> str:
    if n == 0:
        return "**0**"
    level = min(len(SHADES) - 1, round(n / even * (len(SHADES) - 1) / 2)) if even else 0
    return f"{n} {SHADES[level]}"


def heat_map(cov: ExpertCoverage) -> list[str]:
    """The table: one row per MoE layer, one column per expert (or, for many experts, the fewest/median/most)."""
    even = cov.tokens * cov.top_k / cov.num_experts if cov.num_experts else 0.0
    if cov.num_experts <= WIDE:
        body = [[str(layer)] + [_shade(n, even) for n in row]
                for layer, row in zip(cov.layers, cov.counts, strict=True)]
        return table(["layer"] + [f"e{e}" for e in range(cov.num_experts)], body)
    body = []
    for layer, row in zip(cov.layers, cov.counts, strict=True):
        order = sorted(range(len(row)), key=row.__getitem__)
        body.append([str(layer), f"{row[order[0]]} (e{order[0]})", str(row[order[len(row) // 2]]),
                     f"{row[order[-1]]} (e{order[-1]})", str(sum(1 for n in row if n == 0))])
    return table(["layer", "fewest", "median", "most", "experts with 0"], body)


def coverage_line(report: Report, entry: ModelEntry) -> str | None:
    """One sentence on what the variant's calibration gave each expert; None for a dense model or a variant that
    reads no calibration rows."""
    cal = report.calibration
    cov = cal.expert_coverage if cal else None
    if cal is None or cov is None or not calibrates(entry):
        return None
    grid = f"{cov.num_experts} experts x {len(cov.layers)} MoE layer(s)"
    if (entry.params or {}).get("moe_all_experts"):
        rows = min((entry.params or {}).get("calibration_rows") or cal.num_samples or 0, cal.num_samples or 0)
        return (f"calibration coverage: every one of {grid} calibrated on all {rows * (cal.seq_len or 0)} calibration "
                f"tokens (moe_all_experts; routed, the fewest would have been {cov.least()})")
    empty = cov.starved(1)
    if empty:
        named = "; ".join(f"layer {layer}: expert{'s' if len(ex) > 1 else ''} {', '.join(map(str, ex))}"
                          for layer, ex in empty)
        return (f"calibration coverage: {sum(len(ex) for _, ex in empty)} of {grid} got no calibration token "
                f"({named}); their quantization had no data from them")
    return (f"calibration coverage: every one of {grid} saw >= {cov.least()} of the {cov.tokens} calibration tokens "
            f"(top-{cov.top_k} routing, counted through the baseline)")


def coverage_section(report: Report) -> list[str]:
    cov = report.calibration.expert_coverage if report.calibration else None
    if cov is None:
        return []
    lines = ["## Calibration coverage per expert", "",
             f"Calibration tokens routed to each expert of each Mixture-of-Experts layer: the {cov.tokens} calibration "
             f"tokens through the baseline, top-{cov.top_k} of {cov.num_experts} experts, so a layer's counts sum to "
             f"{cov.tokens * cov.top_k} (an even split is {cov.tokens * cov.top_k / cov.num_experts:.4g} per expert, "
             "shown ▄; **0**: no token). GPTQ routes the tokens through the attention and layers it has already "
             "quantized, so the counts its experts saw can differ from these by a few tokens.", ""]
    lines += heat_map(cov) + [""]
    said = [f"- {name}: {line}" for name, e in report.variants.items() if (line := coverage_line(report, e))]
    return lines + (said + [""] if said else [])
