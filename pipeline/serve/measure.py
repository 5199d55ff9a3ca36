"""The `validate/<model>/serve` measurement: serve a checkpoint in a subprocess on a free loopback port, compare its
greedy output with `generate`'s, load-test it at each concurrency level, stop it by its pid."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from pipeline.errors import StageError

# what the `compress serve` subprocess runs, named so the serve unit's identity covers it (pipeline/codehash.py);
# the CLI that parses its arguments is harness, followed by no unit
SERVER_CODE = "pipeline.serve.server"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict, timeout: float) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def measure(folder: Path, cfg, prompts: list[str], out: Path, threads: int | None, device: str = "cpu") -> dict:
    """{"equality": {...}, "levels": [...], "engine", "versions", "server_exit"}; the server's log in out/."""
    from pipeline.serve.loadtest import run

    port, url = free_port(), None
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "pipeline.cli", "serve", str(folder), "--port", str(port), "--device", device,
           "--slots", str(max(cfg.concurrency)), "--max-queue", str(max(cfg.concurrency)),
           "--max-model-len", str(cfg.max_model_len), "--queue-timeout-s", str(cfg.timeout_s)]
    if threads:
        cmd += ["--threads", str(threads)]
    log = open(out / "server.log", "wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ})
    try:
        health = _wait(url, proc, cfg.timeout_s, out)
        served = []
        for p in prompts[:cfg.equality_prompts]:
            r = _post(url + "/v1/completions", {"model": folder.name, "prompt": p, "max_tokens": cfg.equality_tokens,
                                                "return_token_ids": True}, cfg.timeout_s)
            served.append(r["choices"][0]["token_ids"])
        levels = run(url, folder.name, cfg.concurrency, cfg.requests_per_level, cfg.max_tokens, cfg.prompt_words,
                     pid=proc.pid, timeout_s=cfg.timeout_s, prompts=prompts)
    finally:
        proc.terminate()
        try:
            rc = proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
        log.close()
    return {"engine": health["engine"], "versions": health["versions"], "server_exit": rc,
            "equality": equality(folder, prompts[:cfg.equality_prompts], served, cfg.equality_tokens, device),
            "levels": levels}


def _wait(url: str, proc: subprocess.Popen, timeout: float, out: Path) -> dict:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            tail = (out / "server.log").read_text(errors="replace")[-800:]
            raise StageError(f"compress serve exited {proc.returncode} before it was healthy: {tail}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                return json.loads(r.read())
        except OSError:
            time.sleep(0.5)
    raise StageError(f"compress serve was not healthy within {timeout:g} s (log: {out / 'server.log'})")


def equality(folder: Path, prompts: list[str], served: list[list[int]], n: int, device: str) -> dict:
    """Greedy `generate` on the same prompts (after the server stopped: one copy of the weights at a time)."""
    if not prompts:
        return {"prompts": 0, "identical": 0}
    import torch
    from transformers import AutoTokenizer

    from pipeline.models import load_checkpoint

    model = load_checkpoint(folder, device=device)
    tok = AutoTokenizer.from_pretrained(folder)
    same, first_diff = 0, None
    for p, got in zip(prompts, served):
        ids = tok(p, add_special_tokens=False, return_tensors="pt")["input_ids"].to(device)
        with torch.no_grad():
            ref = model.generate(ids, max_new_tokens=n, do_sample=False)[0, ids.shape[1]:].tolist()
        if ref == got:
            same += 1
        elif first_diff is None:
            k = next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), min(len(ref), len(got)))
            first_diff = {"prompt": p[:80], "position": k}
    return {"prompts": len(prompts), "identical": same, "dtype": str(model.dtype).removeprefix("torch."),
            "first_difference": first_diff}
