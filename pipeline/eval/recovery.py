"""Task recovery above chance, paired: (variant - chance) / (baseline - chance) on the SAME items, with a seeded
paired bootstrap interval (items resampled together for both models, so the shared difficulty of an item cancels)
and the paired standard error of the difference. Pure functions over per-item scores (lists of 0/1 or floats).

Why above chance: a baseline at 0.42 on two-way items (chance 0.50) against a variant at 0.56 is a plain ratio of
1.333, which says nothing about what compression kept. Each item is centred on its own chance (1 / its number of
choices; 0 for generated answers such as HumanEval's pass@1), and a task whose baseline is not above chance by its
own paired 95 % interval is EXCLUDED from the recovery figures and the gate (its row says why).

    task_recovery(base, var, chance=c)        -> {"recovery", "low", "high", "chance", "excluded", "diff", ...}
    average_recovery({task: (base, var)}, chances={task: c})
        -> the same for the mean over tasks, each task weighted equally:
           mean_t(var_t - chance_t) / mean_t(base_t - chance_t), every task's items resampled in each draw
    recoveries(base_items, var_items, metrics) -> {"definition", "tasks", "excluded", "average"} from two saved
           task_items.json contents, chance per item from the number of choices each item's record holds
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

CONFIDENCE = 0.95
_Z = 1.959963984540054  # two-sided 95 %
DEFINITION = "above-chance"  # task_recovery["definition"]: (variant - chance) / (baseline - chance)
GENERATIVE = ("pass@1",)  # metrics of generated answers: nothing to guess among, chance 0
Chance = float | Sequence[float]


def _paired(base: list[float], var: list[float], chance: Chance = 0.0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    b, v = np.asarray(base, dtype=float), np.asarray(var, dtype=float)
    if b.shape != v.shape or b.ndim != 1 or b.size == 0:
        raise ValueError(f"paired scores need the same non-empty items (got {b.shape} and {v.shape})")
    c = np.asarray(chance, dtype=float)
    if c.ndim and c.shape != b.shape:
        raise ValueError(f"chance needs one value, or one per item (got {c.shape} for {b.size} items)")
    return b, v, np.broadcast_to(c, b.shape)


def _ratio(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(den > 0, num / np.where(den > 0, den, 1.0), np.nan)


def _interval(draws: np.ndarray) -> tuple[float | None, float | None]:
    """The percentile interval (CONFIDENCE) of the finite bootstrap draws; (None, None) when there are none."""
    draws = draws[np.isfinite(draws)]
    if not draws.size:
        return None, None
    alpha = (1 - CONFIDENCE) / 2
    return float(np.quantile(draws, alpha)), float(np.quantile(draws, 1 - alpha))


def _exclusion(margin: float, low: float | None, high: float | None, base: float, chance: float) -> str | None:
    """Why a task is left out of recovery: its baseline is not above chance by its own paired interval."""
    if low is not None and low > 0:
        return None
    band = f" [{low:+.3f}, {high:+.3f}]" if low is not None and high is not None else ""
    return (f"baseline {base:.3f} is not above chance {chance:.3f} (baseline - chance {margin:+.3f}{band}, "
            f"{CONFIDENCE * 100:.0f} % interval)")


def task_recovery(base: list[float], var: list[float], iters: int = 2000, seed: int = 0,
                  chance: Chance = 0.0) -> dict:
    """Recovery of one task above `chance` (one value, or one per item): mean(var - c) / mean(base - c), its paired
    bootstrap percentile interval (CONFIDENCE), and the baseline's own margin over chance with its interval from
    the same draws; a baseline not above chance by that interval leaves `recovery`/`low`/`high` None and says why
    in `excluded`. Also the difference var - base with its paired SE (sd of per-item differences / sqrt(n), chance
    cancels) and the smallest difference it can resolve (1.96 x that SE)."""
    b, v, c = _paired(base, var, chance)
    n = b.size
    idx = np.random.default_rng(seed).integers(0, n, size=(iters, n))
    bm, vm = (b - c)[idx].mean(axis=1), (v - c)[idx].mean(axis=1)  # the same draws for both: paired
    margin = float(b.mean() - c.mean())
    m_low, m_high = _interval(bm)
    excluded = _exclusion(margin, m_low, m_high, float(b.mean()), float(c.mean()))
    rec, low, high = None, None, None
    if not excluded:
        rec, (low, high) = float(v.mean() - c.mean()) / margin, _interval(_ratio(vm, bm))
    d = v - b
    se = float(d.std(ddof=1) / math.sqrt(n)) if n > 1 else float("nan")
    return {"recovery": rec, "low": low, "high": high, "excluded": excluded, "chance": float(c.mean()),
            "baseline": float(b.mean()), "variant": float(v.mean()), "baseline_above_chance": margin,
            "baseline_above_chance_low": m_low, "baseline_above_chance_high": m_high,
            "diff": float(d.mean()), "diff_se": se, "resolvable": _Z * se if math.isfinite(se) else None, "n": n,
            "bootstrap": iters, "seed": seed}


def average_recovery(pairs: dict[str, tuple[list[float], list[float]]], iters: int = 2000, seed: int = 0,
                     chances: dict[str, Chance] | None = None) -> dict:
    """Recovery of the mean over tasks above chance (each task's mean weighted equally, as benchmark averages are):
    mean_t(var_t - chance_t) / mean_t(base_t - chance_t), every task's items resampled in each bootstrap draw
    (paired: the same items for both models). `chances`: {task: chance, one value or one per item}; a task not in
    it has chance 0. The caller leaves out the tasks task_recovery excluded."""
    if not pairs:
        raise ValueError("no tasks to average")
    data = [_paired(b, v, (chances or {}).get(t, 0.0)) for t, (b, v) in pairs.items()]
    rng = np.random.default_rng(seed)
    bs, vs = np.zeros(iters), np.zeros(iters)
    for b, v, c in data:
        idx = rng.integers(0, b.size, size=(iters, b.size))
        bs += (b - c)[idx].mean(axis=1)
        vs += (v - c)[idx].mean(axis=1)
    low, high = _interval(_ratio(vs, bs))
    base, varm, chance = (float(np.mean([x[i].mean() for x in data])) for i in range(3))
    # the mean difference's SE: tasks are independent, each its own paired SE
    se = math.sqrt(sum((v - b).var(ddof=1) / b.size for b, v, _ in data if b.size > 1)) / len(data)
    return {"recovery": (varm - chance) / (base - chance) if base > chance else None, "low": low, "high": high,
            "chance": chance, "baseline": base, "variant": varm, "diff": varm - base, "diff_se": se,
            "resolvable": _Z * se, "n": int(sum(b.size for b, _, _ in data)), "tasks": len(data),
            "bootstrap": iters, "seed": seed}


def item_chance(task: str, base: dict, var: dict, metric: str) -> Chance:
    """Chance per item of a task's saved records: 1 / the number of choices each item was scored over (the
    per-choice log-likelihoods in `loglik`, the same for both models); 0 for a generated-answer metric (pass@1).
    A multiple-choice record without choice counts is an error (its chance level is unknown)."""
    counts = [len(x) for x in base.get("loglik") or []]
    if not counts:
        if metric in GENERATIVE:
            return 0.0
        raise ValueError(f"task {task}: its per-item records hold no choice counts ('loglik'), so its chance level "
                         "is unknown: rerun its tasks units")
    if "loglik" in var and [len(x) for x in var["loglik"]] != counts:
        raise ValueError(f"task {task}: the baseline and the variant were scored over different choices")
    if len(counts) != len(base[metric]) or min(counts) < 1:
        raise ValueError(f"task {task}: {len(counts)} choice counts for {len(base[metric])} items")
    return [1.0 / k for k in counts]


def recoveries(base_items: dict, var_items: dict, metrics: dict[str, str], iters: int = 2000, seed: int = 0) -> dict:
    """Per-task and average recovery above chance from two saved task_items.json contents ({task: {"doc_ids",
    metric: [...], "loglik": [[per choice], ...]}}) for the tasks both have; the items are matched by doc id (an
    item only one model has is an error). Tasks whose baseline is not above chance are in `excluded` ({task: why})
    and out of the average; no average when every task is excluded."""
    out, pairs, chances, excluded = {}, {}, {}, {}
    for task, metric in metrics.items():
        if task not in base_items or task not in var_items:
            continue
        b, v = base_items[task], var_items[task]
        if b["doc_ids"] != v["doc_ids"]:
            raise ValueError(f"task {task}: the baseline and the variant were scored on different items")
        chance = item_chance(task, b, v, metric)
        out[task] = task_recovery(b[metric], v[metric], iters, seed, chance=chance)
        if out[task]["excluded"]:
            excluded[task] = out[task]["excluded"]
        else:
            pairs[task], chances[task] = (b[metric], v[metric]), chance
    result = {"definition": DEFINITION, "tasks": out, "excluded": excluded}
    if pairs:
        result["average"] = {**average_recovery(pairs, iters, seed, chances), "included": sorted(pairs)}
    return result
