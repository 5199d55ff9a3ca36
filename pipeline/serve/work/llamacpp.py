"""The llama.cpp engine's serving (pipeline/serve/engines/llamacpp.py, whose docstring says what llama-cpp-python's
server does and what is changed here): its OpenAI-compatible server on the socket `compress serve` bound, with a
/health route, the max-tokens cap, a constant-time key check and the SIGTERM drain. Needs the [gguf-serve] extra."""
from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

from fastapi.responses import JSONResponse
from llama_cpp.server.app import authenticate, create_app
from llama_cpp.server.settings import ModelSettings, ServerSettings

from pipeline.base.env import llama_cpp_threads
from pipeline.base.errors import RecipeError
from pipeline.serve import drain as draining
from pipeline.serve.auth import bearer_check
from pipeline.serve.engines.base import ServeOptions
from pipeline.serve.engines.llamacpp import ENGINE_NAME, ENV_PREFIX, TokenCap, llama_cpp_version


def serve(exp, sock: socket.socket, opts: ServeOptions) -> int:
    return serve_gguf(exp.path / exp.gguf_file, exp.path.name, sock, opts.host, opts.port, opts.key,
                      threads=opts.threads, n_ctx=opts.max_model_len, drain_s=opts.drain_s, slots=opts.slots,
                      max_tokens_limit=opts.max_tokens_limit)


def settings(gguf: Path, model_name: str, host: str, port: int, key: str | None, threads: int | None,
             n_ctx: int) -> tuple:
    """(ServerSettings, ModelSettings) for llama_cpp.server.app.create_app: greedy-serving defaults, no
    interruption of streams, the key and the bind of `compress serve`."""
    server = ServerSettings(host=host, port=port, api_key=key, interrupt_requests=False, _env_prefix=ENV_PREFIX)
    n_threads = llama_cpp_threads(threads)
    model = ModelSettings(model=str(gguf), model_alias=model_name, n_ctx=n_ctx, n_threads=n_threads,
                          n_threads_batch=n_threads, logits_all=False, verbose=False, _env_prefix=ENV_PREFIX)
    return server, model


def serve_gguf(gguf: Path, model_name: str, sock: socket.socket, host: str, port: int, key: str | None, *,
               threads: int | None, n_ctx: int, drain_s: float, slots: int, max_tokens_limit: int) -> int:
    if os.environ.get("CONFIG_FILE"):
        raise RecipeError("CONFIG_FILE is set: llama_cpp.server would read its settings from that file instead of "
                          "compress serve's options; unset it")
    server_settings, model_settings = settings(gguf, model_name, host, port, key, threads, n_ctx)
    app = create_app(server_settings=server_settings, model_settings=[model_settings])  # loads the model
    app.dependency_overrides[authenticate] = bearer_check(key)  # its own compares the key with ==
    versions = {"llama-cpp-python": llama_cpp_version()}
    gate = draining.Drain()

    async def health():
        return JSONResponse({"status": "ok", "model": model_name, "engine": ENGINE_NAME, "versions": versions,
                             "draining": gate.draining, "in_flight": gate.in_flight},
                            status_code=503 if gate.draining else 200)  # draining: not ready

    app.add_api_route("/health", health, methods=["GET"])
    app.add_middleware(TokenCap, limit=max_tokens_limit)
    app.add_middleware(draining.DrainMiddleware, drain=gate)  # outermost: 503 during the drain, socket kept open
    print(f"serving {model_name} ({ENGINE_NAME}) on http://{host}:{port}/v1  context {n_ctx}, "
          f"{model_settings.n_threads} threads, max_tokens <= {max_tokens_limit}"
          + (", API key required" if key else "")
          + (f"; --slots {slots}, --max-queue and --queue-timeout-s are not applied: this server runs one request "
             "at a time and queues the rest" if slots > 1 else ""), file=sys.stderr, flush=True)
    draining.run(app, gate, sock, drain_s)
    # a generation cut by the shutdown may still hold a worker thread inside llama.cpp: leave without joining it
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)

