"""The OpenAI-compatible routes: /v1/completions, /v1/chat/completions (SSE when stream=true), /v1/models, /health.

Admission: at most `slots` requests generate at once (the batch); up to `max_queue` more wait for a slot, each at most
`queue_timeout_s`; a request beyond that, or one that waited too long, gets 503 with Retry-After. Every way a request
ends (finished, error, client gone, cancelled by the drain) releases its slot in one `finally`.
Decoding is greedy only (the manager shares one generation config): temperature > 0 is refused, not ignored.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

log = logging.getLogger("compress.serve")


class Busy(Exception):
    pass


class BadRequest(Exception):
    pass


@dataclass
class Admission:
    slots: int
    max_queue: int
    timeout_s: float
    active: int = 0
    waiting: int = 0
    rejected: int = 0
    _sem: asyncio.Semaphore | None = field(default=None, repr=False)

    async def acquire(self) -> None:
        if self._sem is None:
            self._sem = asyncio.Semaphore(self.slots)
        if self.active >= self.slots and self.waiting >= self.max_queue:
            self.rejected += 1
            raise Busy(f"the queue is full ({self.max_queue} requests waiting for {self.slots} slots)")
        self.waiting += 1
        try:
            await asyncio.wait_for(self._sem.acquire(), self.timeout_s)
        except TimeoutError:
            self.rejected += 1
            raise Busy(f"no slot within {self.timeout_s:g} s ({self.slots} slots busy)") from None
        finally:
            self.waiting -= 1
        self.active += 1

    def release(self) -> None:
        self.active -= 1
        self._sem.release()


class _Slot:
    """One admitted request's slot, released exactly once whichever way the request ends."""

    def __init__(self, adm: Admission) -> None:
        self._adm, self._held = adm, True

    def release(self) -> None:
        if self._held:
            self._held = False
            self._adm.release()


class _SlotStream(StreamingResponse):
    """A stream whose slot is released when the response ends, even if its body generator never started (a client
    gone before the first byte: an unstarted generator's `finally` never runs)."""

    def __init__(self, body, slot: _Slot) -> None:
        super().__init__(body, media_type="text/event-stream")
        self._slot = slot

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._slot.release()


class _Base(BaseModel):
    model_config = ConfigDict(extra="allow")  # OpenAI clients send fields we do not use (user, n=1, ...)
    model: str
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    stream: bool = False
    temperature: float | None = None
    ignore_eos: bool = False  # vLLM's extension: always generate max_tokens tokens (load tests)
    return_token_ids: bool = False  # our extension: the generated token ids in each choice (greedy checks)
    stream_options: dict[str, Any] | None = None


class CompletionRequest(_Base):
    prompt: str | list[int]


class ChatRequest(_Base):
    messages: list[dict[str, Any]] = Field(min_length=1)


def _error(status: int, message: str, headers: dict | None = None) -> JSONResponse:
    kind = {400: "invalid_request_error", 401: "authentication_error", 503: "server_busy"}.get(status, "error")
    return JSONResponse({"error": {"message": message, "type": kind}}, status_code=status, headers=headers)


def build_app(engine, model_name: str, *, slots: int, max_queue: int, queue_timeout_s: float, max_tokens_limit: int,
              api_key: str | None, default_max_tokens: int = 16) -> FastAPI:
    app = FastAPI(title="compress serve", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.admission = Admission(slots, max_queue, queue_timeout_s)
    app.state.draining = False
    tok = engine.tokenizer
    context = engine.context
    retry_after = str(max(1, round(queue_timeout_s)))

    @app.middleware("http")
    async def _auth(request: Request, call_next):
        if api_key is not None and request.url.path != "/health":
            got = request.headers.get("authorization", "")
            if not hmac.compare_digest(got.encode(), f"Bearer {api_key}".encode()):
                return _error(401, "missing or wrong API key (send Authorization: Bearer <key>)")
        if app.state.draining and request.url.path.startswith("/v1/") and request.method == "POST":
            return _error(503, "the server is shutting down", {"Retry-After": retry_after})
        return await call_next(request)

    @app.get("/health")
    async def health():
        engine.drop_orphans()
        a = app.state.admission
        ok = engine.alive()
        body = {"status": "ok" if ok else "unhealthy", "model": model_name, "engine": engine.name,
                "active": a.active, "waiting": a.waiting, "rejected": a.rejected, "draining": app.state.draining,
                "versions": engine.versions}
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "owned_by": "compress",
                                             "max_model_len": context}]}

    def _check(req: _Base, ids: list[int]) -> int:
        if req.model != model_name:
            raise BadRequest(f"model {req.model!r}: unknown; this server serves {model_name!r}")
        if req.temperature not in (None, 0, 0.0):
            raise BadRequest("temperature: only greedy decoding (temperature 0) is served")
        n = req.max_tokens if req.max_tokens is not None else req.max_completion_tokens
        n = default_max_tokens if n is None else n
        if n <= 0:
            raise BadRequest(f"max_tokens: must be > 0 (got {n})")
        if n > max_tokens_limit:
            raise BadRequest(f"max_tokens: {n} is above this server's limit {max_tokens_limit}")
        if not ids:
            raise BadRequest("prompt: empty")
        if len(ids) + n > context:
            raise BadRequest(f"prompt: {len(ids)} tokens + max_tokens {n} exceed the context of {context} tokens")
        if any(not 0 <= i < len(tok) for i in ids):
            raise BadRequest("prompt: token ids out of the vocabulary")
        return n

    async def _serve(req: _Base, ids: list[int], chat: bool):
        try:
            n = _check(req, ids)
        except BadRequest as e:
            return _error(400, str(e))
        adm: Admission = app.state.admission
        try:
            await adm.acquire()
        except Busy as e:
            return _error(503, str(e), {"Retry-After": retry_after})
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:16]
        slot = _Slot(adm)
        if req.stream:
            return _SlotStream(_sse(req, ids, n, chat, rid, slot), slot)
        try:
            last = None
            async for step in engine.generate(ids, n, req.ignore_eos):
                last = step
            if last is None or last.error:
                return _error(500, f"generation failed: {last.error if last else 'no output'}")
            return _final(req, ids, last.tokens, n, chat, rid)
        finally:
            slot.release()

    def _final(req: _Base, ids: list[int], tokens: list[int], n: int, chat: bool, rid: str) -> dict:
        text = tok.decode(tokens, skip_special_tokens=True)
        reason = "length" if len(tokens) >= n else "stop"
        choice: dict = {"index": 0, "finish_reason": reason}
        choice.update({"message": {"role": "assistant", "content": text}} if chat else {"text": text})
        if req.return_token_ids:
            choice["token_ids"] = tokens
        usage = {"prompt_tokens": len(ids), "completion_tokens": len(tokens), "total_tokens": len(ids) + len(tokens)}
        return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                "model": model_name, "choices": [choice], "usage": usage}

    async def _sse(req: _Base, ids: list[int], n: int, chat: bool, rid: str, slot: _Slot):
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(delta: str, reason: str | None, extra: dict | None = None) -> str:
            c: dict = {"index": 0, "finish_reason": reason}
            c.update({"delta": {"content": delta}} if chat else {"text": delta})
            body = {"id": rid, "object": obj, "created": int(time.time()), "model": model_name, "choices": [c]}
            return "data: " + json.dumps({**body, **(extra or {})}) + "\n\n"

        sent_text, tokens = "", []
        try:
            if chat:
                yield "data: " + json.dumps({"id": rid, "object": obj, "created": int(time.time()), "model": model_name,
                                             "choices": [{"index": 0, "delta": {"role": "assistant"},
                                                          "finish_reason": None}]}) + "\n\n"
            async for step in engine.generate(ids, n, req.ignore_eos):
                if step.error:
                    yield "data: " + json.dumps({"error": {"message": f"generation failed: {step.error}"}}) + "\n\n"
                    return
                new = step.tokens[len(tokens):]
                tokens = step.tokens
                text = tok.decode(tokens, skip_special_tokens=True)
                if text.endswith("\ufffd") and not step.finished:
                    text = text[:-1]  # half a UTF-8 character: wait for the rest
                delta, sent_text = text[len(sent_text):], text
                extra = {"token_ids": new} if req.return_token_ids else None
                if step.finished:
                    yield chunk(delta, "length" if len(tokens) >= n else "stop", extra)
                elif new:
                    yield chunk(delta, None, extra)
            if (req.stream_options or {}).get("include_usage"):
                usage = {"prompt_tokens": len(ids), "completion_tokens": len(tokens),
                         "total_tokens": len(ids) + len(tokens)}
                yield "data: " + json.dumps({"id": rid, "object": obj, "model": model_name, "choices": [],
                                             "usage": usage}) + "\n\n"
            yield "data: [DONE]\n\n"
        finally:
            slot.release()

    async def _parse(request: Request, model: type[_Base]):
        """The body as `model`, or a 400 naming the first problem (any content type: curl -d sends form's)."""
        try:
            raw = json.loads(await request.body())
        except ValueError:
            return _error(400, "the request body is not valid JSON")
        if not isinstance(raw, dict):
            return _error(400, "the request body must be a JSON object")
        try:
            return model.model_validate(raw)
        except ValidationError as e:
            first = e.errors()[0]
            where = ".".join(str(x) for x in first.get("loc", ())) or "body"
            return _error(400, f"{where}: {first.get('msg')}")

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = await _parse(request, CompletionRequest)
        if isinstance(req, JSONResponse):
            return req
        ids = req.prompt if isinstance(req.prompt, list) else tok(req.prompt, add_special_tokens=False)["input_ids"]
        return await _serve(req, list(ids), chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = await _parse(request, ChatRequest)
        if isinstance(req, JSONResponse):
            return req
        if not getattr(tok, "chat_template", None):
            return _error(400, f"model {model_name!r} has no chat template: use /v1/completions")
        try:
            ids = tok.apply_chat_template(req.messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        except Exception as e:  # a message the template cannot render
            return _error(400, f"messages: {e}")
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return await _serve(req, list(ids), chat=True)

    return app
