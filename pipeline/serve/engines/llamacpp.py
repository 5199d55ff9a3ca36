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
The server is built and run by pipeline/serve/work/llamacpp.py; this module holds the declarations and the pure parts.
"""
from __future__ import annotations

import importlib.util
import json
import logging
from importlib.metadata import PackageNotFoundError, version

from pipeline.serve.engines.base import Engine, ServeOptions
from pipeline.serve.openai_schema import MAX_BODY_BYTES

log = logging.getLogger("compress.serve")
ENGINE_NAME = "llama.cpp (llama-cpp-python server: one request at a time)"
ENV_PREFIX = "COMPRESS_LLAMA_CPP_UNUSED_"  # isolates its settings from the environment (see the docstring)


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
    work = "pipeline.serve.work.llamacpp"
    batches = False  # one request at a time (see the docstring)
    equality_request = {"repeat_penalty": 1.0}  # greedy: its sampling default penalises repeats (1.1)
    report_note = ("llama.cpp rows: llama-cpp-python's server runs one request at a time (the others queue), so a "
                   "level above 1 measures queueing, not continuous batching. Its greedy output is compared with "
                   "transformers generate on the dequantized file by text (different kernels: not expected to be "
                   "identical on every prompt); transformers rows are compared token for token.")

    def missing(self) -> str | None:
        return llama_cpp_missing()

    def version(self) -> dict[str, str]:
        v = llama_cpp_version()
        return {"llama-cpp-python": v} if v else {}

    def unhonoured(self, opts: ServeOptions) -> list[str]:
        return []  # what it does not apply, its start line says (it has always served with that line)



ENGINES = (LlamaCpp,)
