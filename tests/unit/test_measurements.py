"""A measurement is one plug-in (issue #43): its declaration (pipeline/eval/measures/<name>.py), its work module, its
report.md section if it has one, and its name in pipeline/base/stage_keys.py MEASUREMENTS. The generic code (the
recipe, `compress check`, the validate units and kinds, the worker, report.json's schema and merge, report.md, the
memory plan) asks the registry: a toy measurement added to a copy of the package, touching nothing else, is picked
up by all of them."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

from pipeline.base.codehash import PACKAGE_DIR
from pipeline.base.stage_keys import MEASUREMENTS as NAMES
from pipeline.eval.measures import MEASUREMENTS, all_measurements
from pipeline.recipe import ValidateConfig
from pipeline.results.schema import ModelEntry
from pipeline.stages import kinds

ROOT = PACKAGE_DIR.parent

TOY = {
    "eval/measures/toy.py": '''
        from pydantic import BaseModel, ConfigDict, Field

        from pipeline.base.problem import Problem
        from pipeline.eval.measures.base import Measurement


        class ToyConfig(BaseModel):
            model_config = ConfigDict(extra="forbid")
            enabled: bool = Field(False, description="count the checkpoint's files")
            scale: float = Field(1.0, description="what the count is multiplied by")


        class Toy(Measurement):
            key = "toy"
            table = ToyConfig
            work = "pipeline.eval.toy:worker_task"
            fields = {"toy_score": "score"}
            section = {"toy_score": float | None}
            renders = True

            def measures(self, recipe, model):
                return self.config(recipe).enabled

            def check(self, recipe, arch):
                return [Problem("validate.toy", "toy-note", f"toy scale {self.config(recipe).scale}", note=True)]

            def memory(self, recipe, info, plan):
                return {self.unit_key("baseline"): 12345}


        MEASUREMENTS = (Toy(),)
    ''',
    "eval/toy.py": '''
        from pathlib import Path


        def worker_task(args):
            return {"score": args["cfg"]["scale"] * len(list(Path(args["model_dir"]).iterdir()))}
    ''',
    "results/toy_render.py": '''
        def section(report):
            rows = [(n, e) for n, e in [("baseline", report.baseline), *report.variants.items()] if e is not None]
            return ["## Toy", ""] + [f"- {n}: {e.toy_score}" for n, e in rows if e.toy_score is not None] + [""]
    ''',
}

SCRIPT = '''
import json, sys
from pathlib import Path
from pipeline.recipe import load_recipe
from pipeline.plan import check
from pipeline.stages import validate
from pipeline.stages.kinds import kind_of
from pipeline.base.unit import UnitContext
from pipeline.results.merge import record
from pipeline.results.render import render_markdown
from pipeline.results.schema import Report, new_report

recipe = load_recipe(Path(sys.argv[1]))
out = {"scale": recipe.validate_.toy.scale}
plan = check(recipe)
out["warnings"] = [w for w in plan.warnings if w.startswith("toy")]
out["memory"] = plan.memory.get("validate/baseline/toy")
units = {u.key: u for u in validate.units(recipe)}
toy = [k for k in units if k.endswith("/toy")]
out["units"], out["deps"], out["kind"] = toy, units[toy[-1]].deps, kind_of(toy[0]).__name__
run = Path(sys.argv[2])
(run / "load").mkdir(parents=True)
(run / "load" / "a").write_text("x")
ctx = UnitContext(toy[0], run / toy[0], run / "work", run, 0, "cpu", {})
ctx.out.mkdir(parents=True)
metrics = units[toy[0]].fn(ctx)
report = new_report(run_id="r", name="t", recipe="r.toml", device="cpu", seed=0, versions={})
record(report, toy[0], {"time_s": 1.0, "peak_rss_bytes": 1, "metrics": metrics}, False)
out["entry"] = Report.model_validate(report.to_dict()).to_dict()["baseline"]
md = render_markdown(report, []).splitlines()
out["md"] = md[md.index("## Toy"):md.index("## Toy") + 3]
print(json.dumps(out))
'''


def test_the_registry_lists_the_plug_in_measurements():
    assert [m.key for m in all_measurements()] == list(NAMES) and MEASUREMENTS.names() == sorted(NAMES)
    for m in all_measurements():
        assert ValidateConfig.model_fields[m.table_field].annotation is m.table, m.key
        assert set(m.fields) <= set(ModelEntry.model_fields), m.key
        assert kinds.kind_of(m.unit_key("w4")) is kinds.PLUGINS[m.key]
        assert ":" in m.work and m.work.startswith("pipeline."), m.key
    assert "Did you mean: tasks?" in MEASUREMENTS.unknown_message("taks")


def test_a_new_measurement_is_picked_up_from_its_own_files(tmp_path):
    root = tmp_path / "src" / "pipeline"
    shutil.copytree(PACKAGE_DIR, root, ignore=shutil.ignore_patterns("__pycache__"))
    (root.parent / "calibration").symlink_to(ROOT / "calibration")  # the shipped data registry, read beside it
    for rel, text in TOY.items():
        (root / rel).write_text(textwrap.dedent(text).lstrip())
    keys = root / "base" / "stage_keys.py"
    source = keys.read_text()
    assert 'MEASUREMENTS = ("tasks",)' in source
    keys.write_text(source.replace('MEASUREMENTS = ("tasks",)', 'MEASUREMENTS = ("tasks", "toy")'))
    recipe = tmp_path / "r.toml"
    recipe.write_text((ROOT / "recipes" / "tiny.toml").read_text() + "\n[validate.toy]\nenabled = true\nscale = 2.0\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "src"), "XDG_CACHE_HOME": str(tmp_path / "xdg")}
    got = subprocess.run([sys.executable, "-c", SCRIPT, str(recipe), str(tmp_path / "run")], capture_output=True,
                         text=True, env=env, cwd=tmp_path, timeout=600)
    assert got.returncode == 0, got.stderr[-3000:]
    out = json.loads(got.stdout.strip().splitlines()[-1])
    assert out["scale"] == 2.0  # [validate.toy] is a recipe table
    assert out["warnings"] == ["toy scale 2.0"] and out["memory"] == 12345  # compress check and the memory plan
    assert out["units"][0] == "validate/baseline/toy" and len(out["units"]) >= 2 and out["kind"] == "Toy"
    assert out["deps"][-1] == "validate/baseline/toy"  # a variant reads its baseline's unit
    assert out["entry"]["toy_score"] == 2.0  # the worker ran its task; merged into report.json and read back
    assert out["md"] == ["## Toy", "", "- baseline: 2.0"]  # report.md's section
