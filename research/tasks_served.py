"""The served model is the scored model: lm-eval's own `local-completions` model, pointed at an export served by
`compress serve --engine vllm` (or any engine), scores the same task items a finished run scored in-process, and the
per-item values are compared.

    .venv/bin/python -m research.tasks_served --run artifacts/default --recipe recipes/default.toml \
        --model gptq-w4g64 --engine vllm --out benchmarks/results/tasks_served_vllm.json

What it compares: for each [validate.tasks] task of the recipe (HumanEval excluded), the run's per-item metric
(validate/<model>/tasks/task_items.json, scored in-process by the recipe's scorer) against the same items scored
through the server with lm-eval 0.4.13's LocalCompletionsAPI (prompts sent as token ids, `echo` + `logprobs`, the
way lm-eval drives any OpenAI-compatible server). The two differ by the serving engine's kernels and precision
(vLLM: bfloat16, its own GPTQ kernel), so a few items are expected to flip; the count is the result.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", required=True, type=Path)
    ap.add_argument("--recipe", required=True)
    ap.add_argument("--model", required=True, help="baseline or a variant name")
    ap.add_argument("--engine", default="vllm")
    ap.add_argument("--eager", action="store_true", help="vLLM --enforce-eager")
    ap.add_argument("--concurrent", type=int, default=4, help="lm-eval's num_concurrent")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)

    from lm_eval.models.openai_completions import LocalCompletionsAPI

    from pipeline.eval.tasks import HUMANEVAL, item_indices, run_lm_eval, write_task_yaml
    from pipeline.eval.tasks_config import task_jobs
    from pipeline.recipe import load_recipe
    from pipeline.serve.measure import serving

    cfg = load_recipe(a.recipe).validate_.tasks
    folder = (a.run / ("load" if a.model == "baseline" else f"quantize/{a.model}")).resolve()
    ref = json.loads((a.run / "validate" / a.model / "tasks" / "task_items.json").read_text())
    work = a.run / "benchmarks" / f"tasks_served_{a.model}_{a.engine}"
    work.mkdir(parents=True, exist_ok=True)
    args = ["--slots", "8", "--max-model-len", "2048"] + (["--enforce-eager"] if a.eager and a.engine == "vllm" else [])
    rows, total, flipped = {}, 0, 0
    with serving(folder, a.engine, args, work / "server.log", 900) as server:
        lm = LocalCompletionsAPI(base_url=f"{server.url}/v1/completions", model=folder.name,
                                 tokenizer=str(folder), tokenizer_backend="huggingface", num_concurrent=a.concurrent,
                                 max_length=2048)
        for job in task_jobs(cfg):
            name = job["task"]
            if name == HUMANEVAL:
                continue
            write_task_yaml(work / "yamls", name, Path(job["include"]), Path(job["data_file"]), job["split"],
                            job.get("format", "arrow"))
            idx = item_indices(job["items"], cfg.limit, cfg.seed)
            t1 = time.perf_counter()
            res = run_lm_eval(lm, work / "yamls", {name: idx}, cfg.num_fewshot, cfg.seed or 0)[name]
            metric = job["metric"]
            mine = dict(zip(res["items"]["doc_ids"], res["items"][metric], strict=True))  # one list per item each
            theirs = dict(zip(ref[name]["doc_ids"], ref[name][metric], strict=True))
            common = sorted(set(mine) & set(theirs))
            diff = sum(mine[d] != theirs[d] for d in common)
            total, flipped = total + len(common), flipped + diff
            rows[name] = {"metric": metric, "items": len(common), "differ": diff,
                          "served": sum(mine[d] for d in common) / len(common),
                          "in_process": sum(theirs[d] for d in common) / len(common),
                          "time_s": round(time.perf_counter() - t1, 1)}
            print(f"{name:<12} {metric:<9} items {len(common):>4}  differ {diff:>3}  served "
                  f"{rows[name]['served']:.3f}  in-process {rows[name]['in_process']:.3f}  "
                  f"({rows[name]['time_s']:.0f} s)", flush=True)
    ready_s, rc = server.ready_s, server.rc
    out = {"run": str(a.run), "model": a.model, "engine": a.engine, "eager": a.eager, "ready_s": round(ready_s, 1),
           "server_exit": rc, "lm_eval_model": "local-completions (LocalCompletionsAPI, token-id prompts)",
           "tasks": rows, "values": total, "differ": flipped,
           "command": "python -m research.tasks_served " + " ".join(argv or sys.argv[1:])}
    print(f"{flipped} of {total} per-item values differ (served by {a.engine} vs the run's in-process scores)")
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
