"""The figures of `compress run recipes/w8a8.toml` as benchmarks/README_quant.md section 11 prints them: per row the
perplexity, its ratio to the baseline on the same windows, KL and top-1 agreement, quantize time and what vLLM
served; for a SmoothQuant row, the alphas its search chose per fold point and how much they cut the quantized
layer error on the calibration tokens.

    PYTHONPATH=$PWD python -m research.w8a8_summary artifacts/w8a8 --out benchmarks/results/w8a8/summary.json
"""
from __future__ import annotations

import argparse
import json
import statistics
from collections import Counter
from pathlib import Path

FOLD_POINTS = ("input_layernorm", "post_attention_layernorm", "self_attn.v_proj")


def _value(x):
    return x.get("value") if isinstance(x, dict) else x


def smoothing(sq: dict) -> dict:
    out = {"smoothed": sq["smoothed"], "points": sq["points"]}
    for kind in FOLD_POINTS:
        keys = [k for k in sq["alphas"] if k.endswith(kind)]
        errs = [(sq["errors"][k]["none"], min(sq["errors"][k].values())) for k in keys]
        out[kind] = {"alphas": dict(Counter(str(sq["alphas"][k]) for k in keys)),
                     "median_error_unsmoothed": statistics.median(e for e, _ in errs),
                     "median_error_chosen": statistics.median(b for _, b in errs),
                     "mean_error_cut": round(statistics.mean(1 - b / e for e, b in errs if e > 0), 4)}
    return out


def summary(run: Path) -> dict:
    r = json.loads((run / "report.json").read_text())
    rows = {"baseline": {"perplexity": _value(r["baseline"].get("perplexity"))}}
    for name, v in r["variants"].items():
        q = v.get("quantize") or {}
        row = {"method": v["method"], "scheme": v["params"].get("scheme"), "perplexity": _value(v.get("perplexity")),
               "ppl_ratio": v.get("ppl_ratio"), "kl": v.get("kl"), "top1": v.get("top1"),
               "quantize_time_s": v.get("quantize_time_s"), "served": v.get("served")}
        if q.get("smoothquant"):
            row["smoothquant"] = smoothing(q["smoothquant"])
        rows[name] = row
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run", type=Path)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    rows = summary(a.run)
    for name, row in rows.items():
        keep = {k: row.get(k) for k in ("perplexity", "ppl_ratio", "kl", "top1", "quantize_time_s")}
        cells = (f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in keep.items())
        print(f"{name:18s} " + " ".join(cells))
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(rows, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
