"""The llama.cpp engine: `compress serve` on a .gguf file through llama-cpp-python's own OpenAI-compatible server (llama_cpp.server, the
`gguf-serve` extra), run in this process on the socket `compress serve` already bound, so the checks before it
(folder, engine, port in use, loopback without a key) and the exit on SIGTERM are the same as for transformers.

What llama-cpp-python 0.3.36's server does, read from its source (llama_cpp/server/app.py, settings.py):
- one request at a time: every route takes `llama_inner_lock` for the whole generation, so concurrent clients
  queue (unbounded, no 503) and a load-test level above 1 measures queueing, not batching. It has no parallel
  slots option (`--n_parallel` is llama.cpp's C++ `llama-server`, not this server); `--slots`, `--max-queue`
  and `--queue-timeout-s` are not applied and the start line says so.
- `interrupt_requests` is on by default: a stream is cut (ended with [DONE]) as soon as another request waits.
  Served here with it off, so every stream completes.
- no /health: `compress serve` adds one (no key, outside the lock) with the same fields its measurement reads
  (engine, versions); /v1/models takes the lock, so it waits behind a running generation.
- no `ignore_eos`: `min_tokens` (masks the EOS token until that many tokens) does the same for a load test;
  sampling defaults are temperature 0.8, repeat_penalty 1.1: greedy needs temperature 0 and repeat_penalty 1.
- streamed chunks carry text only (one chunk per token, except a multi-byte character split over tokens, then
  one empty chunk with finish_reason), no token ids and no usage record.
- its settings are pydantic-settings read from the environment too (MODEL, N_CTX, API_KEY, ...; HOST and PORT
  even override the command line in its __main__); here they are built with a prefix no variable uses, so only
  what `compress serve` passes applies, and CONFIG_FILE (which would replace them all) is refused.
"""
from __future__ import annotations

import importlib.util
import logging
import os
import signal
import socket
import sys
from pathlib import Path

from pipeline.core.errors import RecipeError
from pipeline.serve.engines.base import Engine, ServeOptions

log = logging.getLogger("compress.serve")
ENGINE_NAME = "llama.cpp (llama-cpp-python server: one request at a time)"
ENV_PREFIX = "COMPRESS_LLAMA_CPP_UNUSED_"  # isolates its settings from the environment (see the docstring)


def settings(gguf: Path, model_name: str, host: str, port: int, key: str | None, threads: int | None,
             n_ctx: int) -> tuple:
    """(ServerSettings, ModelSettings) for llama_cpp.server.app.create_app: greedy-serving defaults, no
    interruption of streams, the key and the bind of `compress serve`."""
    from llama_cpp.server.settings import ModelSettings, ServerSettings

    server = ServerSettings(host=host, port=port, api_key=key, interrupt_requests=False, _env_prefix=ENV_PREFIX)
    n_threads = threads or max(1, (os.cpu_count() or 2) // 2)  # its own default: half the cores
    model = ModelSettings(model=str(gguf), model_alias=model_name, n_ctx=n_ctx, n_threads=n_threads,
                          n_threads_batch=n_threads, logits_all=False, verbose=False, _env_prefix=ENV_PREFIX)
    return server, model


def serve_gguf(gguf: Path, model_name: str, sock: socket.socket, host: str, port: int, key: str | None, *,
               threads: int | None, n_ctx: int, drain_s: float, slots: int) -> int:
    if os.environ.get("CONFIG_FILE"):
        raise RecipeError("CONFIG_FILE is set: llama_cpp.server would read its settings from that file instead of "
                          "compress serve's options; unset it")
    import uvicorn
    from fastapi.responses import JSONResponse
    from llama_cpp.server.app import create_app

    server_settings, model_settings = settings(gguf, model_name, host, port, key, threads, n_ctx)
    app = create_app(server_settings=server_settings, model_settings=[model_settings])  # loads the model
    versions = {"llama-cpp-python": llama_cpp_version()}
    state = {"draining": False}

    async def health():
        return JSONResponse({"status": "ok", "model": model_name, "engine": ENGINE_NAME, "versions": versions,
                             "draining": state["draining"]})

    app.add_api_route("/health", health, methods=["GET"])

    class _Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            if not state["draining"]:
                log.warning("signal %s: draining in-flight requests for up to %g s", sig, drain_s)
            state["draining"] = True
            super().handle_exit(sig, frame)

    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=drain_s, access_log=False,
                            timeout_keep_alive=5)
    print(f"serving {model_name} ({ENGINE_NAME}) on http://{host}:{port}/v1  context {n_ctx}, "
          f"{model_settings.n_threads} threads" + (", API key required" if key else "")
          + (f"; --slots {slots}, --max-queue and --queue-timeout-s are not applied: this server runs one request "
             "at a time and queues the rest" if slots > 1 else ""), file=sys.stderr, flush=True)
    for sig in (signal.SIGTERM, signal.SIGINT):  # as for transformers: the drained exit is 0, not -15
        signal.signal(sig, lambda *_: None)
    server = _Server(config)
    server.run(sockets=[sock])
    # a generation cut by the shutdown may still hold a worker thread inside llama.cpp: leave without joining it
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


LLAMA_CPP_INSTALL = ("pip install -e '.[gguf-serve]' (llama-cpp-python[server] 0.3.36; no wheel: it builds llama.cpp "
                     "from source, about 8 minutes on 2 cores)")
# llama_cpp.server's own imports beyond llama_cpp (its [server] extra): without them `python -m llama_cpp.server` fails
LLAMA_CPP_SERVER_MODULES = ("llama_cpp", "sse_starlette", "starlette_context", "pydantic_settings")


def _importable(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def llama_cpp_missing() -> str | None:
    """Why llama.cpp's server cannot start here (None: it can): llama_cpp, or its [server] extra, is not installed."""
    if not _importable("llama_cpp"):
        return f"llama_cpp is not installed ({LLAMA_CPP_INSTALL})"
    missing = [m for m in LLAMA_CPP_SERVER_MODULES if not _importable(m)]
    if missing:
        return f"llama_cpp's server needs {', '.join(missing)}, not installed ({LLAMA_CPP_INSTALL})"
    return None


def llama_cpp_version() -> str | None:
    """llama-cpp-python's version, read from its metadata (nothing imported); None when it is not installed."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("llama-cpp-python")
    except PackageNotFoundError:
        return None


class LlamaCpp(Engine):
    name = "llama.cpp"
    formats = {"cpu": ("gguf",), "cuda": ("gguf",)}
    honours = ("max_model_len", "threads", "drain_s", "max_tokens_limit")
    install = LLAMA_CPP_INSTALL
    optional = True  # an extra: engines = "all" skips it with a recorded reason when it is missing

    def missing(self) -> str | None:
        return llama_cpp_missing()

    def version(self) -> dict[str, str]:
        v = llama_cpp_version()
        return {"llama-cpp-python": v} if v else {}

    def unhonoured(self, opts: ServeOptions) -> list[str]:
        return []  # what it does not apply, its start line says (it has always served with that line)

    def serve(self, exp, sock: socket.socket, opts: ServeOptions) -> int:
        return serve_gguf(exp.path / exp.gguf_file, exp.path.name, sock, opts.host, opts.port, opts.key,
                          threads=opts.threads, n_ctx=opts.max_model_len, drain_s=opts.drain_s, slots=opts.slots)


ENGINES = (LlamaCpp,)
