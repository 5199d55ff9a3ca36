"""The sandbox (pipeline/eval/sandbox.py): from inside, no host path is writable (a walk of the whole tree with
os.access and real writes in every directory); the limits hold; the output cap; the host's mounts are untouched;
the user-namespace mode as a real non-root user."""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from pipeline.eval import sandbox
from tests.humaneval_marks import sandboxes_alone  # noqa: F401

pytestmark = pytest.mark.usefixtures("sandboxes_alone")

needs_sandbox = pytest.mark.skipif(sandbox.mode() is None, reason="no sandbox (unshare/setpriv) works here")

# Walks / (no symlinks followed): every directory gets a real create+unlink attempt, every other entry os.access
# W_OK; prints the writable paths with their kind.
WALK = r"""
import json, os, stat
writable, dirs = [], 0
for root, ds, fs in os.walk("/", followlinks=False):
    dirs += 1
    probe = os.path.join(root, ".sandbox-write-probe")
    try:
        os.close(os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
        os.unlink(probe)
        writable.append([root, "dir (created a file)"])
    except OSError:
        pass
    for name in fs + ds:
        path = os.path.join(root, name)
        try:
            mode = os.lstat(path).st_mode
        except OSError:
            continue
        if not stat.S_ISLNK(mode) and os.access(path, os.W_OK):
            writable.append([path, "chr" if stat.S_ISCHR(mode) else "dir" if stat.S_ISDIR(mode) else "other"])
print(json.dumps({"writable": writable, "dirs": dirs}))
"""
DEVICES = {f"/dev/{d}" for d in ("null", "zero", "full", "random", "urandom")}  # writes to them persist nowhere
WALK_LIMITS = sandbox.Limits(timeout_s=400.0, output_bytes=16 << 20)


def _writable(out: dict, private: set[str]) -> set[str]:
    assert out["dirs"] > 1000, out["dirs"]  # it did walk the tree
    for path, kind in out["writable"]:
        if path in DEVICES:
            assert kind == "chr", (path, kind)
    return {p for p, _ in out["writable"] if p not in DEVICES} - private


@needs_sandbox
def test_only_the_private_tmp_is_writable_from_inside():
    before = Path("/proc/self/mountinfo").read_text()
    r = sandbox.run_script(WALK, limits=WALK_LIMITS)
    assert r["status"] == "exited" and r["returncode"] == 0, r
    out = json.loads(r["stdout"])
    private = {"/tmp/work"} if sandbox.kind() == "root" else {"/tmp", "/tmp/work"}
    assert _writable(out, private) == set(), out["writable"]
    assert Path("/proc/self/mountinfo").read_text() == before  # the host's mounts: untouched


@needs_sandbox
def test_the_hosts_world_writable_folders_are_out_of_reach():
    """/run/lock (mode 1777 on the host: a completion once left /run/lock/forge-probe there), /var/lock, /var/tmp,
    /dev/shm: each write fails inside, and nothing appears on the host."""
    targets = [f"{d}/forge-probe-{os.getpid()}" for d in ("/run/lock", "/var/lock", "/var/tmp", "/dev/shm")]
    code = ("import json\nout = {}\nfor t in %r:\n    try:\n        open(t, 'w').write('x')\n"
            "        out[t] = 'written'\n    except OSError as e:\n        out[t] = e.strerror\n"
            "print(json.dumps(out))\n") % (targets,)
    r = sandbox.run_script(code)
    out = json.loads(r["stdout"])
    assert "written" not in out.values() and set(out) == set(targets), out
    assert not any(Path(t).exists() for t in targets)


@needs_sandbox
@pytest.mark.skipif(not shutil.which("setpriv"), reason="needs setpriv")
def test_the_user_namespace_mode_as_a_non_root_user():
    """What a non-root user gets (as root: run as nobody): no host path writable, no process can start, no net."""
    probe = ("import posix, socket\ntry:\n    posix.fork()\n    print('forked')\nexcept OSError as e:\n"
             "    print('fork refused', e.errno)\ntry:\n    socket.create_connection(('1.1.1.1', 80), timeout=2)\n"
             "except OSError as e:\n    print('net refused', e.errno)\n")
    with tempfile.TemporaryDirectory() as tmp:
        os.chmod(tmp, 0o755)
        pkg = Path(tmp) / "pipeline" / "eval"  # the sandbox and its filter, alone (no venv: the user can't read it)
        pkg.mkdir(parents=True)
        for f in (Path(tmp) / "pipeline" / "__init__.py", pkg / "__init__.py"):
            f.write_text("")
        for name in ("sandbox.py", "sandbox_filter.py"):
            shutil.copy(Path(sandbox.__file__).with_name(name), pkg / name)
        for d in (Path(tmp) / "pipeline", pkg):
            os.chmod(d, 0o755)
        script = ("import json, sys\nsys.path.insert(0, sys.argv[1])\nfrom pipeline.eval import sandbox as sbx\n"
                  "assert sbx.kind() == 'user'\n"
                  f"lim = sbx.Limits(timeout_s={WALK_LIMITS.timeout_s}, output_bytes={WALK_LIMITS.output_bytes})\n"
                  f"a = sbx.run_script({probe!r})\nb = sbx.run_script({WALK!r}, limits=lim)\n"
                  "print(json.dumps([a['stdout'].decode(), b['status'], b['stdout'].decode()]))\n")
        cmd = [sandbox.python(), "-I", "-S", "-c", script, tmp]
        if os.geteuid() == 0:
            cmd = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", "env", "-i",
                   "PATH=/usr/bin:/bin", "HOME=/tmp"] + cmd
        res = subprocess.run(cmd, capture_output=True, text=True, cwd="/", timeout=500)
    if "Operation not permitted" in res.stderr or "unshare failed" in res.stderr:
        pytest.skip(f"no unprivileged user namespaces here: {res.stderr[-200:]}")
    assert res.returncode == 0, res.stderr[-2000:]
    probe_out, status, walk = json.loads(res.stdout)
    assert probe_out.split("\n")[:2] == ["fork refused 11", "net refused 101"], probe_out
    assert status == "exited"
    assert _writable(json.loads(walk), {"/tmp", "/tmp/work"}) == set(), walk


@needs_sandbox
def test_limits_inside():
    r = sandbox.run_script("print(open('/proc/self/limits').read()); import os; print(os.getuid(), os.getpid())")
    lines = {ln[:26].strip(): ln[26:].split()[:2] for ln in r["stdout"].decode().splitlines()[1:] if ln.strip()}
    assert lines["Max processes"] == ["1", "1"]
    assert lines["Max address space"] == [str(4 << 30)] * 2
    assert lines["Max file size"] == [str(16 << 20)] * 2 and lines["Max core file size"] == ["0", "0"]
    uid, pid = r["stdout"].decode().splitlines()[-1].split()
    assert (uid == "65534") == (sandbox.kind() == "root") and int(pid) > 1  # pid 1 is the root shell


@needs_sandbox
def test_output_is_capped_and_the_program_killed():
    lim = sandbox.Limits(timeout_s=30.0, output_bytes=256 << 10)
    t0 = time.monotonic()
    for code in ("while True: print('x' * 1000)", "import os\nwhile True: os.write(2, b'y' * 4096)"):
        r = sandbox.run_script(code, limits=lim)
        assert r["status"] == "output over the cap", r["status"]
    assert time.monotonic() - t0 < 20
    r = sandbox.run_script("import time; time.sleep(60)", limits=sandbox.Limits(timeout_s=1.0))
    assert r["status"] == "timed out"


# Probes from issue #42: the memory bound holds for memfd and shared memory too, SysV IPC dies with the sandbox,
# the sandbox dies with its worker, and no unix socket of the host is reachable.
MEMFD = r"""
import os
n = 0
try:
    for i in range(96):
        fd = os.memfd_create(f"m{i}")
        os.write(fd, bytes(8 << 20))
        n += 1
except OSError as e:
    print("refused", e.errno)
print("held", n * 8, "MiB")
"""


@needs_sandbox
def test_memfd_files_do_not_escape_the_memory_limit():
    """96 memfd files of 8 MiB each (768 MiB) under a 256 MiB limit: the file-size limit caps each file, not their
    number, so the program must be refused before it holds more than its limit."""
    r = sandbox.run_script(MEMFD, limits=sandbox.Limits(timeout_s=60.0, address_space=256 << 20))
    out = r["stdout"].decode()
    held = int(out.split("held ")[1].split()[0])
    assert held < 256, out


SHM = r"""
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
libc.shmget.restype = ctypes.c_int
shmid = libc.shmget(%d, 64 << 20, 0o1666)
print("shmget", shmid, ctypes.get_errno())
"""


def _host_segments(key: int) -> list[int]:
    """The ids of the host's SysV segments with `key` (/proc/sysvipc/shm: key shmid ...)."""
    rows = [ln.split() for ln in Path("/proc/sysvipc/shm").read_text().splitlines()[1:]]
    return [int(r[1]) for r in rows if int(r[0]) == key]


@needs_sandbox
@pytest.mark.skipif(not Path("/proc/sysvipc/shm").exists(), reason="no SysV IPC here")
def test_a_sysv_segment_does_not_outlive_the_sandbox():
    key = 0x5EED0000 + os.getpid() % 0xFFFF
    r = sandbox.run_script(SHM % key, limits=sandbox.Limits(timeout_s=30.0))
    left = _host_segments(key)
    for shmid in left:  # ours: remove it so a failing run leaves no 64 MiB behind
        subprocess.run(["ipcrm", "-m", str(shmid)], check=False)
    assert r["status"] == "exited" and r["stdout"].startswith(b"shmget"), r
    assert left == [], (left, r["stdout"])


WORKER = r"""
import sys, time
sys.path.insert(0, sys.argv[1])
from pipeline.eval import sandbox
box = sandbox.Sandbox("import time\nprint('up', flush=True)\ntime.sleep(600)  # %s", sandbox.Limits(timeout_s=600.0))
print(box.recv_line(time.monotonic() + 60).decode(), flush=True)
time.sleep(600)
"""


def _with_marker(marker: str) -> list[int]:
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) != os.getpid():
            with contextlib.suppress(OSError):
                if marker.encode() in (d / "cmdline").read_bytes():
                    pids.append(int(d.name))
    return pids


@needs_sandbox
def test_the_sandbox_dies_with_its_worker():
    """A worker SIGKILLed while its program sleeps (a sleeping program never reaches its CPU limit): nothing of the
    sandbox stays (the program, its namespace's init, unshare)."""
    marker = f"sandbox-orphan-probe-{os.getpid()}-{time.time_ns()}"
    repo = str(Path(__file__).resolve().parents[2])
    worker = subprocess.Popen([sys.executable, "-c", WORKER % marker, repo], stdout=subprocess.PIPE, text=True)
    try:
        assert worker.stdout is not None and worker.stdout.readline().strip() == "up"
        assert _with_marker(marker)  # the sandbox is there
    finally:
        worker.kill()
        worker.wait()
    left = _with_marker(marker)
    for _ in range(200):  # bounded wait for the kernel to deliver the parent-death signals
        if not left:
            break
        time.sleep(0.05)
        left = _with_marker(marker)
    for pid in left:  # a failing run cleans up what it started
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    assert left == []


CONNECT = r"""
import socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect(sys.argv[1] if len(sys.argv) > 1 else %r)
print("connected")
"""


@needs_sandbox
@pytest.mark.parametrize("kind", ["root", "user"])
def test_no_unix_socket_of_the_host_is_reachable(kind):
    """A world-connectable unix socket outside /tmp and /run (an ssh ControlPath or gpg-agent socket in a home
    directory is one in user mode: the program keeps the user's uid): connect() from inside fails."""
    if kind == "root" and os.geteuid() != 0:
        pytest.skip("the root mode needs root")
    base = Path("/var/tmp") if os.access("/var/tmp", os.W_OK) else Path.home()
    with tempfile.TemporaryDirectory(dir=base) as tmp:
        os.chmod(tmp, 0o755)
        path = os.path.join(tmp, "agent.sock")
        srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        srv.bind(path)
        os.chmod(path, 0o777)
        srv.listen(1)
        try:
            r = sandbox.run_script(CONNECT % path, limits=sandbox.Limits(timeout_s=30.0), sandbox_kind=kind)
        finally:
            srv.close()
    if kind == "user" and b"unshare failed" in r["stderr"]:
        pytest.skip("no user namespaces here")
    assert r["status"] == "exited" and b"connected" not in r["stdout"], r
    assert b"PermissionError" in r["stderr"], r["stderr"]
