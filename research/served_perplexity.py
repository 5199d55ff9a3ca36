"""Perplexity through vLLM's CPU build against the quality stage's, for checkpoints of a finished run (issue #34:
"where vLLM's CPU build serves the checkpoint, also score it through vLLM; the two figures should agree").

    python -m research.served_perplexity artifacts/w8a8-kv baseline w8a8-int8-sq w8a8-int8-sq-kv

Each model's folder (the baseline: load/; a variant: export/<name>, else quantize/<name>) is served by
`compress serve --engine vllm` (eager); the run's own evaluation ids and windows (validate/<m>/quality: its
eval_ids.safetensors and the perplexity record) are scored with prompt_logprobs (pipeline/serve/served_nll.py).
Prints our perplexity, vLLM's, their ratio and vLLM's precision; --out writes the rows as JSON.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from safetensors.torch import load_file

from pipeline.eval.perplexity import make_windows
from pipeline.serve.engines.vllm import vllm_facts
from pipeline.serve.measure import serving
from pipeline.serve.served_nll import served_vs_in_process


def folder_of(run: Path, model: str) -> Path:
    if model == "baseline":
        return run / "load"
    return run / "export" / model if (run / "export" / model).is_dir() else run / "quantize" / model


def score(run: Path, model: str, threads: int, log_dir: Path) -> dict:
    quality = run / "validate" / model / "quality"
    ppl = json.loads((quality / "metrics.json").read_text())["perplexity"]
    ids_file = quality / "eval_ids.safetensors"
    if not ids_file.is_file():
        ids_file = run / "validate" / "baseline" / "quality" / "eval_ids.safetensors"
    ids = next(iter(load_file(ids_file).values())).tolist()
    windows = make_windows(len(ids), ppl["window"], ppl["stride"], ppl["windows"])
    folder = folder_of(run, model)
    log_path = log_dir / f"{model}.serve.log"
    args = ["--enforce-eager", "--max-model-len", str(ppl["window"] + 8), "--threads", str(threads)]
    with serving(folder, "vllm", args, log_path, 600) as server:
        got = served_vs_in_process(server.url, folder.name, ids, windows, ppl, model)
    dtype = vllm_facts(log_path, folder).get("served_dtype")
    return {"model": model, "ours": got["in_process"], "ours_tokens": ppl["tokens"], "vllm": got["value"],
            "vllm_tokens": got["tokens"], "ratio": got["ratio"], "vllm_dtype": dtype, "score_s": got["time_s"],
            "windows": got["windows"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("models", nargs="+")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    log_dir = a.out.parent if a.out else a.run_dir
    rows = []
    print("| model | ours | vLLM CPU | vLLM / ours | vLLM dtype | tokens |")
    print("|---|---|---|---|---|---|")
    for m in a.models:
        r = score(a.run_dir, m, a.threads, log_dir)  # StageError when vLLM scored other tokens than ours
        rows.append(r)
        print(f"| {m} | {r['ours']:.4f} | {r['vllm']:.4f} | {r['ratio']:.4f} | {r['vllm_dtype']} "
              f"| {r['vllm_tokens']} |", flush=True)
    if a.out:
        a.out.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
