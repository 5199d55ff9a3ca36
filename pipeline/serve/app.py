"""The OpenAI-compatible routes: /v1/completions, /v1/chat/completions (SSE when stream=true), /v1/models, /health
(no key: liveness probes; 503 while unhealthy or draining), /metrics (Prometheus; behind the key when one is set).

What a request may ask for: pipeline/serve/openai_schema.py (served, harmless, and not-served fields: 400 naming the
field). Generation, stop strings, echo, logprobs and batched prompts: pipeline/serve/completions.py. Admission:
pipeline/serve/admission.py (503 with Retry-After past the queue). Drain: pipeline/serve/drain.py.
Decoding is greedy only (the manager shares one generation config): temperature > 0 is refused, not ignored.
Bodies above `max_body_bytes` get 413, before they are read when Content-Length says so.
"""
from __future__ import annotations

import hmac
import logging
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from pipeline.serve.admission import Admission, Busy, SlotStream
from pipeline.serve.completions import GenerationError, Service
from pipeline.serve.drain import Drain, DrainMiddleware
from pipeline.serve.metrics import CONTENT_TYPE, Metrics, MetricsMiddleware
from pipeline.serve.openai_schema import (
    MAX_BODY_BYTES,
    BadRequest,
    ChatRequest,
    CompletionRequest,
    parse_json,
    read_body,
    validate,
)

log = logging.getLogger("compress.serve")
KEYLESS = ("/health",)


def _error(status: int, message: str, headers: dict | None = None) -> JSONResponse:
    kind = {400: "invalid_request_error", 401: "authentication_error", 413: "invalid_request_error",
            503: "server_busy"}.get(status, "error")
    return JSONResponse({"error": {"message": message, "type": kind}}, status_code=status, headers=headers)


def build_app(engine, model_name: str, *, slots: int, max_queue: int, queue_timeout_s: float, max_tokens_limit: int,
              api_key: str | None, default_max_tokens: int = 16, max_body_bytes: int = MAX_BODY_BYTES) -> FastAPI:
    app = FastAPI(title="compress serve", docs_url=None, redoc_url=None, openapi_url=None)
    adm = Admission(slots, max_queue, queue_timeout_s)
    metrics = Metrics(running=lambda: adm.active, waiting=lambda: adm.waiting)
    drain = Drain(on_refuse=lambda: metrics.rejected.labels("draining").inc())
    svc = Service(engine, model_name, adm, metrics, max_tokens_limit=max_tokens_limit,
                  default_max_tokens=default_max_tokens)
    app.state.admission, app.state.drain, app.state.metrics = adm, drain, metrics

    @app.middleware("http")
    async def _auth(request: Request, call_next):
        if api_key is not None and request.url.path not in KEYLESS:
            got = request.headers.get("authorization", "")
            if not hmac.compare_digest(got.encode(), f"Bearer {api_key}".encode()):
                return _error(401, "missing or wrong API key (send Authorization: Bearer <key>)")
        return await call_next(request)

    app.add_middleware(DrainMiddleware, drain=drain)  # added after _auth: outside it
    app.add_middleware(MetricsMiddleware, metrics=metrics)  # outermost: counts 401, 413 and drain 503s too
    _info_routes(app, engine, svc, drain)
    _generation_routes(app, svc, max_body_bytes, retry_after=str(max(1, round(queue_timeout_s))))
    return app


def _info_routes(app: FastAPI, engine, svc: Service, drain: Drain) -> None:
    adm, metrics = svc.adm, svc.m

    @app.get("/health")
    async def health():
        engine.drop_orphans()
        ok = engine.alive()
        body = {"status": "ok" if ok else "unhealthy", "model": svc.model_name, "engine": engine.name,
                "active": adm.active, "waiting": adm.waiting, "rejected": adm.rejected, "draining": drain.draining,
                "in_flight": drain.in_flight, "versions": engine.versions}
        return JSONResponse(body, status_code=200 if ok and not drain.draining else 503)  # draining: not ready

    @app.get("/metrics")
    async def scrape():
        return Response(metrics.scrape(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": svc.model_name, "object": "model", "owned_by": "compress",
                                             "max_model_len": svc.context}]}


def _generation_routes(app: FastAPI, svc: Service, max_body_bytes: int, retry_after: str) -> None:
    async def parse(request: Request, model):
        """The body as `model` (any content type: curl -d sends form's), or BadRequest/TooLarge."""
        body = await read_body(request.stream(), request.headers.get("content-length"), max_body_bytes)
        return validate(parse_json(body), model)

    async def answer(work):
        """The route's answer, or the error its refusal or failure is."""
        try:
            return await work
        except BadRequest as e:
            return _error(e.status, str(e))
        except Busy as e:
            svc.m.rejected.labels(e.reason).inc()
            return _error(503, str(e), {"Retry-After": retry_after})
        except GenerationError as e:
            return _error(500, f"generation failed: {e}")

    async def stream(req, seq, n: int, chat: bool, t0: float):
        slot = await svc.admit(seq)
        return SlotStream(svc.sse(req, seq, n, chat, slot, t0), slot)

    async def complete(request: Request, t0: float):
        req: CompletionRequest = await parse(request, CompletionRequest)
        seqs = await svc.completion_seqs(req)
        n = svc.check(req, seqs, echo=req.echo)
        if not req.stream:
            return await svc.complete(req, seqs, n, t0)
        for field, asked in (("prompt", len(seqs) > 1), ("echo", req.echo), ("logprobs", req.logprobs is not None)):
            if asked:
                raise BadRequest(f"{field}: {'a batch of prompts' if field == 'prompt' else field} is not served "
                                 "with stream=true")
        return await stream(req, seqs[0], n, False, t0)

    async def chat(request: Request, t0: float):
        req: ChatRequest = await parse(request, ChatRequest)
        seq = await svc.chat_seq(req)
        n = svc.check(req, [seq], chat=True)
        return await (stream(req, seq, n, True, t0) if req.stream else svc.chat(req, seq, n, t0))

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await answer(complete(request, time.monotonic()))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await answer(chat(request, time.monotonic()))
