"""A measurement as one declaration (issue #43), as llm-compressor's modifiers hold their config and their lifecycle
in one class: a unit validate/<model>/<key> run in a fresh worker process, its recipe table, its `compress check`
rules, its worker task, the report.json fields its figures fill and how, and its memory figure.

    class Tasks(Measurement):
        key = "tasks"                               # validate/<model>/tasks; a name in MEASUREMENTS
        table = TasksConfig                         # [validate.tasks], a pydantic model
        work = "pipeline.eval.tasks:worker_task"    # run in the worker process, imported there only
        fields = {"tasks": "tasks", "task_recovery": "recovery"}   # ModelEntry field <- the unit's metrics key

    MEASUREMENTS = (Tasks(),)

Torch-free, and free of the report code: `compress check` imports every declaration, and a unit's identity is the
code it imports (pipeline/base/codehash.py), so a declaration imports from base/, model/, data/, quant/ and eval/
only; what it renders into report.md lives in pipeline/results/<key>_render.py (`renders = True`), which editing
never reruns a measurement. The generic code asks the registry (pipeline/eval/measures/__init__.py): the recipe's
[validate] model (pipeline/recipe.py), `compress check` (pipeline/plan.py), the validate units
(pipeline/stages/validate.py), the unit kinds (pipeline/stages/kinds.py, from the names in
pipeline/base/stage_keys.py MEASUREMENTS), the report's merge and schema (pipeline/results/merge.py, schema.py),
report.md (pipeline/results/render.py) and the memory plan (pipeline/estimate.py).
"""
from __future__ import annotations

import functools
from typing import Any, ClassVar

from pydantic import BaseModel

from pipeline.base.problem import Problem
from pipeline.base.stage_keys import VALIDATE, UnitKey
from pipeline.base.unit import Unit, UnitContext
from pipeline.base.worker import run_task
from pipeline.quant.registry import model_code

BASELINE = "baseline"
# the entry module of every validate unit (its identity): pipeline/stages/validate.py builds these units
CODE = ("stages/validate.py",)


class Measurement:
    """One measurement. Subclasses set `key`, `table` and `work`, and override what they do differently."""

    key: ClassVar[str]  # the unit's last part: validate/<model>/<key>; listed in stage_keys.MEASUREMENTS
    table: ClassVar[type[BaseModel]]  # its recipe table, [validate.<field>]
    field: ClassVar[str | None] = None  # its name under [validate]; None: the key
    work: ClassVar[str]  # "module:function" run in the worker process: function(args: dict) -> dict
    # report.json: {ModelEntry field: the key of the unit's metrics it is read from}; a field ModelEntry does not
    # type already (pipeline/results/schema.py) is added to it with `section`'s type (default: any JSON value)
    fields: ClassVar[dict[str, str]] = {}
    section: ClassVar[dict[str, Any]] = {}
    renders: ClassVar[bool] = False  # report.md has its section: pipeline/results/<key>_render.py `section(report)`
    timeout_setting: ClassVar[str | None] = None  # the table's field that limits one unit's worker, in seconds

    # ------------------------------------------------------------ the recipe
    @property
    def table_field(self) -> str:
        return self.field or self.key

    def config(self, recipe) -> Any:
        """Its table of the recipe, [validate.<field>]."""
        return getattr(recipe.validate_, self.table_field)

    def check(self, recipe, arch) -> list[Problem]:
        """`compress check`'s rules for its table (arch: the model's shapes, pipeline/quant/shapes.py Arch); a
        Problem with note=True becomes a warning."""
        return []

    # ------------------------------------------------------------ the units
    def unit_key(self, model: str) -> str:
        return str(UnitKey(VALIDATE, model, self.key))

    def measures(self, recipe, model: str) -> bool:
        """Whether this recipe measures `model` ("baseline" or a variant's name)."""
        return False

    def prepare(self, recipe) -> Any:
        """What its units share, worked out once when they are built (tasks: the jobs and their data files); passed
        to `identity` and `args`."""
        return None

    def identity(self, recipe, prepared: Any) -> dict:
        """What its units read of the recipe (their config: a change reruns them), beside the device."""
        return self.config(recipe).model_dump(mode="json")

    def deps(self, model: str, src: str) -> list[str]:
        """The units it reads: by default the model's checkpoint (src) and, for a variant, its own baseline unit."""
        return [src] if model == BASELINE else [src, self.unit_key(BASELINE)]

    def units(self, recipe, models: list[tuple[str, str]]) -> list[Unit]:
        """validate/<model>/<key> for each (model, checkpoint unit) it measures, in the order given."""
        measured = [(name, src) for name, src in models if self.measures(recipe, name)]
        if not measured:
            return []
        prepared = self.prepare(recipe)
        config = {**self.identity(recipe, prepared), "device": recipe.run.device}
        return [Unit(self.unit_key(name), config,
                     functools.partial(self.run, recipe=recipe, name=name, src=src, prepared=prepared),
                     deps=self.deps(name, src), code=CODE + model_code(recipe, name))
                for name, src in measured]

    def args(self, ctx: UnitContext, recipe, name: str, src: str, prepared: Any) -> dict:
        """The worker task's argument (JSON-able): by default the checkpoint, the output folder, the device, its
        table and, for a variant, the baseline unit's folder."""
        return {"model_dir": str(ctx.dep(src)), "out": str(ctx.out), "device": ctx.device,
                "cfg": self.config(recipe).model_dump(mode="json"), "reference": self.reference(ctx, name)}

    def reference(self, ctx: UnitContext, name: str) -> str | None:
        """The baseline unit's folder for a variant (what it is compared with); None for the baseline."""
        return None if name == BASELINE else str(ctx.dep(self.unit_key(BASELINE)))

    def run(self, ctx: UnitContext, recipe, name: str, src: str, prepared: Any = None) -> dict:
        """The unit: its worker task in a fresh process; what it returns is the unit's metrics."""
        timeout = getattr(self.config(recipe), self.timeout_setting) if self.timeout_setting else None
        setting = f"[validate.{self.table_field}] {self.timeout_setting}" if self.timeout_setting else None
        return run_task(self.key, self.args(ctx, recipe, name, src, prepared), ctx.out, recipe.run.threads,
                        timeout_s=timeout, limit_setting=setting, work=self.work)

    # ------------------------------------------------------------ report.json and the memory plan
    def merge(self, entry, metrics: dict) -> None:
        """Its unit's metrics into the model's report entry (pipeline/results/schema.py ModelEntry)."""
        for field, key in self.fields.items():
            setattr(entry, field, metrics.get(key))

    def memory(self, recipe, info, plan) -> dict[str, int]:
        """Its units' own figures for `compress check`'s plan.memory ({unit key: bytes}); none: each unit asks for
        its model's ("validate/<model>", the quality unit's: pipeline/stages/kinds.py Measure)."""
        return {}
