"""Fresh-process workers: every model is measured in its own process, so its memory is its own and it is
loaded from disk exactly as a user would load it. A quality or speculative task is a fork of a server that imported
torch and transformers once (pipeline/base/forkserver.py, FORKED below); every other task is a new interpreter.

    result = run_task("quality", {...}, out_dir, threads)   # in the stage (tasks: TASKS below)
    result = run_task("tasks", {...}, out_dir, work="pipeline.eval.tasks:worker_task")  # a plug-in measurement's
    python -m pipeline.base.worker JOB.json RESULT.json          # what that spawns

Its stdout (library banners, library warnings) goes to out_dir/<task>.log; its stderr (our log lines,
progress bars) to the console and that log, less the known-harmless library lines (HARMLESS_STDERR).
"""
from __future__ import annotations

import codecs
import importlib
import json
import os
import re
import select
import subprocess
import sys
import threading
from pathlib import Path
from typing import IO

from pipeline.base import forkserver
from pipeline.base.cli_logging import setup_logging
from pipeline.base.env import die_with_parent, tame, with_checkout_on_path
from pipeline.base.errors import StageError
from pipeline.base.memory import peak_rss_bytes


class ChildTimeout(Exception):
    pass


# Known-harmless lines that libraries print on stderr, most of them at import time, before a worker has set up
# logging (so no logger level reaches them). They look like errors and are not: run_child keeps them off the
# console; the task's log file still has them. Add a pattern only with the reason it is harmless.
HARMLESS_STDERR: tuple[re.Pattern[str], ...] = tuple(re.compile(p) for p in (
    # torchao loads its optional CUDA/MX kernel libraries (_C_mxfp8, _C_cutlass_90a) on import; the CPU build
    # has none of them and needs none (logger "torchao", WARNING)
    r"^Failed to load \S*torchao/_C\w*\S*\.so: ",
    # bitsandbytes on an AVX512-BF16 CPU looks for the optional `kernels` package for a faster 4-bit CPU gemm
    # and falls back to its own kernel (logger "bitsandbytes.backends.cpu.ops", WARNING)
    r"^Failed to load CPU gemm_4bit_forward from kernels-community",
    # torch 2.13 deprecates register_constant() on Enum subclasses, which torchao calls on import
    # (torch's own log handler: "W<date> <pid> .../torch/utils/_pytree.py:630] <enum ...> is an Enum subclass")
    r"torch/utils/_pytree\.py:\d+\] <enum '\w+'> is an Enum subclass and is now natively supported",
))


def harmless(line: str) -> bool:
    """Whether a stderr line is one of HARMLESS_STDERR (line ending ignored)."""
    text = line.rstrip("\r\n")
    return any(p.search(text) for p in HARMLESS_STDERR)


class _StderrRelay:
    """A child's stderr, as it comes: every byte to the task's log; to the console all but HARMLESS_STDERR
    lines. Output is cut into pieces that end in "\n" or "\r", each checked whole. The unfinished piece after
    the last one is held until it ends, except a progress bar's redraw (a piece after "\r", as tqdm writes
    them), which is shown when the child pauses (`flush_redraw`), so the bar still moves."""

    def __init__(self, log, console) -> None:
        self.log, self.console = log, console
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.partial = ""
        self.after_cr = False  # the held piece follows a "\r": a redraw, not the start of a line
        self.tail = ""  # the end of what reached the console, for an error message

    def feed(self, chunk: bytes) -> None:
        self.log.write(chunk)
        pieces = re.split(r"(?<=[\r\n])", self.partial + self.decoder.decode(chunk))
        self.partial = pieces.pop()
        if pieces:
            self.after_cr = pieces[-1].endswith("\r")
        self._show("".join(p for p in pieces if not harmless(p)))

    @property
    def redraw_pending(self) -> bool:
        return bool(self.partial) and self.after_cr

    def flush_redraw(self) -> None:
        if self.redraw_pending and not harmless(self.partial):
            self._show(self.partial)
            self.partial = ""

    def close(self) -> None:
        rest = self.partial + self.decoder.decode(b"", final=True)
        self.partial = ""
        if not harmless(rest):
            self._show(rest)

    def _show(self, text: str) -> None:
        if text:
            self.console.write(text)
            self.console.flush()
            self.tail = (self.tail + text)[-16384:]


def _expire(expired: threading.Event, proc: subprocess.Popen | forkserver.Forked) -> None:
    expired.set()
    proc.kill()


def run_child(cmd: list[str], log_path: Path, timeout_s: float | None = None,
              env: dict | None = None, fork_args: list[str] | None = None) -> tuple[int, str]:
    """Run `cmd` in a child that dies with this process. Libraries print banners and INFO lines on stdout
    (GPTQModel): they go to `log_path`. Our logging and progress bars use stderr: passed through to the console
    as they come (all but the known-harmless library lines, HARMLESS_STDERR) and written to `log_path` too;
    the last lines kept for an error message. Returns (exit code, stderr tail); raises ChildTimeout when
    `timeout_s` passes (the child is killed). With `fork_args` (a worker task's job and result paths), the child is
    a fork of the pre-imported server (pipeline/base/forkserver.py) where one runs, else `cmd` in a new interpreter."""
    env = dict(env or os.environ, PYTHONUNBUFFERED="1")
    with open(log_path, "wb", buffering=0) as log:  # the child's stdout and our copy of its stderr share it
        proc: subprocess.Popen | forkserver.Forked | None = None
        stderr: IO[bytes] | None = None
        if fork_args is not None:
            read_end, write_end = os.pipe()
            try:
                proc = forkserver.spawn(fork_args, env, log.fileno(), write_end)
            finally:
                os.close(write_end)  # the child holds its own copy: end of file when it exits
            if proc is None:
                os.close(read_end)
            stderr = os.fdopen(read_end, "rb", buffering=0) if proc is not None else None
        if proc is None:
            proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.PIPE, preexec_fn=die_with_parent)
            stderr = proc.stderr
        expired = threading.Event()
        timer = threading.Timer(timeout_s, _expire, (expired, proc)) if timeout_s else None
        if timer:
            timer.start()
        assert stderr is not None  # stderr=PIPE, or the fork's pipe
        relay, fd = _StderrRelay(log, sys.stderr), stderr.fileno()
        try:
            while True:
                if relay.redraw_pending and not select.select([fd], [], [], 0.2)[0]:
                    relay.flush_redraw()  # the child paused mid-redraw of a progress bar: show it now
                    continue
                chunk = os.read(fd, 4096)
                if not chunk:
                    break
                relay.feed(chunk)
            relay.close()
            code = proc.wait()
        except BaseException:  # SIGTERM/SIGINT in this process (Interrupted): the child goes with it
            proc.kill()
            proc.wait()
            raise
        finally:
            if timer:
                timer.cancel()
            stderr.close()
    if expired.is_set():
        raise ChildTimeout(f"exceeded its {timeout_s:.0f} s limit")
    lines = [ln for ln in relay.tail.replace("\r", "\n").splitlines() if ln.strip()]
    return code, "\n".join(lines[-15:])


def run_task(task: str, args: dict, out_dir: Path, threads: int | None = None, timeout_s: float | None = None,
             limit_setting: str | None = None, work: str | None = None) -> dict:
    """Run TASKS[task](args), or the function `work` names ("module:function", a plug-in measurement's declared
    worker task, pipeline/eval/measures/), in a fresh worker process; its log is out_dir/<task>.log.
    `limit_setting` names the setting behind `timeout_s` in the error when it is exceeded."""
    job, result = out_dir / f".job-{task}.json", out_dir / f".result-{task}.json"
    job.write_text(json.dumps({"task": task, "work": work, "args": args, "threads": threads}, default=str))
    env = with_checkout_on_path(os.environ)
    try:
        try:
            code, tail = run_child([sys.executable, "-m", "pipeline.base.worker", str(job), str(result)],
                                   out_dir / f"{task}.log", timeout_s, env,
                                   fork_args=[str(job), str(result)] if task in FORKED else None)
        except ChildTimeout as e:
            raise StageError(f"{task} worker {e}" + (f" ({limit_setting})" if limit_setting else "")) from None
        if code != 0:
            detail = json.loads(result.read_text()).get("error") if result.exists() else None
            raise StageError(f"{task} worker failed (exit code {code})" + (f": {detail}" if detail else f":\n{tail}"))
        return json.loads(result.read_text())
    finally:
        job.unlink(missing_ok=True)
        result.unlink(missing_ok=True)


# task name -> "module:function" (a function of the args dict returning a JSON-able dict). Named, not imported:
# the worker imports only the task it runs, and the measuring modules can call run_task without an import cycle
# (pipeline/base/codehash.py follows these strings, so a unit's identity still covers the task's code).
TASKS = {
    "quality": "pipeline.eval.quality:worker_task",
    "speculative": "pipeline.speculative.evaluate:worker_task",
    "speed": "pipeline.eval.speed:worker_task",
}


# the tasks forked from the pre-imported server (pipeline/base/forkserver.py); every other task starts a new
# interpreter: speed's figures are compared with other engines' fresh processes (the speculative task compares its
# decoder with plain decoding inside its own process), and a plug-in measurement may set the environment its
# libraries read on import (the tasks worker's HF_HUB_OFFLINE), which the server's transformers has already read
FORKED = frozenset({"quality", "speculative"})


def task_function(task: str, work: str | None = None):
    """The function behind `work` ("module:function"), or else TASKS[task], imported now."""
    module, _, name = (work or TASKS[task]).partition(":")
    return getattr(importlib.import_module(module), name)


def main(argv: list[str]) -> int:
    job_path, result_path = Path(argv[0]), Path(argv[1])
    job = json.loads(job_path.read_text())

    tame()
    # late: after tame(), which sets the environment torch, transformers and GPTQModel read on import
    import torch  # before setup_logging: torch installs its own log handlers on import

    setup_logging(library_log=sys.stdout)  # library warnings to the task's log (run_child sends stdout there)

    if job.get("threads"):
        torch.set_num_threads(int(job["threads"]))
    try:
        result = task_function(job["task"], job.get("work"))(job["args"])
    except Exception as e:
        result_path.write_text(json.dumps({"error": f"{type(e).__name__}: {e}"}))
        raise
    result["worker_peak_rss_bytes"] = peak_rss_bytes()
    result_path.write_text(json.dumps(result, default=float))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
