"""validate/<model>/tasks: [validate.tasks] downstream benchmarks scored with lm-eval (pipeline/eval/tasks.py, the
work) on every model it selects; a variant's recovery on the baseline's items. Its table and rules:
pipeline/eval/tasks_config.py; its report.md section: pipeline/results/tasks_render.py."""
from __future__ import annotations

from typing import Any

from pipeline.base.problem import Problem
from pipeline.base.unit import UnitContext
from pipeline.eval.measures.base import Measurement
from pipeline.eval.tasks_config import TasksConfig, task_jobs, task_problems
from pipeline.quant.registry import method_of


class Tasks(Measurement):
    key = "tasks"
    table = TasksConfig
    work = "pipeline.eval.tasks:worker_task"
    fields = {"tasks": "tasks", "task_recovery": "recovery"}  # typed in ModelEntry: the gates and cards read them
    renders = True
    timeout_setting = "timeout_s"

    def check(self, recipe, arch) -> list[Problem]:
        cfg = self.config(recipe)
        problems = task_problems(cfg, [q.name for q in recipe.quantize])
        for q in (q for q in recipe.quantize if cfg.scores(q.name)):
            elsewhere = method_of(q).measured_elsewhere(q, arch)
            if elsewhere is not None:
                problems.append(Problem("validate.tasks.models", "tasks-model-measured-elsewhere",
                                        f"[validate.tasks] scores {q.name!r}, which validate measures {elsewhere}; "
                                        "tasks are scored in transformers: list the other models in "
                                        "[validate.tasks].models"))
        return problems

    def measures(self, recipe, model: str) -> bool:
        return self.config(recipe).scores(model)

    def prepare(self, recipe) -> list[dict]:
        return task_jobs(self.config(recipe))

    def identity(self, recipe, prepared: Any) -> dict:
        """The task config and each task's data by sha256; a variant's unit also reads the baseline's saved
        per-item scores (recovery on the same items)."""
        return task_identity(self.config(recipe), prepared)

    def args(self, ctx: UnitContext, recipe, name: str, src: str, prepared: Any) -> dict:
        cfg = self.config(recipe)
        return {"model_dir": str(ctx.dep(src)), "out": str(ctx.out), "jobs": prepared, "device": ctx.device,
                "cfg": {"limit": cfg.limit, "seed": cfg.seed, "num_fewshot": cfg.num_fewshot,
                        "batch_size": cfg.batch_size, "scorer": cfg.scorer},
                "reference": self.reference(ctx, name), "bootstrap": cfg.bootstrap}


def task_identity(cfg: TasksConfig, jobs: list[dict]) -> dict:
    """What a unit that scores the tasks reads of them: the config (less the engines, which say which serve units
    score them, not how) and each job with its data by sha256 (not the paths of this machine). The serve units that
    score the tasks through their server ([validate.tasks] engines) read the same."""
    return {"tasks": cfg.model_dump(mode="json", exclude={"engines"}),
            "jobs": [{k: v for k, v in j.items() if k not in ("data_file", "include")} for j in jobs]}


TASKS = Tasks()
MEASUREMENTS = (TASKS,)
