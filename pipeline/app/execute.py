"""`compress run`: lock the run folder, write the reproducibility lock, run the units in order, apply the
gates, export, publish. Returns the process exit code. This module runs before tame() (pipeline/base/env.py) and
imports no library that reads the environment it sets; the rest of the run is pipeline/app/execute_tamed.py.

The run's status in report.json is always one of: running (this process is working, or was SIGKILLed),
complete / gates_failed (final: every stage finished and the gates were evaluated), failed (exit 4, or the
stage's own code), interrupted (SIGINT 130, SIGTERM 143). A rerun resumes from the stage manifests.
"""
from __future__ import annotations

from pathlib import Path

from pipeline.app.runner import RunLock
from pipeline.base.env import tame
from pipeline.base.errors import StageError
from pipeline.plan import Plan


def execute(recipe, recipe_path: Path, plan: Plan) -> int:
    run_dir = Path(recipe.run.output_dir) / recipe.run.name
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / ".write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise StageError(f"cannot write to the run folder {run_dir}: {e.strerror}") from None
    with RunLock(run_dir):
        tame()
        # the run's machinery (pipeline/app/execute_tamed.py) imports torch, the stages and the Hub client at its top:
        # late: after tame(), which sets the environment they read on import
        from pipeline.app.execute_tamed import execute_locked

        return execute_locked(recipe, recipe_path, run_dir, plan)
