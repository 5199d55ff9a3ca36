"""A `compress serve` subprocess on a free loopback port, for the serving tests (tiny random model)."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tiny_export(out: Path) -> Path:
    """The tiny random Llama (float32) as an export folder, with a chat template (for /v1/chat/completions)."""
    import json

    from tests.tiny_models import tiny_llama

    tiny_llama(out)
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    cfg["chat_template"] = CHAT_TEMPLATE
    (out / "tokenizer_config.json").write_text(json.dumps(cfg))
    return out


def serve_cmd(folder: Path, port: int, *args: str) -> list[str]:
    return [sys.executable, "-m", "pipeline.app.cli", "serve", str(folder), "--port", str(port), "--threads", "1", *args]


def env(**extra: str) -> dict:
    e = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **extra}
    return e


class Server:
    def __init__(self, folder: Path, *args: str, log: Path, key_env: str | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        extra = {"COMPRESS_API_KEY": key_env} if key_env else {}
        self._fh = open(log, "wb")
        self.proc = subprocess.Popen(serve_cmd(folder, self.port, *args), stdout=self._fh, stderr=subprocess.STDOUT,
                                     env=env(**extra), cwd=ROOT)
        self.wait_healthy()

    def wait_healthy(self, timeout: float = 60) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited {self.proc.returncode}: {self.log.read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                time.sleep(0.3)
        raise RuntimeError("server not healthy in time")

    def health(self) -> dict:
        """/health's body, also when it answers 503 (unhealthy, or draining)."""
        import json

        try:
            with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            return json.loads(e.read())

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._fh.close()
        return self.proc.returncode


def post(url: str, body: dict | bytes, headers: dict | None = None, timeout: float = 30) -> tuple[int, dict]:
    import json

    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")
