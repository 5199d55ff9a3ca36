"""The llama.cpp engine: `compress serve` on a .gguf file through llama-cpp-python's own OpenAI-compatible server
(llama_cpp.server, the `gguf-serve` extra), run in this process on the socket `compress serve` already bound, so the
checks before it (folder, engine, port in use, loopback without a key) and the exit on SIGTERM are the same as for
transformers.

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
- no max-tokens setting, and max_tokens 0/null (chat: absent) means "up to the context": `--max-tokens-limit` is
  applied here by a middleware in front of its routes (TokenCap: above it 400, "up to the context" becomes it),
  which also caps the body (413, as for transformers).
- its `authenticate` compares the key with ==: replaced (dependency_overrides) by a constant-time comparison.
- SIGTERM: the drain of pipeline/serve/drain.py (socket kept open, 503 to new requests, in-flight ones finish).
"""
from __future__ import annotations

import hmac
import importlib.util
import json
import logging
import os
import socket
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from pipeline.base.errors import RecipeError
from pipeline.serve import drain as draining
from pipeline.serve.engines.base import Engine, ServeOptions
from pipeline.serve.openai_schema import MAX_BODY_BYTES

log = logging.getLogger("compress.serve")
ENGINE_NAME = "llama.cpp (llama-cpp-python server: one request at a time)"
ENV_PREFIX = "COMPRESS_LLAMA_CPP_UNUSED_"  # isolates its settings from the environment (see the docstring)


def settings(gguf: Path, model_name: str, host: str, port: int, key: str | None, threads: int | None,
             n_ctx: int) -> tuple:
    """(ServerSettings, ModelSettings) for llama_cpp.server.app.create_app: greedy-serving defaults, no
    interruption of streams, the key and the bind of `compress serve`."""
    # late: the optional [gguf-serve] extra; `compress check` imports this engine's declarations
    from llama_cpp.server.settings import ModelSettings, ServerSettings

    server = ServerSettings(host=host, port=port, api_key=key, interrupt_requests=False, _env_prefix=ENV_PREFIX)
    n_threads = threads or max(1, (os.cpu_count() or 2) // 2)  # its own default: half the cores
    model = ModelSettings(model=str(gguf), model_alias=model_name, n_ctx=n_ctx, n_threads=n_threads,
                          n_threads_batch=n_threads, logits_all=False, verbose=False, _env_prefix=ENV_PREFIX)
    return server, model


def serve_gguf(gguf: Path, model_name: str, sock: socket.socket, host: str, port: int, key: str | None, *,
               threads: int | None, n_ctx: int, drain_s: float, slots: int, max_tokens_limit: int) -> int:
    if os.environ.get("CONFIG_FILE"):
        raise RecipeError("CONFIG_FILE is set: llama_cpp.server would read its settings from that file instead of "
                          "compress serve's options; unset it")
    # late: the optional [gguf-serve] extra; `compress check` imports this engine's declarations
    from fastapi.responses import JSONResponse
    from llama_cpp.server.app import authenticate, create_app

    server_settings, model_settings = settings(gguf, model_name, host, port, key, threads, n_ctx)
    app = create_app(server_settings=server_settings, model_settings=[model_settings])  # loads the model
    app.dependency_overrides[authenticate] = bearer_check(key)  # its own compares the key with ==
    versions = {"llama-cpp-python": llama_cpp_version()}
    gate = draining.Drain()

    async def health():
        return JSONResponse({"status": "ok", "model": model_name, "engine": ENGINE_NAME, "versions": versions,
                             "draining": gate.draining, "in_flight": gate.in_flight})

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


def bearer_check(key: str | None):
    """llama_cpp.server's `authenticate` dependency (the same 401), comparing the key in constant time."""
    # late: the optional [gguf-serve] extra; `compress check` imports this engine's declarations
    from fastapi import Depends, HTTPException
    from fastapi.security import HTTPBearer

    bearer = HTTPBearer(auto_error=False)

    async def check(authorization=Depends(bearer)):
        if key is None:
            return True
        got = authorization.credentials if authorization else ""
        if hmac.compare_digest(got.encode(), key.encode()):
            return got
        raise HTTPException(status_code=401, detail="Invalid API key")

    return check


GENERATION_ROUTES = {"/v1/completions": False, "/v1/engines/copilot-codex/completions": False,
                     "/v1/chat/completions": True}  # path: is chat


def cap_max_tokens(body: dict, chat: bool, limit: int) -> str | None:
    """Apply --max-tokens-limit to a llama_cpp.server request body in place (it has no such setting), or say why
    the request is refused. llama.cpp reads max_tokens 0 (and null, and for chat an absent one) as "up to the
    context": those become the limit; an absent one on completions keeps its default 16 (at most the limit);
    max_completion_tokens, which it ignores, is read as max_tokens."""
    if "max_tokens" not in body and "max_completion_tokens" in body:
        body["max_tokens"] = body.pop("max_completion_tokens")
    n = body.get("max_tokens")
    if isinstance(n, bool) or not isinstance(n, (int, type(None))):
        return None  # its own validation answers
    if n is not None and n > limit:
        return f"max_tokens: {n} is above this server's limit {limit}"
    if n is None or n <= 0:
        body["max_tokens"] = limit if chat or "max_tokens" in body or n is not None else min(16, limit)
    return None


class TokenCap:
    """Pure-ASGI middleware: --max-tokens-limit (cap_max_tokens) and the body cap on llama_cpp.server's generation
    routes; 400 / 413 in the OpenAI error shape. The body is read, rewritten and replayed to the app."""

    def __init__(self, app, limit: int, max_body_bytes: int = MAX_BODY_BYTES) -> None:
        self.app, self.limit, self.max_body = app, limit, max_body_bytes

    async def __call__(self, scope, receive, send) -> None:
        chat = GENERATION_ROUTES.get(scope.get("path", ""))
        if scope["type"] != "http" or scope["method"] != "POST" or chat is None:
            return await self.app(scope, receive, send)
        body, more = b"", True
        while more:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            body, more = body + msg.get("body", b""), msg.get("more_body", False)
            if len(body) > self.max_body:
                return await _reply(send, 413, f"the request body is larger than this server's limit of "
                                               f"{self.max_body} bytes")
        try:
            raw = json.loads(body)
        except ValueError:
            raw = None  # its own validation answers
        if isinstance(raw, dict):
            why = cap_max_tokens(raw, chat, self.limit)
            if why:
                return await _reply(send, 400, why)
            body = json.dumps(raw).encode()
        headers = [(k, v) for k, v in scope["headers"] if k.lower() != b"content-length"]
        scope = {**scope, "headers": headers + [(b"content-length", str(len(body)).encode())]}
        sent = False

        async def replay():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


async def _reply(send, status: int, message: str) -> None:
    payload = json.dumps({"error": {"message": message, "type": "invalid_request_error"}}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]})
    await send({"type": "http.response.body", "body": payload})


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
                          threads=opts.threads, n_ctx=opts.max_model_len, drain_s=opts.drain_s, slots=opts.slots,
                          max_tokens_limit=opts.max_tokens_limit)


ENGINES = (LlamaCpp,)
