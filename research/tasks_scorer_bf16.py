"""Both scorers on a bfloat16 model against the float32 truth: how far each one's per-item scores are from
lm-eval's float32 scores on the same items, and how far lm-eval is from itself at another batch size. In bfloat16
neither scorer reproduces the other exactly (the logits carry ~3 significant digits, and any change in matmul
shapes or accumulation order moves them); this measures whether the shared-context scorer's drift is within
lm-eval's own.

    flock /tmp/compress-cpu.lock python -m research.tasks_scorer_bf16 --tasks arc_easy,hellaswag,piqa \
        --limit 100 --out benchmarks/results/tasks_scorer_bf16.json
"""
from __future__ import annotations

import json


def main() -> None:
    from benchmarks.tasks_scorer import load, score_task, task_args

    a = task_args(__doc__.splitlines()[0], "arc_easy,hellaswag,piqa")
    import torch

    runs = {"float32 lm-eval b16": ("float32", "lm-eval", 16), "bf16 lm-eval b16": ("bfloat16", "lm-eval", 16),
            "bf16 lm-eval b4": ("bfloat16", "lm-eval", 4),
            "bf16 shared-context b16": ("bfloat16", "shared-context", 16)}
    items: dict[str, dict] = {}
    models = {}
    for label, (dtype, scorer, bs) in runs.items():
        if dtype not in models:
            models = {dtype: load(a.source, dtype)}
        model, tok = models[dtype]
        for name in a.tasks.split(","):
            items.setdefault(label, {})[name] = score_task(model, tok, name, a, scorer, bs)["items"]
    ref = items["float32 lm-eval b16"]
    out = {"source": a.source, "limit": a.limit, "seed": a.seed, "threads": a.threads, "torch": torch.__version__,
           "against float32 lm-eval": {}}
    for label in runs:
        row = {}
        for name, r in ref.items():
            x = items[label][name]
            metrics = [m for m in ("acc", "acc_norm") if m in r]
            row[name] = {"items": len(r["doc_ids"]),
                         "items_differing": {m: sum(p != q for p, q in zip(r[m], x[m], strict=False)) for m in metrics},
                         "score": {m: sum(x[m]) / len(x[m]) for m in metrics},
                         "max_abs_loglik_diff": max(abs(p - q) for u, v in zip(r["loglik"], x["loglik"], strict=False)
                                                    for p, q in zip(u, v, strict=False))}
        out["against float32 lm-eval"][label] = row
        print(label, json.dumps(row), flush=True)
    if a.out:
        a.out.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
