"""One from-scratch run of recipes/tiny.toml per test session, shared by every e2e module and every xdist worker.

Each test that needs a finished tiny run takes a private copy of it (`first_run` in test_tiny_recipe.py, `run_dir` and
`out` in the publish and trust tests), so no test sees another's changes, whichever worker runs it and in whatever
order; building it once instead of once per module saves about 80 s of a worker per module.
"""
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.session_once import once, session_dir


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """(the finished run folder, the CompletedProcess of the run that made it); read-only: copy before changing."""
    from tests.e2e.test_tiny_recipe import run_tiny

    def make(root: Path) -> subprocess.CompletedProcess:
        shutil.rmtree(root, ignore_errors=True)  # a failed attempt of another worker
        return run_tiny(root)  # asserts exit 0: a failed run is retried by the next worker, as before

    p = once(tmp_path_factory, "tiny-first-run", make)
    return session_dir(tmp_path_factory) / "tiny-first-run" / "tiny", p
