"""Task recovery of every variant of a finished run (recipes/methods-tasks.toml: every method of methods.toml plus
bnb-int8, the same seeded items for every model), read from the run folder: per-task and average recovery above
chance against the baseline with the paired interval (a task whose baseline is at chance excluded), bits per weight,
and which 4-bit variant recovers best and whether the paired interval separates it from GPTQ (the two variants
compared item by item on the same items).

    compress run recipes/methods-tasks.toml
    python -m research.tasks_methods artifacts/methods-tasks --out benchmarks/results/tasks_methods.json
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from pipeline.eval.recovery import average_recovery, recoveries

ITEMS = "task_items.json"


def load_items(run_dir: Path) -> dict[str, dict]:
    """{model: its task_items.json} for every model of the run scored on tasks."""
    out = {}
    for folder in sorted((run_dir / "validate").glob("*/tasks")):
        if (folder / ITEMS).is_file():
            out[folder.parent.name] = json.loads((folder / ITEMS).read_text())
    if "baseline" not in out:
        raise SystemExit(f"{run_dir}: no validate/baseline/tasks/{ITEMS}: run the recipe with [validate.tasks] first")
    return out


def metrics_of(report: dict) -> dict[str, str]:
    """{task: the metric recovery is computed on} from the baseline's recorded task results."""
    return {t: r["metric"] for t, r in report["baseline"]["tasks"].items()}


def compare(items: dict[str, dict], metrics: dict[str, str], a: str, b: str) -> dict:
    """b's average over a's on the same items: the ratio, its paired bootstrap interval, and the difference with its
    paired SE; the interval separates them when it excludes 1."""
    pairs = {t: (items[a][t][m], items[b][t][m]) for t, m in metrics.items()}
    for t in metrics:
        if items[a][t]["doc_ids"] != items[b][t]["doc_ids"]:
            raise SystemExit(f"task {t}: {a} and {b} were scored on different items")
    r = average_recovery(pairs)
    return {**r, "separated": bool(r["low"] > 1 or r["high"] < 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    report = json.loads((args.run_dir / "report.json").read_text())
    items, metrics = load_items(args.run_dir), metrics_of(report)
    rows = {}
    for name, v in report["variants"].items():
        if name in items:
            rows[name] = {"method": v.get("method"), "bits_per_weight": v.get("bits_per_weight"),
                          "ppl_ratio": v.get("ppl_ratio"), **recoveries(items["baseline"], items[name], metrics)}
    four = {n: r for n, r in rows.items() if r["bits_per_weight"] and r["bits_per_weight"] < 6}
    four = {n: r for n, r in four.items() if (r.get("average") or {}).get("recovery") is not None}
    best = max(four, key=lambda n: four[n]["average"]["recovery"]) if four else None
    gptq = next((n for n, r in rows.items() if r["method"] == "gptq"), None)
    vs = compare(items, metrics, gptq, best) if best and gptq and best != gptq else None
    n = {t: len(items["baseline"][t]["doc_ids"]) for t in metrics}
    result = {"run": str(args.run_dir), "metrics": metrics, "items": n,
              "baseline": {t: report["baseline"]["tasks"][t]["score"] for t in metrics},
              "variants": rows, "best_4bit": best, "best_4bit_vs_gptq": vs}
    print("| variant | bits/weight | ppl ratio | " + " | ".join(metrics) + " | average recovery [95 % paired] |")
    print("|---|---|---|" + "---|" * len(metrics) + "---|")
    for name, r in rows.items():
        cells = [f"{r['tasks'][t]['recovery']:.3f}" if r["tasks"][t]["recovery"] is not None else "excluded (at chance)"
                 for t in metrics]
        a = r.get("average") or {}
        avg = f"**{a['recovery']:.3f}** [{a['low']:.3f}, {a['high']:.3f}]" if a.get("low") is not None else "-"
        print(f"| {name} | {r['bits_per_weight']:.2f} | {r['ppl_ratio']:.4f} | " + " | ".join(cells) + f" | {avg} |")
    if vs:
        print(f"\nbest 4-bit: {best}; {best} / {gptq} on the same items: {vs['recovery']:.3f} "
              f"[{vs['low']:.3f}, {vs['high']:.3f}], difference {vs['diff']:+.4f} +- {vs['diff_se']:.4f} (SE): "
              + ("separated" if vs["separated"] else "not separated by the interval"))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
