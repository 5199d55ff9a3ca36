"""Something expensive made once per test session and shared by every module and every xdist worker.

The first worker to ask makes it under a file lock in the session's temporary folder (one folder above the
workers' own with xdist); the others wait for that lock and read what it recorded. A failed attempt records its
outcome too (the tests that use it assert on it), so it is not retried by every worker.
"""
from __future__ import annotations

import fcntl
import json
import subprocess
from collections.abc import Callable
from pathlib import Path


def session_dir(tmp_path_factory) -> Path:
    base = tmp_path_factory.getbasetemp()
    return base.parent if base.name.startswith("popen-gw") else base  # xdist: one folder above the workers'


def once(tmp_path_factory, name: str, make: Callable[[Path], subprocess.CompletedProcess]) -> subprocess.CompletedProcess:
    """make(scratch folder) once per session; its CompletedProcess (args, returncode, stdout, stderr) for every caller."""
    shared = session_dir(tmp_path_factory)
    done = shared / f"{name}.json"
    with open(shared / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the other workers wait for the first one's
        if not done.exists():
            p = make(shared / name)
            done.write_text(json.dumps({"args": [str(a) for a in p.args], "returncode": p.returncode,
                                        "stdout": p.stdout, "stderr": p.stderr}))
    p = json.loads(done.read_text())
    return subprocess.CompletedProcess(p["args"], p["returncode"], p["stdout"], p["stderr"])
