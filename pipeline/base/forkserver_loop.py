"""The worker fork server (pipeline/base/forkserver.py starts it, as `python -m pipeline.base.forkserver_loop SOCKET`,
with tame()'s variables in its environment). It imports the libraries every worker task needs at its top, once, then
forks one child per connection: the child takes the run's log file and stderr pipe as its stdout and stderr, the
task's environment and working directory, and runs pipeline.base.worker.main, which imports the task's own code from
disk. The server sends each connection its child's pid and, once it has reaped it, its exit code (negative: the
signal that ended it).

Not GPTQModel: its import starts threads (7, and jemalloc's), and a fork copies none of them. Nothing here runs a
torch operation, so no OpenMP pool exists to be copied either. bitsandbytes is, with a CPU build of torch (0.8 s of CPU
a task: GPTQModel and transformers' bitsandbytes loader import it): it starts no thread and runs no torch operation on
import (measured: the server's thread count unchanged; a fork then runs a 2-thread matmul). With a CUDA build it
would load its CUDA library, and a CUDA driver initialised before a fork is unusable in the child: not imported
there. transformers.modeling_utils is not imported either: its import starts a native thread.

The run's process ends the server with SIGTERM (its parent-death signal): it removes its socket and folder, then
exits, and its tasks die with it (theirs is SIGKILL). A server killed outright (Ray SIGKILLs a worker's children when
the worker exits) leaves its folder; the next server's start removes it (forkserver.remove_stale_folders).
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import signal
import socket
import sys
import traceback
from pathlib import Path

import torch  # noqa: F401
import transformers  # noqa: F401
import transformers.quantizers.auto  # noqa: F401  (torchao: 1.4 s of CPU a task, on every checkpoint's load)
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401  (the lazy modules a task loads)

from pipeline.base.env import die_with_parent
from pipeline.base.forkserver import remove_socket
from pipeline.base.memory import settle_heap
from pipeline.base.worker import main

if torch.version.cuda is None and torch.version.hip is None:  # a CPU build: bitsandbytes touches no device driver
    import bitsandbytes  # noqa: F401  (see above)

MAX_MESSAGE = 1 << 20  # the job's environment, as JSON


def child(job: dict, fds: list[int], keep_closed: list[socket.socket]) -> None:  # pragma: no cover - a fork
    code = 1
    try:
        for s in keep_closed:
            s.close()
        os.dup2(fds[0], 1)
        os.dup2(fds[1], 2)
        for fd in fds:
            os.close(fd)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        die_with_parent()  # the server, which dies with the run
        os.chdir(job["cwd"])
        os.environ.clear()
        os.environ.update(job["env"])
        sys.argv = [str(Path(__file__).with_name("worker.py")), *job["args"]]
        code = main(job["args"])
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        with contextlib.suppress(Exception):
            logging.shutdown()
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def serve(path: str) -> None:  # pragma: no cover - runs in the server process
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the run's Ctrl-C reaches its tasks; the server ends with the run

    def end(*_) -> None:  # SIGTERM: the run's process is gone (PDEATHSIG) or closes it
        remove_socket(path)
        os._exit(0)

    signal.signal(signal.SIGTERM, end)
    settle_heap()  # the imports above, out of every task's collections (and their pages not written by them)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(16)
    print("ready", flush=True)
    running: dict[int, socket.socket] = {}
    while True:
        if select.select([listener], [], [], 0.1)[0]:
            conn, _ = listener.accept()
            try:
                msg, fds, _, _ = socket.recv_fds(conn, MAX_MESSAGE, 2)
                job = json.loads(msg)
            except (OSError, ValueError):
                conn.close()
                continue
            pid = os.fork()
            if pid == 0:
                child(job, fds, [listener, conn, *running.values()])
            for fd in fds:
                os.close(fd)
            with contextlib.suppress(OSError):
                conn.send(str(pid).encode())
            running[pid] = conn
        while running:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            if pid in running:
                done = running.pop(pid)
                with contextlib.suppress(OSError):
                    done.send(str(os.waitstatus_to_exitcode(status)).encode())
                done.close()


if __name__ == "__main__":
    serve(sys.argv[1])
