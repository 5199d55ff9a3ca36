"""vLLM's two CPU paths for a 4-bit checkpoint, side by side on the same export, prompts and windows (issue #42):
W4A8 (int8-quantized activations) and W4A16 (16-bit activations: what the run scores in process).

    python -m research.w4a8_paths --recipe benchmarks/recipes/w4a8-zen.toml --repeats 2 \
        --out benchmarks/results/w4a8-zen.json

Runs the recipe once per (path, repeat), alternating W4A8 and W4A16 (`--set validate.serve.engine_options=...`):
after the first run only the vLLM serve unit reruns, since the choice is part of its identity and of nothing else.
From each run's report.json it keeps what the serve record states (int8_activations: which path vLLM took, its
kernels and dtype), the output tokens/s at each concurrency, the served perplexity and its ratios (to the in-process
figure and to the baseline), greedy agreement with generate, errors, and the max_ppl_ratio verdict on the served
model. Exit 5 of a run (a gate failed) is a result, not an error. With --without-zentorch it then uninstalls zentorch
from vLLM's environment and serves W4A16 once more (vLLM's own CPU kernel, cpu_gemm_wna16): what zentorch buys.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import tomllib
from pathlib import Path

from pipeline.serve.engines.vllm import VENV, zentorch


def run(recipe: str, int8: bool, log: Path) -> dict:
    """One `compress run` with the choice set; its report.json's entry for the served variant."""
    opt = "validate.serve.engine_options={vllm = {int8_activations = %s}}" % ("true" if int8 else "false")
    t0 = time.monotonic()
    with log.open("w") as f:
        rc = subprocess.call([str(Path(sys.executable).parent / "compress"), "run", recipe, "--set", opt],
                             stdout=f, stderr=subprocess.STDOUT)
    if rc not in (0, 5):
        raise SystemExit(f"compress run exited {rc}: see {log}")
    report = json.loads((Path("artifacts") / run_name(recipe) / "report.json").read_text())
    base = report["baseline"]["perplexity"]["value"]
    (variant, v), = ((n, v) for n, v in report["variants"].items() if (v.get("served") or {}).get("vllm"))
    s = v["served"]["vllm"]
    gate = [g for g in report.get("gates", []) if g.get("model") == variant and g["gate"] == "max_ppl_ratio"
            and g.get("metric") == "ppl_ratio[served: vllm]"]
    return {
        "variant": variant, "asked_int8_activations": int8, "exit_code": rc,
        "wall_s": round(time.monotonic() - t0, 1), "int8_activations": s.get("int8_activations"),
        "kernels": s.get("kernels"), "served_dtype": s.get("served_dtype"),
        "engine_version": s.get("versions"),
        "output_tok_s": {str(lv["concurrency"]): lv["output_tok_s"] for lv in s["levels"]},
        "errors": sum(lv["errors"] for lv in s["levels"]),
        "greedy_equal": f"{s['equality']['identical']}/{s['equality']['prompts']}",
        "served_ppl": s["perplexity"]["value"], "in_process_ppl": s["perplexity"]["in_process"],
        "served_over_in_process": s["perplexity"]["ratio"], "baseline_ppl": base,
        "served_ppl_ratio": s["perplexity"]["value"] / base,
        "gate": [{k: g.get(k) for k in ("value", "op", "bound", "passed")} for g in gate],
    }


def run_name(recipe: str) -> str:
    return tomllib.loads(Path(recipe).read_text())["run"]["name"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipe", default="benchmarks/recipes/w4a8-zen.toml")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--without-zentorch", action="store_true",
                    help="then uninstall zentorch from vLLM's environment and serve W4A16 once more")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    logs = Path("artifacts") / f"{run_name(args.recipe)}-paths"
    logs.mkdir(parents=True, exist_ok=True)
    zen = zentorch(VENV / "bin" / "python")
    rows = []
    for r in range(args.repeats):
        for int8 in (True, False):
            row = run(args.recipe, int8, logs / f"{'w4a8' if int8 else 'w4a16'}-{r}.log")
            rows.append({"platform": f"zentorch {zen}" if zen else "vLLM CPU", "repeat": r, **row})
            print(json.dumps(rows[-1]), flush=True)
    if args.without_zentorch and zen:
        subprocess.check_call([str(VENV / "bin" / "pip"), "uninstall", "-q", "-y", "zentorch"])
        row = run(args.recipe, False, logs / "w4a16-no-zentorch.log")
        rows.append({"platform": "vLLM CPU (no zentorch)", "repeat": 0, **row})
        print(json.dumps(rows[-1]), flush=True)
    if args.out:
        command = " ".join(["python -m research.w4a8_paths", *sys.argv[1:]])
        args.out.write_text(json.dumps({"recipe": args.recipe, "command": command, "rows": rows}, indent=1) + "\n")
        print(args.out)


if __name__ == "__main__":
    main()
