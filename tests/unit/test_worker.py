"""Child processes (pipeline.worker.run_child / run_task): stdout to a log, stderr to the console with its
tail kept for the error, a time limit that kills, clear errors from a failing task."""
import sys
import time

import pytest

from pipeline.errors import StageError
from pipeline.worker import ChildTimeout, run_child, run_task

CHILD = "import sys; print('banner on stdout'); print('progress', file=sys.stderr); " \
        "print('ValueError: the real problem', file=sys.stderr); sys.exit(3)"


def test_run_child_logs_stdout_and_keeps_the_stderr_tail(tmp_path, capfd):
    code, tail = run_child([sys.executable, "-c", CHILD], tmp_path / "child.log")
    assert code == 3 and tail.splitlines()[-1] == "ValueError: the real problem"
    assert (tmp_path / "child.log").read_text() == "banner on stdout\n"
    assert "progress" in capfd.readouterr().err  # passed through as it came


def test_run_child_kills_a_child_past_its_time_limit(tmp_path):
    t0 = time.monotonic()
    with pytest.raises(ChildTimeout, match="exceeded its 1 s limit"):
        run_child([sys.executable, "-c", "import time; time.sleep(60)"], tmp_path / "slow.log", timeout_s=1)
    assert time.monotonic() - t0 < 30


def test_run_task_names_an_unknown_task_and_cleans_up(tmp_path):
    with pytest.raises(StageError, match="nope worker failed"):
        run_task("nope", {}, tmp_path)
    assert not list(tmp_path.glob(".job-*")) and not list(tmp_path.glob(".result-*"))
