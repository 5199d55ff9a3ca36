"""One pre-imported parent for the fresh-process workers of pipeline/base/worker.py.

A worker task used to start a new interpreter and import torch and transformers before its own work: 4-5 s of CPU
each on the 2-core machine, 18 of the 45 CPU seconds of `compress run recipes/tiny.toml` (4 tasks). The fork server
is started once per process, on first use, and imports them once; each quality task is then a fork of it, which imports
its own task's code from disk (only the libraries and pipeline.base are loaded before the fork, so a unit's code is
read when it runs, as before), loads its checkpoint from disk and reports its own peak RSS. Its stdout and stderr are
the log file and the pipe run_child hands over, as a new interpreter's were.

    handle = spawn(["JOB.json", "RESULT.json"], env, stdout_fd, stderr_fd)   # None: no server, start an interpreter
    handle.wait(); handle.kill()

Quality and speculative tasks are forked (worker.FORKED: one quality task for every model a run validates); the others
still start a new interpreter: speed times what gates and the techniques table compare with other engines' processes,
and a plug-in measurement may set environment variables its libraries read on import, which the server's transformers
has read already. The speculative task times its decoder against plain decoding in its own process, both forked alike.
COMPRESS_WORKER_FORK=0 turns the server off. A server that cannot start, or dies, is not an error: the task starts a
new interpreter, as before. Linux only (the pipe and file descriptors travel over a unix socket).

    python -m pipeline.base.forkserver_loop SOCKET   # the server spawn() starts (prints "ready" once it listens)

This module is the client and loads no library; the server is pipeline/base/forkserver_loop.py.
"""
from __future__ import annotations

import atexit
import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

from pipeline.base.env import die_with_parent, tamed_environ, with_checkout_on_path

ENV = "COMPRESS_WORKER_FORK"
START_TIMEOUT_S = 180.0  # the server's imports, on a loaded 2-core machine

_lock = threading.Lock()
_server: _Server | None = None
_failed = False  # the server could not start in this process: every task starts an interpreter


class Forked:
    """A task forked by the server: what run_child needs of a Popen (the server reaps it and sends its exit code)."""

    def __init__(self, conn: socket.socket, pid: int) -> None:
        self.conn, self.pid = conn, pid
        self.returncode: int | None = None

    def wait(self) -> int:
        if self.returncode is None:
            try:
                msg = self.conn.recv(64)
                self.returncode = int(msg) if msg else -signal.SIGKILL  # the server died with it (PDEATHSIG)
            finally:
                self.conn.close()
        return int(self.returncode)

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)


PREFIX = "compress-fork-"  # a server's folder in /tmp, holding its socket SOCKET
SOCKET = "s"
STALE_AFTER_S = 60.0


def remove_socket(path: str) -> None:
    """A server's socket and its folder, gone (by the client that closes it, the server that ends, or the sweep)."""
    with contextlib.suppress(OSError):
        os.unlink(path)
    with contextlib.suppress(OSError):
        os.rmdir(os.path.dirname(path))


def remove_stale_folders(tmp: str | None = None) -> None:
    """Remove the socket folders of servers killed outright (SIGKILL: Ray kills a worker's children so when the worker
    exits): a folder of ours, older than a minute, whose socket no server listens on any more (refused)."""
    root = tmp or tempfile.gettempdir()
    with contextlib.suppress(OSError):
        for name in os.listdir(root):
            if not name.startswith(PREFIX):  # the temp folder holds everyone's files: only ours are looked at
                continue
            folder = os.path.join(root, name)
            sock = os.path.join(folder, SOCKET)
            try:
                st = os.stat(folder)
                if st.st_uid != os.getuid() or time.time() - st.st_mtime < STALE_AFTER_S or not os.path.exists(sock):
                    continue
                with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as probe:
                    probe.connect(sock)  # a live server: leave it
            except ConnectionRefusedError:
                remove_socket(sock)
            except OSError:
                continue


class _Server:
    def __init__(self) -> None:
        remove_stale_folders()
        self.dir = tempfile.mkdtemp(prefix=PREFIX)
        self.path = os.path.join(self.dir, SOCKET)
        # tame()'s variables: the server imports torch and transformers on its first lines
        env = dict(with_checkout_on_path(tamed_environ(os.environ)), PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen([sys.executable, "-m", "pipeline.base.forkserver_loop", self.path], env=env,
                                     stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     preexec_fn=_end_with_parent)  # it ends with this process, its tasks with it
        assert self.proc.stdout is not None
        deadline, line = time.monotonic() + START_TIMEOUT_S, b""
        while line != b"ready\n" and _readable(self.proc.stdout, deadline):
            line = self.proc.stdout.readline()  # a library's banner on stdout comes before it
            if not line:
                break
        if line != b"ready\n":
            self.close()
            raise OSError("the worker fork server did not start")
        atexit.register(self.close)

    def spawn(self, args: list[str], env: dict, stdout_fd: int, stderr_fd: int) -> Forked:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            conn.connect(self.path)
            msg = json.dumps({"args": args, "env": env, "cwd": os.getcwd()}).encode()
            socket.send_fds(conn, [msg], [stdout_fd, stderr_fd])
            pid = conn.recv(64)
            if not pid:
                raise OSError("the worker fork server closed the connection")
            return Forked(conn, int(pid))
        except BaseException:
            conn.close()
            raise

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        remove_socket(self.path)


def _end_with_parent() -> None:  # pragma: no cover - a preexec_fn
    die_with_parent(signal.SIGTERM)  # the server removes its socket folder, then exits (forkserver_loop.serve)


def _readable(f, deadline: float) -> bool:
    return bool(select.select([f], [], [], max(0.0, deadline - time.monotonic()))[0])


def enabled() -> bool:
    return os.environ.get(ENV, "1") != "0" and sys.platform == "linux"


def spawn(args: list[str], env: dict, stdout_fd: int, stderr_fd: int) -> Forked | None:
    """Fork a worker task (pipeline.base.worker.main(args)) from this process's server, started on first use; None
    when there is no server (turned off, not Linux, or it failed to start or died twice): start an interpreter."""
    global _server, _failed
    if not enabled():
        return None
    for _ in range(2):  # a server that died (its parent thread exited, or it was killed) is started again once
        with _lock:
            if _failed:
                return None
            if _server is None or not _server.alive():
                try:
                    _server = _Server()
                except OSError:
                    _failed = True
                    return None
            server = _server
        try:
            return server.spawn(args, env, stdout_fd, stderr_fd)
        except OSError:
            with _lock:
                if _server is server:
                    server.close()
                    _server = None
    return None
