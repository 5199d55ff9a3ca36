"""The `validate/<model>/serve` measurement: serve a checkpoint in a subprocess on a free loopback port, compare its
greedy output with `generate`'s, load-test it at each concurrency level, stop it by its pid."""
from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoTokenizer

from pipeline.base.errors import StageError
from pipeline.model.models import single_gguf
from pipeline.quant.checkpoint import load_checkpoint
from pipeline.serve import engines
from pipeline.serve.engines.base import error_line
from pipeline.serve.loadtest import run
from pipeline.serve.server import KEY_ENV

# what the `compress serve` subprocess runs, named so the serve unit's identity covers it (pipeline/base/codehash.py);
# the CLI that parses its arguments is harness, followed by no unit
SERVER_CODE = "pipeline.serve.server"


class Refused(StageError):
    """The server exited before it was ready: the engine refused the folder; `line` is its first error line."""

    def __init__(self, message: str, line: str) -> None:
        super().__init__(message)
        self.line = line


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict, timeout: float, log: Path | None = None) -> dict:
    """POST a JSON body; an HTTP error is a StageError with the server's answer and, from its log, the first error
    line (a bare "HTTP Error 500" says nothing: vLLM's engine fails a request with the reason in its own log)."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        answer = " ".join(e.read().decode(errors="replace").split())[:300]
        said = f"; its log: {_error_line(log)} (log: {log})" if log is not None and log.is_file() else ""
        raise StageError(f"the server answered HTTP {e.code} to {url}: {answer or e.reason}{said}") from None


def measure(folder: Path, cfg, prompts: list[str], out: Path, threads: int | None, device: str = "cpu",
            engine: str = "transformers", score: Callable[[str, str], dict] | None = None,
            score_tasks: Callable[[str, str], dict] | None = None) -> dict:
    """{"equality": {...}, "levels": [...], "engine", "versions", "ready_s", "server_exit"}; the server's log in
    out/. The server is `compress serve --engine <engine>` in a subprocess; the options passed are those the engine
    applies (pipeline/serve/engines), so none is refused. score(url, model name), when given, runs after the load
    test on the same server; its answer is the record's "perplexity". score_tasks(url, model name), when given, runs
    last; its answer ({"tasks", "task_recovery", ...}) is merged into the record."""
    eng = engines.get(engine)
    opts = {"slots": max(cfg.concurrency), "max_queue": max(cfg.concurrency), "max_model_len": cfg.max_model_len,
            "queue_timeout_s": cfg.timeout_s, "threads": threads}
    if cfg.tensor_parallel_size * cfg.pipeline_parallel_size > 1:  # engines without them are refused at check
        opts |= {"tensor_parallel_size": cfg.tensor_parallel_size, "pipeline_parallel_size": cfg.pipeline_parallel_size}
    args = ["--device", device, *eng.serve_args(cfg)]
    for k, v in opts.items():
        if v is not None and k in eng.honours:
            args += ["--" + k.replace("_", "-"), str(v)]
    with serving(folder, engine, args, out / "server.log", cfg.timeout_s) as server:
        url = server.url
        served = []
        for p in prompts[:cfg.equality_prompts]:
            body = {"model": folder.name, "prompt": p, "max_tokens": cfg.equality_tokens, "return_token_ids": True,
                    "temperature": 0.0, **eng.equality_request}
            choice = _post(url + "/v1/completions", body, cfg.timeout_s, out / "server.log")["choices"][0]
            served.append(choice.get("token_ids") if choice.get("token_ids") is not None else choice["text"])
        levels = run(url, folder.name, cfg.concurrency, cfg.requests_per_level, cfg.max_tokens, cfg.prompt_words,
                     pid=server.proc.pid, timeout_s=cfg.timeout_s, prompts=prompts)
        scored = score(url, folder.name) if score is not None else None
        tasks = score_tasks(url, folder.name) if score_tasks is not None else {}
    rc, health, ready_s = server.rc, server.health, server.ready_s
    if rc != 0:
        raise StageError(f"compress serve --engine {engine} exited {rc} during the load test: "
                         f"{_error_line(out / 'server.log')}")
    ids = all(isinstance(x, list) for x in served)
    compare = equality if ids else text_equality
    eq = compare(folder, prompts[:cfg.equality_prompts], served, cfg.equality_tokens, device)
    if not eng.exact:
        eq["exact"] = False
    result = {"engine": engine, "versions": health.get("versions") or eng.version(), "device": device,
              "server_exit": rc, "ready_s": round(ready_s, 1), "equality": eq, "levels": levels,
              **eng.config_facts(cfg), **({"perplexity": scored} if scored is not None else {}), **tasks,
              **({k: opts[k] for k in ("tensor_parallel_size", "pipeline_parallel_size")}
                 if "tensor_parallel_size" in opts else {})}
    return {**result, **eng.log_facts(out / "server.log", folder)}


@dataclass
class Serving:
    """A running `compress serve` (see serving()): its URL, process, /health answer and seconds to ready; rc once
    stopped."""

    url: str
    proc: subprocess.Popen
    health: dict = field(default_factory=dict)
    ready_s: float = 0.0
    rc: int | None = None


@contextlib.contextmanager
def serving(folder: Path, engine: str, args: list[str], log_path: Path, timeout_s: float, *,
            port: int | None = None, env: dict[str, str] | None = None) -> Iterator[Serving]:
    """`compress serve FOLDER --engine ENGINE ARGS` on `port` (default: a free loopback port), its output in
    log_path; yields once /health answers (Refused if it exits first, StageError if not healthy within timeout_s +
    30 s); stopped by SIGTERM on leaving (SIGKILL after 60 s), its exit status in .rc. The benchmarks start their
    servers through it too."""
    port = port or free_port()
    if env is None:  # a private loopback server for this process's own clients: the user's serving key
        env = {k: v for k, v in os.environ.items() if k != KEY_ENV}  # (COMPRESS_API_KEY) is not its key
    cmd = [sys.executable, "-m", "pipeline.app.cli", "serve", str(folder), "--port", str(port), "--engine", engine,
           "--start-timeout-s", str(timeout_s), *args]
    with open(log_path, "wb") as log:
        t0 = time.monotonic()
        server = Serving(f"http://127.0.0.1:{port}",
                         subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env))
        try:
            server.health = _wait(server.url, server.proc, timeout_s + 30, log_path)
            server.ready_s = time.monotonic() - t0
            yield server
        finally:
            server.proc.terminate()
            try:
                server.rc = server.proc.wait(60)
            except subprocess.TimeoutExpired:
                server.proc.kill()
                server.rc = server.proc.wait()


def _error_line(log_path: Path) -> str:
    return error_line(log_path.read_text(errors="replace").splitlines())


def _wait(url: str, proc: subprocess.Popen, timeout: float, log_path: Path) -> dict:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            tail = log_path.read_text(errors="replace")[-800:]
            line = _error_line(log_path)
            raise Refused(f"compress serve exited {proc.returncode} before it was healthy: {line} (log: "
                          f"{log_path}; its end: {tail[-300:]!r})", line)
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                body = r.read()
        except OSError:
            time.sleep(0.5)
            continue
        try:  # compress serve's /health says its engine and versions; vLLM's is 200 with an empty body
            return json.loads(body) if body.strip() else {}
        except ValueError:
            return {}
    raise StageError(f"compress serve was not healthy within {timeout:g} s (log: {log_path})")


def _generate(folder: Path, prompts: list[str], n: int, device: str):
    """(greedy `generate` token ids per prompt, tokenizer, dtype), after the server stopped: one copy of the weights
    at a time. A .gguf folder loads the way transformers reads it: every tensor dequantized."""
    model = load_checkpoint(folder, device=device)
    tok = AutoTokenizer.from_pretrained(folder)  # a GGUF variant's folder holds the baseline's tokenizer files
    refs = []
    for p in prompts:
        ids = tok(p, add_special_tokens=False, return_tensors="pt")["input_ids"].to(device)
        with torch.no_grad():
            refs.append(model.generate(ids, max_new_tokens=n, do_sample=False)[0, ids.shape[1]:].tolist())
    dtype = str(model.dtype).removeprefix("torch.") + (" (dequantized)" if single_gguf(folder) else "")
    return refs, tok, dtype


def text_equality(folder: Path, prompts: list[str], served: list[str], n: int, device: str) -> dict:
    """Another engine (llama.cpp) against transformers' greedy `generate` on the same checkpoint, by text: its
    server tokenizes the prompt with its own tokenizer (the one inside the .gguf) and streams text, not ids. Its
    kernels differ (quantized dot products against transformers' dequantized float32 matmuls), so identical text
    is not expected of every prompt: the count and where the first difference falls are recorded, no warning.
    "tokens": how many leading generate tokens the served text reproduces (their decoded text is its prefix)."""
    if not prompts:
        return {"prompts": 0, "identical": 0, "exact": False}
    refs, tok, dtype = _generate(folder, prompts, n, device)
    same, agreed, first_diff = 0, [], None
    for p, ref, got in zip(prompts, refs, served, strict=False):
        want = tok.decode(ref, skip_special_tokens=True)
        k = next((i for i in range(len(ref), -1, -1)
                  if got.startswith(tok.decode(ref[:i], skip_special_tokens=True))), 0)
        agreed.append(k)
        if want == got:
            same += 1
        elif first_diff is None:
            c = next((i for i, (a, b) in enumerate(zip(want, got, strict=False)) if a != b), min(len(want), len(got)))
            first_diff = {"prompt": p[:80], "token": k, "char": c, "generate": want[c:c + 40], "served": got[c:c + 40]}
    return {"prompts": len(prompts), "identical": same, "exact": False, "compared": "text",
            "reference": f"transformers generate ({dtype})", "tokens_agreed": agreed, "tokens": n,
            "dtype": dtype, "first_difference": first_diff}


def equality(folder: Path, prompts: list[str], served: list[list[int]], n: int, device: str) -> dict:
    """The transformers server against greedy `generate` on the same prompts: token for token."""
    if not prompts:
        return {"prompts": 0, "identical": 0}
    refs, _, dtype = _generate(folder, prompts, n, device)
    same, first_diff = 0, None
    for p, ref, got in zip(prompts, refs, served, strict=False):
        if ref == got:
            same += 1
        elif first_diff is None:
            k = next((i for i, (a, b) in enumerate(zip(ref, got, strict=False)) if a != b), min(len(ref), len(got)))
            first_diff = {"prompt": p[:80], "position": k}
    return {"prompts": len(prompts), "identical": same, "dtype": dtype, "first_difference": first_diff}
