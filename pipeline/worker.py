"""Fresh-process workers: every model is measured in its own interpreter, so its memory is its own
and it is loaded from disk exactly as a user would load it.

    result = run_task("quality", {...}, out_dir, threads)   # in the stage
    python -m pipeline.worker JOB.json RESULT.json          # what that spawns
"""
from __future__ import annotations

import codecs
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

from pipeline.errors import StageError


def _die_with_parent() -> None:  # pragma: no cover - runs in the child
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: a killed run kills its workers
    except OSError:
        pass


class ChildTimeout(Exception):
    pass


def run_child(cmd: list[str], log_path: Path, timeout_s: float | None = None, env: dict | None = None) -> tuple[int, str]:
    """Run `cmd` in a child that dies with this process. Libraries print banners and INFO lines on stdout
    (GPTQModel): they go to `log_path`. Our logging and progress bars use stderr: passed through to the console
    as they come, the last lines kept for an error message. Returns (exit code, stderr tail); raises
    ChildTimeout when `timeout_s` passes (the child is killed)."""
    env = dict(env or os.environ, PYTHONUNBUFFERED="1")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.PIPE, preexec_fn=_die_with_parent)
        expired = threading.Event()
        timer = threading.Timer(timeout_s, lambda: (expired.set(), proc.kill())) if timeout_s else None
        if timer:
            timer.start()
        tail, decoder = bytearray(), codecs.getincrementaldecoder("utf-8")(errors="replace")
        try:
            while chunk := os.read(proc.stderr.fileno(), 4096):
                sys.stderr.write(decoder.decode(chunk))
                sys.stderr.flush()
                tail = (tail + chunk)[-16384:]
            code = proc.wait()
        except BaseException:  # SIGTERM/SIGINT in this process (Interrupted): the child goes with it
            proc.kill()
            proc.wait()
            raise
        finally:
            if timer:
                timer.cancel()
            proc.stderr.close()
    if expired.is_set():
        raise ChildTimeout(f"exceeded its {timeout_s:.0f} s limit")
    lines = [ln for ln in tail.decode(errors="replace").replace("\r", "\n").splitlines() if ln.strip()]
    return code, "\n".join(lines[-15:])


def run_task(task: str, args: dict, out_dir: Path, threads: int | None = None, timeout_s: float | None = None) -> dict:
    job, result = out_dir / f".job-{task}.json", out_dir / f".result-{task}.json"
    job.write_text(json.dumps({"task": task, "args": args, "threads": threads}, default=str))
    try:
        try:
            code, tail = run_child([sys.executable, "-m", "pipeline.worker", str(job), str(result)],
                                   out_dir / f"{task}.log", timeout_s)
        except ChildTimeout as e:
            raise StageError(f"{task} worker {e}") from None
        if code != 0:
            detail = json.loads(result.read_text()).get("error") if result.exists() else None
            raise StageError(f"{task} worker failed (exit code {code})" + (f": {detail}" if detail else f":\n{tail}"))
        return json.loads(result.read_text())
    finally:
        job.unlink(missing_ok=True)
        result.unlink(missing_ok=True)


def _quality(args: dict) -> dict:
    from pipeline.eval.quality import evaluate
    from pipeline.recipe import PerplexityConfig, SmokeConfig

    ref = Path(args["reference"]) if args.get("reference") else None
    return evaluate(Path(args["model_dir"]), Path(args["out"]), PerplexityConfig(**args["perplexity"]),
                    SmokeConfig(**args["smoke"]), args["device"], ref, args["label"])


def _speculative(args: dict) -> dict:
    import logging

    from pipeline.speculative.config import DraftConfig
    from pipeline.speculative.stage_api import measure_speculative

    und = Path(args["undistilled"]) if args.get("undistilled") else None
    fp = Path(args["fp_distilled"]) if args.get("fp_distilled") else None
    return measure_speculative(Path(args["verifier"]), Path(args["draft"]), args["prompts"],
                               DraftConfig(**args["draft_cfg"]), args["seed"], logging.getLogger("compress").info,
                               undistilled_dir=und, fp_distilled_dir=fp)


def _peak_rss_bytes() -> int:
    """This process's high-water RSS. VmHWM restarts at exec; ru_maxrss would include the parent's pages."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:  # pragma: no cover - non-Linux
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


TASKS = {"quality": _quality, "speculative": _speculative}


def main(argv: list[str]) -> int:
    job_path, result_path = Path(argv[0]), Path(argv[1])
    job = json.loads(job_path.read_text())
    from pipeline.cli_logging import setup_logging
    from pipeline.env import tame

    tame()
    import torch  # before setup_logging: torch installs its own log handlers on import

    setup_logging()

    if job.get("threads"):
        torch.set_num_threads(int(job["threads"]))
    try:
        result = TASKS[job["task"]](job["args"])
    except Exception as e:
        result_path.write_text(json.dumps({"error": f"{type(e).__name__}: {e}"}))
        raise
    result["worker_peak_rss_bytes"] = _peak_rss_bytes()
    result_path.write_text(json.dumps(result, default=float))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
