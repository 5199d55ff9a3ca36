"""A sandbox for untrusted Python (model-generated code): a child process in its own namespaces, talked to through
pipes with a deadline and a cap on what it may write.

    with Sandbox(code, Limits(timeout_s=10)) as box:   # python -I -S -c code, inside the sandbox
        box.send(b"...\\n", deadline)                   # to its stdin
        line = box.recv_line(deadline)                  # from its stdout: TimedOut, OutputOverflow or Ended
    run_script(code, stdin, Limits(...)) -> {"status", "returncode", "stdout", "stderr"}   # one-shot
    mode() -> a description of the sandbox that works here, or None (probed once a process)

What holds, as root (CI), the program running as `nobody`:
  * namespaces (`unshare --mount --net --pid --ipc --fork --kill-child`): no network (a fresh, unconfigured
    loopback; abstract unix sockets are per network namespace), its own process tree and a /proc that shows only
    it, its own SysV IPC and POSIX message queues (gone with it);
  * parent death: unshare runs under `setpriv --pdeathsig=KILL`, and --kill-child kills the namespace's init when
    unshare dies, which kills the namespace: a worker that dies (SIGKILL included) leaves no sandbox behind;
  * files: every mount of its (private) mount namespace is remounted read-only (the host's mounts are untouched),
    then a private tmpfs on /tmp holds the one writable folder, /tmp/work (`Limits.tmp_bytes`); /dev is a read-only
    tmpfs with only null, zero, full, random and urandom bound in; /run (sockets, /run/lock) is hidden under an
    empty read-only tmpfs. Nothing the program writes outlives it, and no host path is writable from it
    (tests/unit/test_sandbox.py walks the whole tree from inside to check). A read-only mount does not stop a
    connect() to a unix socket file: one left world-writable outside /run and /tmp would stay reachable (the walk
    lists it; there is none on the CI machine);
  * privileges: `setpriv --reuid nobody --regid nogroup --clear-groups --no-new-privs`, every capability dropped
    (also from the bounding set, so a nested user namespace cannot make the read-only mounts writable: they come
    locked);
  * resources (`prlimit`, hard = soft, set before the interpreter starts): CPU seconds, address space, file size,
    no core, open files, and RLIMIT_NPROC = 1: the program can start no process and no thread (the user's own
    process already counts as one);
  * system calls (a seccomp filter, pipeline/eval/sandbox_filter.py, installed before the program's interpreter is
    exec'd): memfd_create, SysV shmget/msgget/semget, io_uring and AF_UNIX sockets are refused (EPERM); POSIX
    shared memory is /dev/shm, read-only. So its memory is bounded by one address space (`Limits.address_space`,
    4 GiB) plus its tmpfs plus kernel buffers bounded by `Limits.open_files`: with W sandboxes at once, about
    W x (4 GiB + 64 MiB). No cgroup is used: where cgroup v1 holds the memory controller (this project's machines:
    the v2 hierarchy has only hugetlb), a v2 memory limit cannot be made; the filter holds without one;
  * output: what it writes to its stdout and stderr together is read up to `Limits.output_bytes`, then it is
    killed (OutputOverflow);
  * time: a wall-clock deadline per read and write; `kill()` SIGKILLs the namespace's init (a root shell that
    the program cannot signal), which makes the kernel kill every process of the namespace, and waits for it.
As another user (`unshare -r`, a user namespace): the same, except that the program keeps the user's uid (files the
user can read stay readable; none is writable: every mount is read-only; the user's unix sockets, an ssh
ControlPath or a gpg-agent in the home directory, are not reachable: no AF_UNIX socket can be made) and a pid 1 it
cannot signal either.
The interpreter runs with -I -S (no site-packages, no PYTHONPATH) and an emptied environment.
"""
from __future__ import annotations

import math
import os
import platform
import select
import shutil
import signal
import subprocess
import sys
import time
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from pipeline.eval import sandbox_filter


@dataclass(frozen=True)
class Limits:
    timeout_s: float = 10.0
    address_space: int = 4 << 30
    file_bytes: int = 16 << 20
    tmp_bytes: int = 64 << 20
    output_bytes: int = 1 << 20
    open_files: int = 256  # bounds the kernel buffers (pipes, sockets) a program can fill

    def prlimit(self) -> list[str]:
        cpu = int(math.ceil(self.timeout_s)) + 2
        return ["prlimit", f"--cpu={cpu}", f"--as={self.address_space}", f"--fsize={self.file_bytes}", "--core=0",
                "--nproc=1", f"--nofile={self.open_files}", "--"]


class SandboxError(Exception):
    """The program did not answer as asked; the message says how."""


class TimedOut(SandboxError):
    pass


class OutputOverflow(SandboxError):
    pass


class Ended(SandboxError):
    pass


# Runs as root (or as the user's root in a user namespace) inside the new namespaces, then drops to the program.
# $1: the owner of /tmp/work ("-": keep), $2: the tmpfs size; the rest: the command. Not `exec`: this shell stays
# the namespace's pid 1, which the program cannot signal; its death (kill() or unshare's, --kill-child) kills all.
_SETUP = r"""set -euf
owner=$1 size=$2; shift 2
for m in $(cut -d' ' -f5 /proc/self/mountinfo); do
  m=$(printf '%b' "$m")
  mount -n -o remount,bind,ro "$m" 2>/dev/null || ! mountpoint -q "$m" ||
    { echo "sandbox: $m stays writable" >&2; exit 97; }
done
mount -n -t tmpfs -o "mode=755,size=$size,nosuid,nodev" tmpfs /tmp
mkdir /tmp/dev
mount -n -t tmpfs -o mode=755,size=64k,nosuid,noexec tmpfs /tmp/dev
for d in null zero full random urandom; do touch /tmp/dev/$d; mount -n --bind /dev/$d /tmp/dev/$d; done
ln -s /proc/self/fd /tmp/dev/fd; ln -s /proc/self/fd/0 /tmp/dev/stdin
ln -s /proc/self/fd/1 /tmp/dev/stdout; ln -s /proc/self/fd/2 /tmp/dev/stderr; mkdir /tmp/dev/shm
mount -n -o remount,bind,ro /tmp/dev
mount -n --move /tmp/dev /dev
rmdir /tmp/dev
if [ -d /run ] && [ ! -L /run ]; then mount -n -t tmpfs -o ro,size=4k,mode=755,nosuid,nodev tmpfs /run; fi
mount -n -t proc -o ro,nosuid,nodev,noexec proc /proc
mkdir -m 700 /tmp/work
if [ "$owner" != - ]; then chown "$owner" /tmp/work; fi
"$@"
exit $?
"""
_DROP = {"root": ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", "--inh-caps=-all",
                  "--bounding-set=-all", "--no-new-privs"],
         "user": ["setpriv", "--inh-caps=-all", "--bounding-set=-all", "--no-new-privs"]}
_ENV = ["env", "-i", "HOME=/tmp/work", "TMPDIR=/tmp/work", "PATH=/usr/bin:/bin", "LANG=C.UTF-8", "OMP_NUM_THREADS=1",
        "PYTHONDONTWRITEBYTECODE=1", "PYTHONHASHSEED=0"]
_MODES = {"root": "unshare mount+net+pid+ipc namespaces, every mount read-only, private tmpfs /tmp, setpriv "
                  "nobody:nogroup, no capabilities, one process, seccomp (no memfd, SysV IPC or unix sockets), "
                  "killed with its parent",
          "user": "unshare user+mount+net+pid+ipc namespaces, every mount read-only, private tmpfs /tmp, no "
                  "capabilities, one process, seccomp (no memfd, SysV IPC or unix sockets), killed with its parent "
                  "(the user's uid: the user's readable files stay readable)"}
_PROBE: dict[str, str | None] = {}


def python() -> str:
    """An interpreter the unprivileged user can execute (the venv's may live under /root): $COMPRESS_SANDBOX_PYTHON,
    else the system python3."""
    return os.environ.get("COMPRESS_SANDBOX_PYTHON") or shutil.which("python3", path="/usr/bin:/bin:/usr/local/bin") \
        or sys.executable


def argv(code: str, limits: Limits, kind: str) -> list[str]:
    """The command that runs `code` (python -I -S -c) in the sandbox of `kind` ("root" or "user")."""
    ns = ["setpriv", "--pdeathsig=KILL", "unshare", "--mount", "--net", "--pid", "--ipc", "--fork", "--kill-child"]
    if kind == "user":
        ns.insert(3, "-r")
    owner = "nobody:nogroup" if kind == "root" else "-"
    return (ns + ["sh", "-c", _SETUP, "sandbox", owner, str(limits.tmp_bytes)] + _DROP[kind] + limits.prlimit()
            + _ENV + [python(), "-I", "-S", "-c", sandbox_filter.LAUNCHER,
                      sandbox_filter.program(platform.machine()).hex(), code])


def kind() -> str:
    return "root" if os.geteuid() == 0 else "user"


def mode() -> str | None:
    """Which sandbox works on this machine (probed once a process by running a trivial program), or None."""
    if "mode" not in _PROBE:
        ok = all(shutil.which(t) for t in ("unshare", "setpriv", "prlimit", "mountpoint")) \
            and sandbox_filter.supported(platform.machine())
        if ok:
            r = run_script("print('sandbox ok')", b"", Limits(timeout_s=30.0))
            ok = r["status"] == "exited" and r["returncode"] == 0 and r["stdout"] == b"sandbox ok\n"
        _PROBE["mode"] = _MODES[kind()] if ok else None
    return _PROBE["mode"]


class Sandbox:
    """One program in the sandbox, its stdin/stdout as a line channel; kill() (or leaving the with block) ends it
    and everything it started."""

    def __init__(self, code: str, limits: Limits, sandbox_kind: str | None = None):
        self.limits = limits
        self.proc = subprocess.Popen(argv(code, limits, sandbox_kind or kind()), stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                                     cwd="/", env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"})
        assert self.proc.stdin is not None and self.proc.stdout is not None and self.proc.stderr is not None  # PIPE
        self.stdin: IO[bytes] = self.proc.stdin
        self._pipes = (self.proc.stdin, self.proc.stdout, self.proc.stderr)
        self._out, self._err = self.proc.stdout.fileno(), self.proc.stderr.fileno()
        self._bufs = {self._out: bytearray(), self._err: bytearray()}
        self._open = set(self._bufs)
        for fd in (*self._open, self.stdin.fileno()):
            os.set_blocking(fd, False)
        self.read_bytes = 0

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc) -> None:
        self.kill()

    @property
    def stderr(self) -> bytes:
        return bytes(self._bufs[self._err][-4096:])

    def send(self, data: bytes, deadline: float) -> None:
        fd, view = self.stdin.fileno(), memoryview(data)
        while view:
            if not select.select([], [fd], [], max(0.0, deadline - time.monotonic()))[1]:
                raise TimedOut("timed out")
            try:
                view = view[os.write(fd, view):]
            except BrokenPipeError:
                raise self._ended() from None

    def recv_line(self, deadline: float) -> bytes:
        buf = self._bufs[self._out]
        while (i := buf.find(b"\n")) < 0:
            if self._out not in self._open:
                raise self._ended()
            self._pump(deadline)
        line = bytes(buf[:i])
        del buf[:i + 1]
        return line

    def read_all(self, deadline: float) -> bytes:
        """Everything it writes to stdout and stderr until it closes both; returns stdout."""
        while self._open:
            self._pump(deadline)
        return bytes(self._bufs[self._out])

    def _pump(self, deadline: float) -> None:
        """Read what is there (stdout and stderr, so neither pipe fills), counting against the output cap."""
        ready = select.select(list(self._open), [], [], max(0.0, deadline - time.monotonic()))[0]
        if not ready:
            raise TimedOut("timed out")
        for fd in ready:
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                self._open.discard(fd)
                continue
            self.read_bytes += len(chunk)
            if self.read_bytes > self.limits.output_bytes:
                raise OutputOverflow(f"failed: the program wrote more than {self.limits.output_bytes} bytes")
            self._bufs[fd] += chunk

    def _ended(self) -> Ended:
        try:
            code = self.proc.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            code = None
        tail = (self.stderr.decode("utf-8", "replace").strip().splitlines() or [""])[-1][:200]
        return Ended(f"failed: the program's process ended with code {code} ({tail})")

    def kill(self, wait_s: float = 5.0) -> None:
        """SIGKILL the namespace's init (the kernel then kills every process in the namespace, and the init exits
        only once they are gone), then unshare's process group; wait (bounded) until both are gone."""
        deadline = time.monotonic() + wait_s
        init = None
        while self.proc.poll() is None and init is None and time.monotonic() < deadline:
            init = _child_of(self.proc.pid)
            if init is None:
                time.sleep(0.01)
        if init is not None:
            _signal(init)
        with suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        while init is not None and _alive(init) and time.monotonic() < deadline:
            time.sleep(0.01)
        for f in self._pipes:
            with suppress(OSError):
                f.close()


def _signal(pid: int) -> None:
    with suppress(ProcessLookupError, PermissionError):
        os.kill(pid, signal.SIGKILL)


def _stat(pid: int) -> list[str] | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2:].split()  # state ppid pgrp ...


def _alive(pid: int) -> bool:
    fields = _stat(pid)
    return fields is not None and fields[0] not in ("Z", "X")


def _child_of(parent: int) -> int | None:
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            fields = _stat(int(d.name))
            if fields is not None and int(fields[1]) == parent:
                return int(d.name)
    return None


def run_script(code: str, stdin: bytes = b"", limits: Limits = Limits(), sandbox_kind: str | None = None) -> dict:
    """Run `code` to its end (or its deadline, or the output cap): {"status": "exited" / "timed out" / "output over
    the cap", "returncode", "stdout", "stderr" (its last 4 KiB)}."""
    deadline = time.monotonic() + limits.timeout_s
    status, out, code_ = "exited", b"", None
    with Sandbox(code, limits, sandbox_kind) as box:
        try:
            box.send(stdin, deadline)
            box.stdin.close()
            out = box.read_all(deadline)
            code_ = box.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except (TimedOut, subprocess.TimeoutExpired):
            status = "timed out"
        except OutputOverflow:
            status = "output over the cap"
        except Ended as e:  # stdin closed early: read what it wrote
            status, out = "exited", bytes(box._bufs[box._out]) or str(e).encode()
            code_ = box.proc.poll()
    return {"status": status, "returncode": code_, "stdout": out, "stderr": box.stderr}
