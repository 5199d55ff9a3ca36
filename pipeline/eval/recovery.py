"""Task recovery, paired: variant score / baseline score on the SAME items, with a seeded paired bootstrap
interval (items resampled together for both models, so the shared difficulty of an item cancels) and the
paired standard error of the difference. Pure functions over per-item scores (lists of 0/1 or floats).

    task_recovery(base, var)                      -> {"recovery", "low", "high", "diff", "diff_se", "resolvable", ...}
    average_recovery({task: (base, var)})         -> the same for the mean over tasks (each task weighted equally)
"""
from __future__ import annotations

import math

import numpy as np

CONFIDENCE = 0.95
_Z = 1.959963984540054  # two-sided 95 %


def _paired(base: list[float], var: list[float]) -> tuple[np.ndarray, np.ndarray]:
    b, v = np.asarray(base, dtype=float), np.asarray(var, dtype=float)
    if b.shape != v.shape or b.ndim != 1 or b.size == 0:
        raise ValueError(f"paired scores need the same non-empty items (got {b.shape} and {v.shape})")
    return b, v


def _ratio(v: np.ndarray, b: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(b > 0, v / np.where(b > 0, b, 1.0), np.nan)


def task_recovery(base: list[float], var: list[float], iters: int = 2000, seed: int = 0) -> dict:
    """Recovery of one task: mean(var) / mean(base), its paired bootstrap percentile interval (CONFIDENCE),
    the difference var - base with its paired SE (sd of per-item differences / sqrt(n)), and the smallest
    difference it can resolve (1.96 x that SE; for the noise floor before any difference is seen, the SE of
    a difference with the per-item disagreement rate of these two models)."""
    b, v = _paired(base, var)
    n = b.size
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, n, size=(iters, n))
    boot = _ratio(v[idx].mean(axis=1), b[idx].mean(axis=1))
    boot = boot[np.isfinite(boot)]
    alpha = (1 - CONFIDENCE) / 2
    d = v - b
    se = float(d.std(ddof=1) / math.sqrt(n)) if n > 1 else float("nan")
    rec = float(v.mean() / b.mean()) if b.mean() > 0 else None
    return {"recovery": rec, "low": float(np.quantile(boot, alpha)) if boot.size else None,
            "high": float(np.quantile(boot, 1 - alpha)) if boot.size else None,
            "baseline": float(b.mean()), "variant": float(v.mean()), "diff": float(d.mean()), "diff_se": se,
            "resolvable": _Z * se if math.isfinite(se) else None, "n": n, "bootstrap": iters, "seed": seed}


def average_recovery(pairs: dict[str, tuple[list[float], list[float]]], iters: int = 2000, seed: int = 0) -> dict:
    """Recovery of the mean over tasks (each task's mean weighted equally, as benchmark averages are):
    mean_t(var_t) / mean_t(base_t), every task's items resampled in each bootstrap draw."""
    if not pairs:
        raise ValueError("no tasks to average")
    data = [_paired(b, v) for b, v in pairs.values()]
    rng = np.random.default_rng(seed)
    bs, vs = np.zeros(iters), np.zeros(iters)
    for b, v in data:
        idx = rng.integers(0, b.size, size=(iters, b.size))
        bs += b[idx].mean(axis=1)
        vs += v[idx].mean(axis=1)
    boot = _ratio(vs, bs)
    boot = boot[np.isfinite(boot)]
    base = float(np.mean([b.mean() for b, _ in data]))
    varm = float(np.mean([v.mean() for _, v in data]))
    # the mean difference's SE: tasks are independent, each its own paired SE
    se = math.sqrt(sum((v - b).var(ddof=1) / b.size for b, v in data if b.size > 1)) / len(data)
    alpha = (1 - CONFIDENCE) / 2
    return {"recovery": varm / base if base > 0 else None,
            "low": float(np.quantile(boot, alpha)) if boot.size else None,
            "high": float(np.quantile(boot, 1 - alpha)) if boot.size else None,
            "baseline": base, "variant": varm, "diff": varm - base, "diff_se": se, "resolvable": _Z * se,
            "n": int(sum(b.size for b, _ in data)), "tasks": len(data), "bootstrap": iters, "seed": seed}


def recoveries(base_items: dict, var_items: dict, metrics: dict[str, str], iters: int = 2000, seed: int = 0) -> dict:
    """Per-task and average recovery from two saved task_items.json contents ({task: {"doc_ids", metric: [...]}})
    for the tasks both have; the items are matched by doc id (an item only one model has is an error)."""
    out, pairs = {}, {}
    for task, metric in metrics.items():
        if task not in base_items or task not in var_items:
            continue
        b, v = base_items[task], var_items[task]
        if b["doc_ids"] != v["doc_ids"]:
            raise ValueError(f"task {task}: the baseline and the variant were scored on different items")
        pairs[task] = (b[metric], v[metric])
        out[task] = task_recovery(b[metric], v[metric], iters, seed)
    result = {"tasks": out}
    if pairs:
        result["average"] = average_recovery(pairs, iters, seed)
    return result
