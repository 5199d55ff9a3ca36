"""Generation behind the routes: admission per sequence, greedy tokens from the engine, stop strings, echo and
logprobs, the JSON and SSE answers. Tokenizing, chat templates and scoring run off the event loop (one worker
thread each), so a large prompt never stalls the requests in flight.

A batched prompt (a list of strings or of token-id lists) is one sequence per prompt: each takes its own slot, all
run together, and the request answers with one choice per prompt (`index` = its position); one refused (queue full
or timeout) fails the request with 503. Streaming serves one prompt at a time, without echo or logprobs.
"""
from __future__ import annotations

import asyncio
import functools
import json
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing
from dataclasses import dataclass

from pipeline.serve.admission import Admission, Slot
from pipeline.serve.metrics import Metrics, TokenClock
from pipeline.serve.openai_schema import BadRequest, ChatRequest, CompletionRequest, RequestBase
from pipeline.serve.output import CONTEXT_TOKENS, StopText, continuation, finish_reason, legacy_logprobs, top_dict


class GenerationError(Exception):
    pass


@dataclass
class Seq:
    ids: list[int]
    text: str | None = None  # the prompt as the client sent it (None: token ids)


@dataclass
class Result:
    tokens: list[int]
    text: str
    reason: str


class Service:
    def __init__(self, engine, model_name: str, adm: Admission, metrics: Metrics, *, max_tokens_limit: int,
                 default_max_tokens: int) -> None:
        self.engine, self.tok, self.context = engine, engine.tokenizer, engine.context
        self.model_name, self.adm, self.m = model_name, adm, metrics
        self.limit, self.default_max_tokens = max_tokens_limit, default_max_tokens
        self._tokenize_pool = ThreadPoolExecutor(1, thread_name_prefix="tokenize")
        self._score_pool = ThreadPoolExecutor(1, thread_name_prefix="score")

    async def _off_loop(self, pool: ThreadPoolExecutor, fn, *args, **kw):
        return await asyncio.get_running_loop().run_in_executor(pool, functools.partial(fn, *args, **kw))

    # ---- requests to sequences -------------------------------------------------------------------------------
    async def completion_seqs(self, req: CompletionRequest) -> list[Seq]:
        prompts = req.prompts
        if not prompts:
            raise BadRequest("prompt: empty")
        texts = [p for p in prompts if isinstance(p, str)]
        try:
            enc = await self._off_loop(self._tokenize_pool, self.tok, texts, add_special_tokens=False) if texts \
                else {"input_ids": []}
        except Exception as e:  # noqa: BLE001 - whatever the tokenizer cannot encode is the request's problem
            raise BadRequest(f"prompt: cannot be tokenized ({e})") from None
        it = iter(enc["input_ids"])
        return [Seq(list(next(it)), p) if isinstance(p, str) else Seq(list(p)) for p in prompts]

    async def chat_seq(self, req: ChatRequest) -> Seq:
        if not getattr(self.tok, "chat_template", None):
            raise BadRequest(f"model {self.model_name!r} has no chat template: use /v1/completions")
        messages = [m.for_template() for m in req.messages]
        try:
            ids = await self._off_loop(self._tokenize_pool, self.tok.apply_chat_template, messages,
                                       add_generation_prompt=True, tokenize=True, return_dict=False)
        except Exception as e:  # noqa: BLE001 - a message the template cannot render
            raise BadRequest(f"messages: {e}") from None
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return Seq(list(ids))

    def check(self, req: RequestBase, seqs: list[Seq], echo: bool = False, chat: bool = False) -> int:
        """max_tokens for every sequence, or BadRequest naming what is wrong. Not given: for a completion OpenAI's
        16 (`default_max_tokens`), for a chat the rest of the context up to this server's limit (as OpenAI and
        vLLM)."""
        if req.model != self.model_name:
            raise BadRequest(f"model {req.model!r}: unknown; this server serves {self.model_name!r}")
        if req.temperature not in (None, 0, 0.0):
            raise BadRequest("temperature: only greedy decoding (temperature 0) is served")
        n = req.max_tokens if req.max_tokens is not None else req.max_completion_tokens
        if n is None:
            n = max(1, min(self.limit, self.context - max(len(s.ids) for s in seqs))) if chat and seqs \
                else self.default_max_tokens
        if n < 0 or (n == 0 and not echo):
            raise BadRequest(f"max_tokens: must be > 0 (got {n}; 0 is served with echo=true only)")
        if n > self.limit:
            raise BadRequest(f"max_tokens: {n} is above this server's limit {self.limit}")
        if req.min_tokens and not req.ignore_eos:
            if req.min_tokens < n:
                raise BadRequest(f"min_tokens: {req.min_tokens} < max_tokens is not served (0, or >= max_tokens: "
                                 "always max_tokens tokens, as ignore_eos)")
            req.ignore_eos = True
        room = self.adm.slots + self.adm.max_queue
        if len(seqs) > room:
            raise BadRequest(f"prompt: a batch of {len(seqs)} prompts is more than this server's slots + queue "
                             f"({room}); send fewer at once")
        for i, s in enumerate(seqs):
            where = "prompt" if len(seqs) == 1 else f"prompt.{i}"
            if not s.ids:
                raise BadRequest(f"{where}: empty")
            if len(s.ids) + n > self.context:
                raise BadRequest(f"{where}: {len(s.ids)} tokens + max_tokens {n} exceed the context of "
                                 f"{self.context} tokens")
            if any(not 0 <= i < len(self.tok) for i in s.ids):
                raise BadRequest(f"{where}: token ids out of the vocabulary")
        return n

    # ---- generation ------------------------------------------------------------------------------------------
    async def text_steps(self, ids: list[int], n: int, req: RequestBase, clock: TokenClock, live: bool = True):
        """(text delta, new token ids, all tokens, finish reason or None) as the output grows; the last one has the
        finish reason. A stop string ends it (its text cut before the stop string) and cancels the generation.
        Not `live` and no stop string: the text is decoded once, at the end."""
        view, sent = StopText(req.stops), ""
        tokens: list[int] = []
        decode, context = functools.partial(self.tok.decode, skip_special_tokens=True), ids[-CONTEXT_TOKENS:]
        async with aclosing(self.engine.generate(ids, n, req.ignore_eos)) as steps:
            async for step in steps:
                if step.error:
                    raise GenerationError(step.error)
                new, tokens = step.tokens[len(tokens):], step.tokens
                clock.tick(len(new))
                if not (live or view.stops or step.finished):
                    continue
                visible, stopped = view.update(continuation(decode, context, tokens), step.finished)
                delta = visible[len(sent):] if len(visible) >= len(sent) else ""
                sent = visible if len(visible) >= len(sent) else sent
                if stopped or step.finished:
                    yield delta, new, tokens, finish_reason(stopped, len(tokens), n)
                    return
                if new:
                    yield delta, new, tokens, None
        raise GenerationError("no output")

    async def collect(self, seq: Seq, n: int, req: RequestBase, t0: float) -> Result:
        if n == 0:
            return Result([], "", "length")
        parts, tokens, reason = [], [], "length"
        async for delta, _, so_far, fin in self.text_steps(seq.ids, n, req, TokenClock(self.m, t0), live=False):
            tokens = so_far  # the last step's: every token generated
            parts.append(delta)
            reason = fin or reason
        return Result(list(tokens), "".join(parts), reason)

    async def admit(self, seq: Seq) -> Slot:
        await self.adm.acquire()
        self.m.prompt_tokens.inc(len(seq.ids))
        return Slot(self.adm)

    async def complete(self, req: CompletionRequest, seqs: list[Seq], n: int, t0: float) -> dict:
        async def one(i: int, seq: Seq) -> tuple[dict, Result]:
            slot = await self.admit(seq)
            try:
                res = await self.collect(seq, n, req, t0)
                choice = {"index": i, "text": res.text, "logprobs": None, "finish_reason": res.reason}
                if req.echo or req.logprobs is not None:
                    prompt_text = seq.text if seq.text is not None else \
                        await self._off_loop(self._tokenize_pool, self.tok.decode, seq.ids, skip_special_tokens=True)
                    if req.echo:
                        choice["text"] = prompt_text + res.text
                    if req.logprobs is not None:
                        choice["logprobs"] = await self.logprobs(seq, res, req.logprobs, req.echo, len(prompt_text))
            finally:
                slot.release()
            if req.return_token_ids:
                choice["token_ids"] = res.tokens
            return choice, res

        done = await _all_or_none([one(i, s) for i, s in enumerate(seqs)])
        usage = _usage(sum(len(s.ids) for s in seqs), sum(len(r.tokens) for _, r in done))
        return self.body("cmpl-", "text_completion", [c for c, _ in done], usage)

    async def chat(self, req: ChatRequest, seq: Seq, n: int, t0: float) -> dict:
        slot = await self.admit(seq)
        try:
            res = await self.collect(seq, n, req, t0)
        finally:
            slot.release()
        choice = {"index": 0, "message": {"role": "assistant", "content": res.text}, "logprobs": None,
                  "finish_reason": res.reason}
        if req.return_token_ids:
            choice["token_ids"] = res.tokens
        return self.body("chatcmpl-", "chat.completion", [choice], _usage(len(seq.ids), len(res.tokens)))

    async def logprobs(self, seq: Seq, res: Result, k: int, echo: bool, prompt_chars: int) -> dict:
        """The legacy `logprobs` record of the generated tokens (with echo, of the prompt's too: its first token has
        none, as in OpenAI's and vLLM's answers), from the model's log-softmax over prompt + output."""
        full = seq.ids + res.tokens
        first = 1 if echo else len(seq.ids)
        scored = await self._off_loop(self._score_pool, self.engine.score, full, first, k) if first < len(full) \
            else []

        def strings() -> tuple[list[str], list[dict | None]]:
            shown = full if echo else full[first:]
            names = [self.tok.decode([i], skip_special_tokens=False) for i in shown]
            tops = [top_dict(names[j], lp, [(self.tok.decode([i], skip_special_tokens=False), v) for i, v in top])
                    for j, (lp, top) in enumerate(scored, start=1 if echo else 0)]
            return names, ([None] if echo else []) + tops

        names, tops = await self._off_loop(self._tokenize_pool, strings)
        lps = ([None] if echo else []) + [lp for lp, _ in scored]
        return legacy_logprobs(names, lps, tops, 0 if echo else prompt_chars)

    # ---- answers ---------------------------------------------------------------------------------------------
    def body(self, prefix: str, obj: str, choices: list[dict], usage: dict | None = None) -> dict:
        out = {"id": prefix + uuid.uuid4().hex[:16], "object": obj, "created": int(time.time()),
               "model": self.model_name, "choices": choices}
        return {**out, "usage": usage} if usage is not None else out

    async def sse(self, req: RequestBase, seq: Seq, n: int, chat: bool, slot: Slot, t0: float):
        obj = "chat.completion.chunk" if chat else "text_completion"
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:16]

        def event(choices: list[dict], **extra) -> str:
            body = {"id": rid, "object": obj, "created": int(time.time()), "model": self.model_name,
                    "choices": choices, **extra}
            return "data: " + json.dumps(body) + "\n\n"

        def chunk(delta: str, reason: str | None, new: list[int]) -> str:
            c: dict = {"index": 0, "finish_reason": reason}
            c.update({"delta": {"content": delta}} if chat else {"text": delta, "logprobs": None})
            return event([c], **({"token_ids": new} if req.return_token_ids else {}))

        tokens: list[int] = []
        try:
            if chat:
                yield event([{"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}])
            try:
                async for delta, new, so_far, fin in self.text_steps(seq.ids, n, req, TokenClock(self.m, t0)):
                    tokens = so_far  # for the usage line
                    yield chunk(delta, fin, new)
            except GenerationError as e:
                yield "data: " + json.dumps({"error": {"message": f"generation failed: {e}"}}) + "\n\n"
                return
            if (req.stream_options or {}).get("include_usage"):
                yield event([], usage=_usage(len(seq.ids), len(tokens)))
            yield "data: [DONE]\n\n"
        finally:
            slot.release()


def _usage(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


async def _all_or_none(coros: list) -> list:
    """The results of all, in order; the first exception cancels the others and is raised."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    finally:
        pending = [t for t in tasks if not t.done()]
        for t in pending:
            t.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
    failed = [t for t in tasks if not t.cancelled() and t.exception() is not None]
    if failed:
        raise failed[0].exception()
    return [t.result() for t in tasks]
