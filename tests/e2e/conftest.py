"""One from-scratch run of recipes/tiny.toml per test session, shared by every e2e module and every xdist worker.

Each module that needs a finished tiny run takes a private copy of it (`first_run` in test_tiny_recipe.py), so no
test sees another's changes; building it once instead of once per module saves about 80 s of a worker per module.
"""
import fcntl
import json
import shutil
import subprocess
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """(the finished run folder, the CompletedProcess of the run that made it); read-only: copy before changing."""
    from tests.e2e.test_tiny_recipe import run_tiny

    base = tmp_path_factory.getbasetemp()
    shared = base.parent if base.name.startswith("popen-gw") else base  # xdist: one folder above the workers'
    root, done = shared / "tiny-first-run", shared / "tiny-first-run.json"
    with open(shared / "tiny-first-run.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the other workers wait for the first one's run
        if not done.exists():
            shutil.rmtree(root, ignore_errors=True)  # a failed attempt of another worker
            p = run_tiny(root)
            done.write_text(json.dumps({"args": p.args, "returncode": p.returncode, "stdout": p.stdout,
                                        "stderr": p.stderr}))
    p = json.loads(done.read_text())
    return root / "tiny", subprocess.CompletedProcess(p["args"], p["returncode"], p["stdout"], p["stderr"])
