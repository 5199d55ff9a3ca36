"""The API key on every route of vLLM's server but /health: loaded by vLLM itself, in its own environment
(`--middleware compress_vllm_guard.RequireKey`, this folder alone on its PYTHONPATH: standard library only).

vLLM 0.32 checks its key (--api-key / VLLM_API_KEY) only on paths under /v1, /v2, /inference and /cohere
(vllm/entrypoints/serve/middleware/authenticate.py GUARDED_PREFIX): /invocations (it generates), /tokenize,
/detokenize, /metrics, /pause, /resume, /abort_requests, ... answer without it. This middleware, outermost, asks for
`Authorization: Bearer <VLLM_API_KEY>` on every HTTP and websocket request except GET-style probes of /health
(`compress serve`'s readiness poll, liveness probes), compared in constant time.
"""
from __future__ import annotations

import hashlib
import hmac
import os

OPEN = ("/health",)


class RequireKey:
    def __init__(self, app) -> None:
        key = os.environ.get("VLLM_API_KEY", "")
        if not key:
            raise RuntimeError("compress_vllm_guard: VLLM_API_KEY is not set (compress serve sets it with a key)")
        self.app = app
        self.digest = hashlib.sha256(f"Bearer {key}".encode()).digest()

    def allowed(self, scope) -> bool:
        path = scope["path"].removeprefix(scope.get("root_path", "") or "")
        if path in OPEN:
            return True
        got = dict(scope.get("headers") or []).get(b"authorization", b"")
        return hmac.compare_digest(hashlib.sha256(got).digest(), self.digest)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] not in ("http", "websocket") or self.allowed(scope):
            await self.app(scope, receive, send)
        elif scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
        else:
            await send({"type": "http.response.start", "status": 401,
                        "headers": [(b"content-type", b"application/json")]})
            await send({"type": "http.response.body", "body": b'{"error": "Unauthorized: missing or wrong API key"}'})
