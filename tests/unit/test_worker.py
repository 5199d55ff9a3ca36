"""Child processes (pipeline.base.worker.run_child / run_task): stdout to a log, stderr to the console (less known
library noise) and the log, its tail kept for the error, a time limit that kills, clear errors from a failing task."""
import sys
import time
from pathlib import Path

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


# ---------------------------------------------------------------- worker tasks forked from the pre-imported server


def echo_task(args: dict) -> dict:
    """A worker task (run_task's `work`): where it ran, and what was loaded when it started."""
    import os
    import sys

    print("echo task on stderr", file=sys.stderr, flush=True)
    print("echo task on stdout", flush=True)
    if args.get("fail"):
        raise ValueError("the task's own problem")
    if args.get("sleep"):
        time.sleep(args["sleep"])
    return {"pid": os.getpid(), "ppid": os.getppid(), "torch": "torch" in sys.modules,
            "task_code_loaded_before": "pipeline.eval.quality" in sys.modules, "env": os.environ.get("ECHO_ENV")}


ECHO = "tests.unit.test_worker:echo_task"


@pytest.fixture
def forked(monkeypatch):
    """The echo task forked as quality tasks are (worker.FORKED)."""
    from pipeline.base import worker

    monkeypatch.setattr(worker, "FORKED", worker.FORKED | {"echo"})


def test_tasks_are_forks_of_one_server_that_imported_torch_and_report_like_an_interpreter(tmp_path, capfd,
                                                                                        monkeypatch, forked):
    import os

    monkeypatch.delenv("COMPRESS_WORKER_FORK", raising=False)
    monkeypatch.setenv("ECHO_ENV", "this process's environment")
    first = run_task("echo", {}, tmp_path, work=ECHO)
    second = run_task("echo", {}, tmp_path, work=ECHO)
    assert first["ppid"] == second["ppid"] != os.getpid()  # both forked by the same server, not started here
    assert first["pid"] != second["pid"] and first["torch"] and first["worker_peak_rss_bytes"] > 0
    assert not first["task_code_loaded_before"]  # the task's code is imported from disk in the fork
    assert first["env"] == "this process's environment"
    assert "echo task on stderr" in capfd.readouterr().err
    log = (tmp_path / "echo.log").read_text()
    assert "echo task on stdout" in log and "echo task on stderr" in log
    with pytest.raises(StageError, match="echo worker failed .*ValueError: the task's own problem"):
        run_task("echo", {"fail": True}, tmp_path, work=ECHO)
    assert not list(tmp_path.glob(".job-*")) and not list(tmp_path.glob(".result-*"))


def test_a_forked_task_past_its_limit_is_killed(tmp_path, forked):
    import os

    from pipeline.base import forkserver

    t0 = time.monotonic()
    with pytest.raises(StageError, match="echo worker exceeded its 1 s limit"):
        run_task("echo", {"sleep": 60}, tmp_path, timeout_s=1, work=ECHO)
    assert time.monotonic() - t0 < 30
    server = forkserver._server
    assert server is not None and server.alive()

    def children() -> list[str]:
        out = []
        for p in filter(str.isdigit, os.listdir("/proc")):
            try:
                if f"PPid:\t{server.proc.pid}\n" in Path(f"/proc/{p}/status").read_text():
                    out.append(p)
            except OSError:  # gone meanwhile
                pass
        return out

    deadline = time.monotonic() + 10
    while children() and time.monotonic() < deadline:  # the server reaps it within its 0.1 s loop
        time.sleep(0.1)
    assert children() == [], "the killed task is gone"


def test_only_quality_and_speculative_tasks_are_forked_and_a_server_turned_off_forks_none(tmp_path, monkeypatch,
                                                                                        forked):
    import os

    from pipeline.base.worker import FORKED

    assert FORKED == {"quality", "speculative", "echo"}  # speed: fresh processes, as other engines'; plug-ins: own env
    monkeypatch.setenv("COMPRESS_WORKER_FORK", "0")
    r = run_task("echo", {}, tmp_path, work=ECHO)
    assert r["ppid"] == os.getpid()
    monkeypatch.delenv("COMPRESS_WORKER_FORK")
    monkeypatch.setattr("pipeline.base.worker.FORKED", frozenset({"quality"}))
    assert run_task("echo", {}, tmp_path, work=ECHO)["ppid"] == os.getpid()  # not a quality task


KILLED_RUN = r"""
import sys
from pathlib import Path
from pipeline.base import forkserver, worker
worker.FORKED = worker.FORKED | {"echo"}
r = worker.run_task("echo", {}, Path(sys.argv[1]), work="tests.unit.test_worker:echo_task")
print(forkserver._server.dir, r["ppid"], flush=True)
import time; time.sleep(600)
"""


def test_a_run_killed_outright_leaves_no_fork_server_and_no_socket_folder(tmp_path, monkeypatch):
    """SIGKILL of the run's process: its server gets SIGTERM (its parent-death signal), removes its socket and folder
    and exits."""
    import subprocess

    monkeypatch.delenv("COMPRESS_WORKER_FORK", raising=False)
    p = subprocess.Popen([sys.executable, "-c", KILLED_RUN, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                         cwd=Path(__file__).resolve().parents[2])
    try:
        folder, server = p.stdout.readline().split()
        assert Path(folder, "s").is_socket() and int(server) != p.pid
    finally:
        p.kill()
        p.wait()
    deadline = time.monotonic() + 20
    while (Path(folder).exists() or Path(f"/proc/{server}").exists()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not Path(folder).exists() and not Path(f"/proc/{server}").exists()


def test_a_killed_servers_folder_is_removed_when_the_next_server_starts(tmp_path):
    """A server SIGKILLed itself (Ray kills a worker's children so) leaves its folder; the next server's start removes
    every such folder of ours older than a minute whose socket refuses, and leaves a live or young one alone."""
    import os
    import socket

    from pipeline.base.forkserver import PREFIX, remove_stale_folders

    def folder(name: str, listening: bool, age_s: float) -> tuple[Path, socket.socket]:
        d = tmp_path / name
        d.mkdir()
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        s.bind(str(d / "s"))
        if listening:
            s.listen(1)
        else:
            s.close()
        os.utime(d, (time.time() - age_s, time.time() - age_s))
        return d, s

    dead, _ = folder(PREFIX + "dead", False, 600)
    live, server = folder(PREFIX + "live", True, 600)
    young, _ = folder(PREFIX + "young", False, 1)
    other, _ = folder("someone-else", False, 600)
    try:
        remove_stale_folders(str(tmp_path))
    finally:
        server.close()
    assert not dead.exists() and live.exists() and young.exists() and other.exists()
