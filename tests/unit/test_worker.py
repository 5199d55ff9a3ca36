"""Child processes (pipeline.base.worker.run_child / run_task): stdout to a log, stderr to the console (less known
library noise) and the log, its tail kept for the error, a time limit that kills, clear errors from a failing task."""
import sys
import time

import pytest

from pipeline.base.errors import StageError
from pipeline.base.worker import ChildTimeout, harmless, run_child, run_task

CHILD = "import sys; print('banner on stdout'); print('progress', file=sys.stderr); " \
        "print('ValueError: the real problem', file=sys.stderr); sys.exit(3)"


def test_run_child_logs_stdout_and_keeps_the_stderr_tail(tmp_path, capfd):
    code, tail = run_child([sys.executable, "-c", CHILD], tmp_path / "child.log")
    assert code == 3 and tail.splitlines()[-1] == "ValueError: the real problem"
    log = (tmp_path / "child.log").read_text()
    assert "banner on stdout\n" in log and "ValueError: the real problem\n" in log  # stderr is in the log too
    assert "progress" in capfd.readouterr().err  # passed through as it came


# Lines as the libraries print them (paths shortened): torchao and bitsandbytes log at import through Python's
# last-resort handler; torch's pytree warning comes through torch's own handler.
TORCHAO = ("Failed to load /venv/lib/python3.11/site-packages/torchao/_C_mxfp8.cpython-310-x86_64-linux-gnu.so: "
           "Could not load this library: /venv/lib/python3.11/site-packages/torchao/_C_mxfp8.cpython-310-x86_64-linux-gnu.so")
BNB = ("Failed to load CPU gemm_4bit_forward from kernels-community: No module named 'kernels'. Please make sure you "
       "already `pip install kernels` and the kernels >= 0.11.1")
PYTREE = ("W1130 22:43:46.146000 7577 .venv/lib/python3.11/site-packages/torch/utils/_pytree.py:630] <enum "
          "'KernelPreference'> is an Enum subclass and is now natively supported by torch.compile as an opaque value "
          "type. Calling register_constant() on Enum subclasses is deprecated and will be an error in a future release.")
OURS = "22:43:46 W compress: draft: ignoring checkpoint from a different configuration"


def test_known_library_noise_stays_off_the_console_but_in_the_log(tmp_path, capfd):
    child = (f"import sys, time; sys.stderr.write({TORCHAO + chr(10)!r}); sys.stderr.flush(); "
             f"print({OURS!r}, file=sys.stderr, flush=True); "
             f"sys.stderr.write({BNB[:30]!r}); sys.stderr.flush(); time.sleep(0.5); "  # a line cut by a pause
             f"sys.stderr.write({BNB[30:] + chr(10) + PYTREE + chr(10)!r}); "
             "sys.stderr.write('bar  50%\\rbar 100%\\n')")
    code, tail = run_child([sys.executable, "-c", child], tmp_path / "task.log")
    assert code == 0
    console = capfd.readouterr().err
    assert OURS in console and "bar 100%" in console
    assert "Failed to load" not in console and "_pytree" not in console, console
    assert tail.splitlines()[0] == OURS  # an error message quotes what the user saw, not the noise
    log = (tmp_path / "task.log").read_text()
    for line in (TORCHAO, OURS, BNB, PYTREE):
        assert line + "\n" in log


def test_harmless_patterns_match_only_their_lines():
    assert harmless(TORCHAO + "\n") and harmless(BNB) and harmless(PYTREE)
    assert not harmless(OURS)
    assert not harmless("Failed to load /work/artifacts/run/quantize/w4/model.safetensors: corrupt header")
    assert not harmless("RuntimeError: Failed to load CPU kernel")


def test_run_child_kills_a_child_past_its_time_limit(tmp_path):
    t0 = time.monotonic()
    with pytest.raises(ChildTimeout, match="exceeded its 1 s limit"):
        run_child([sys.executable, "-c", "import time; time.sleep(60)"], tmp_path / "slow.log", timeout_s=1)
    assert time.monotonic() - t0 < 30


def test_run_task_names_an_unknown_task_and_cleans_up(tmp_path):
    with pytest.raises(StageError, match="nope worker failed"):
        run_task("nope", {}, tmp_path)
    assert not list(tmp_path.glob(".job-*")) and not list(tmp_path.glob(".result-*"))
