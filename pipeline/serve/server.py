"""Start `compress serve`: check the folder, the engine, the bind and the key (all before loading weights), then run.

SIGTERM/SIGINT: new requests get 503, in-flight ones get up to `drain_s` seconds to finish (uvicorn's graceful
shutdown), the rest are cut; the generation thread is stopped and the process exits 0. A .gguf file is served by
llama-cpp-python's server in this process (pipeline/serve/llamacpp.py), vLLM by its own server exec'd in place.
"""
from __future__ import annotations

import errno
import ipaddress
import logging
import os
import signal
import socket
import sys
from pathlib import Path

from pipeline.core.errors import RecipeError
from pipeline.serve.folder import choose_engine, inspect

log = logging.getLogger("compress.serve")
KEY_ENV = "COMPRESS_API_KEY"


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def resolve_key(host: str, api_key: str | None) -> str | None:
    """The key requests must carry (None: none needed). A non-loopback bind without one is refused."""
    key = api_key or os.environ.get(KEY_ENV) or None
    if key is None and not is_loopback(host):
        raise RecipeError(f"--host {host} is not a loopback address: binding it needs an API key "
                          f"(--api-key or the environment variable {KEY_ENV})")
    return key


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, made here so a port in use is exit 2 before any weight is loaded."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise RecipeError(f"port {port} on {host} is already in use (choose another with --port)") from None
        raise RecipeError(f"cannot bind {host}:{port}: {e.strerror}") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def serve(folder: str, *, host: str, port: int, engine: str, api_key: str | None, slots: int, max_queue: int,
          queue_timeout_s: float, max_tokens_limit: int, drain_s: float, device: str, threads: int | None,
          max_model_len: int = 2048) -> int:
    exp = inspect(folder)
    key = resolve_key(host, api_key)
    chosen = choose_engine(exp, engine, cuda=cuda_available() if engine in ("vllm",) else False)
    sock = bind(host, port)
    if chosen == "llama.cpp":
        from pipeline.serve.llamacpp import serve_gguf

        return serve_gguf(exp.path / exp.gguf_file, exp.path.name, sock, host, port, key, threads=threads,
                          n_ctx=max_model_len, drain_s=drain_s, slots=slots)
    if chosen == "vllm":
        return _exec_vllm(exp, sock, host, port, key, slots, max_model_len)
    return _serve_transformers(exp.path, sock, host, port, key, slots=slots, max_queue=max_queue,
                               queue_timeout_s=queue_timeout_s, max_tokens_limit=max_tokens_limit, drain_s=drain_s,
                               device=device, threads=threads, max_model_len=max_model_len)


def _serve_transformers(path: Path, sock: socket.socket, host: str, port: int, key: str | None, *, slots: int,
                        max_queue: int, queue_timeout_s: float, max_tokens_limit: int, drain_s: float, device: str,
                        threads: int | None, max_model_len: int) -> int:
    import torch
    import uvicorn

    from pipeline.serve.app import build_app
    from pipeline.serve.engine import TransformersEngine

    if threads:
        torch.set_num_threads(threads)
    eng = TransformersEngine(path, max_batch=slots, max_len=max_model_len, device=device)
    eng.start()
    app = build_app(eng, path.name, slots=slots, max_queue=max_queue, queue_timeout_s=queue_timeout_s,
                    max_tokens_limit=max_tokens_limit, api_key=key)

    class _Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            if not app.state.draining:
                log.warning("signal %s: draining in-flight requests for up to %g s", sig, drain_s)
            app.state.draining = True
            super().handle_exit(sig, frame)

    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=drain_s, access_log=False,
                            timeout_keep_alive=5)
    server = _Server(config)
    print(f"serving {path.name} ({eng.name}) on http://{host}:{port}/v1  slots {slots}, queue {max_queue}"
          + (", API key required" if key else ""), file=sys.stderr, flush=True)
    for sig in (signal.SIGTERM, signal.SIGINT):
        # uvicorn restores the handlers it found and re-raises the signal it drained on: a no-op here makes the
        # drained exit 0 (not -15); the stop after it is bounded by its own timeout
        signal.signal(sig, lambda *_: None)
    try:
        server.run(sockets=[sock])
    finally:
        stopped = eng.stop(timeout=max(1.0, drain_s / 4))
    if not stopped:  # the generation thread did not end: leave without joining it (exit 0: the drain is done)
        sys.stderr.flush()
        os._exit(0)
    return 0


def _exec_vllm(exp, sock: socket.socket, host: str, port: int, key: str | None, slots: int,
               max_model_len: int) -> int:
    """vLLM's own OpenAI-compatible server, in place of this process (same host, port and key). Never run here
    (no GPU with vLLM in these sessions): its flags are vLLM's documented ones. The key goes in VLLM_API_KEY, which
    vLLM reads when --api-key is absent: never on the command line, where the process list and vLLM's own log of
    its non-default arguments would show it. (vLLM checks the key on /v1 routes only: see its security guide.)"""
    sock.close()
    argv = vllm_argv(exp.path, host, port, slots, min(max_model_len, exp.context or max_model_len))
    env = {k: v for k, v in os.environ.items() if k != "VLLM_API_KEY"}
    if key:
        env["VLLM_API_KEY"] = key
    os.execve(sys.executable, argv, env)
    return 0  # not reached


def vllm_argv(path: Path, host: str, port: int, slots: int, max_model_len: int) -> list[str]:
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(path),
            "--served-model-name", path.name, "--host", host, "--port", str(port), "--max-num-seqs", str(slots),
            "--max-model-len", str(max_model_len)]
