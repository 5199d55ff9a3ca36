"""Start `compress serve`: check the folder, the engine, the bind and the key (all before loading weights), then
hand the bound socket to the engine (pipeline/serve/engines).

SIGTERM/SIGINT (transformers, llama.cpp: pipeline/serve/drain.py): the listening socket stays open and new requests
get 503 with Retry-After while in-flight ones get up to `drain_s` seconds to finish; then the socket is closed (a
client gets "connection refused" from then on), what is left is cut, the generation thread is stopped and the
process exits 0 (vLLM: its own server's shutdown, pipeline/serve/engines/vllm.py). A .gguf file is served by
llama-cpp-python's server in this process (pipeline/serve/engines/llamacpp.py), vLLM by its own server in its own
environment, a child process this one supervises (pipeline/serve/engines/vllm.py).
"""
from __future__ import annotations

import errno
import ipaddress
import logging
import os
import socket
from dataclasses import replace

from pipeline.base.errors import RecipeError
from pipeline.serve import engines
from pipeline.serve.engines.base import ServeOptions
from pipeline.serve.folder import inspect

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


def serve(folder: str, engine: str, opts: ServeOptions) -> int:
    """Check the folder, the key, the engine and the options it cannot apply, bind the port, then serve."""
    exp = inspect(folder)
    opts = replace(opts, key=resolve_key(opts.host, opts.key))
    if engine == "auto":
        engine, why = engines.auto(exp.checkpoint_format, exp.path, opts)
        log.info(why)
    chosen = engines.get(engines.choose(exp.checkpoint_format, str(exp.path), engine, opts.device))
    refused = chosen.unhonoured(opts)
    if refused:
        flags = ", ".join("--" + o.replace("_", "-") for o in refused)
        able = [n for n in engines.NAMES if all(o in engines.get(n).honours for o in refused)]
        why = chosen.unhonoured_why or "it has no such setting"
        raise RecipeError(f"--engine {chosen.name} does not apply {flags} ({why}): leave "
                          f"{'it' if len(refused) == 1 else 'them'} unset, or serve with --engine "
                          + " or --engine ".join(able or ["transformers"]))
    sock = bind(opts.host, opts.port)
    return chosen.serve(exp, sock, replace(opts, max_model_len=min(opts.max_model_len,
                                                                    exp.context or opts.max_model_len)))
