"""The real SmolLM2-135M run of recipes/ci-real.toml, once per test session, shared by every slow module and worker.

.ci/run starts the same command in the background before the tests (beside vLLM's set-up and the lint), so here
`compress run recipes/ci-real.toml` first waits while that process holds the run folder (exit 3, "in use by
another compress process"), then resumes: every stage's inputs hash is checked and its outputs verified against
their sha256 before it is skipped (a stale or damaged folder reruns what it must). On a developer machine without
the folder it runs from scratch (minutes). One call per session instead of one per module that needs the real
model: the modules read its folders; tests/schedule.py queues them after the long units (READS_CI_REAL), when the run
is done.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.session_once import once

ROOT = Path(__file__).resolve().parents[2]
CI_REAL = ROOT / "artifacts" / "ci-real"


LOCKED = 3  # pipeline/base/errors.py: the run folder is in use by another compress process
WAIT_S = 1800  # a hang guard on .ci/run's own run of the recipe, not a speed figure


def _run_ci_real(_scratch: Path) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).with_name("compress")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "pipeline.app.cli"]
    deadline = time.time() + WAIT_S
    while True:
        p = subprocess.run(cmd + ["run", "recipes/ci-real.toml"], cwd=ROOT, capture_output=True, text=True,
                           env={**os.environ, "PYTHONUNBUFFERED": "1"}, timeout=1800)
        if p.returncode != LOCKED or time.time() > deadline:
            return p
        time.sleep(5)  # .ci/run's background run holds the folder: this resumes once it has finished


@pytest.fixture(scope="session")
def ci_real(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """(artifacts/ci-real, the CompletedProcess of this session's `compress run recipes/ci-real.toml`)."""
    return CI_REAL, once(tmp_path_factory, "ci-real-run", _run_ci_real)
