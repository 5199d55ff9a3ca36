"""The real SmolLM2-135M run of recipes/ci-real.toml, once per test session, shared by every slow module and worker.

.ci/run makes artifacts/ci-real just before the tests, so here `compress run recipes/ci-real.toml` is a resume: every
stage's inputs hash is checked and its outputs verified against their sha256 before it is skipped (a stale or
damaged folder reruns what it must). On a developer machine without the folder it runs from scratch (minutes).
One call per session instead of one per module that needs the real model: the modules read its folders.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.session_once import once

ROOT = Path(__file__).resolve().parents[2]
CI_REAL = ROOT / "artifacts" / "ci-real"


def _run_ci_real(_scratch: Path) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).with_name("compress")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "pipeline.app.cli"]
    return subprocess.run(cmd + ["run", "recipes/ci-real.toml"], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"}, timeout=1800)


@pytest.fixture(scope="session")
def ci_real(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """(artifacts/ci-real, the CompletedProcess of this session's `compress run recipes/ci-real.toml`)."""
    return CI_REAL, once(tmp_path_factory, "ci-real-run", _run_ci_real)
