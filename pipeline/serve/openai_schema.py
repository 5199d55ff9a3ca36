"""What `compress serve` accepts on /v1/completions and /v1/chat/completions, and the 400 (or 413) for the rest.

Every field of a request is one of three kinds (vLLM's and llama.cpp's OpenAI servers are the reference for names):
- served: declared on the models below (`stop`, `echo`, `logprobs`, batched prompts, `max_tokens`, ...);
- harmless: `user`, `seed` (greedy decoding draws nothing), `top_p`/`top_k` (greedy picks the top token whatever
  they are), `stream_options`, `parallel_tool_calls` (moot without tools), `store: false`: accepted, no effect;
  `min_tokens` is served at 0 or at max_tokens and above (that is ignore_eos: what the load generator sends);
- not served: `n`, `best_of`, `tools`, `tool_choice`, `functions`, `function_call`, `response_format`, `suffix`,
  `logit_bias`, penalties, ... (`UNSERVED`): accepted only at the value that asks for nothing (n=1, tools=[] ...),
  any other value is 400 naming the field. A field in none of these is 400 "unknown field", never ignored.
"""
from __future__ import annotations

import json
from typing import Any, Literal, cast

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

MAX_BODY_BYTES = 4 * 1024 * 1024  # 4 MiB: a batch of 80 prompts of 2048 token ids is about 1.3 MB of JSON
MAX_LOGPROBS = 20  # vLLM's default max_logprobs

_NOTHING: tuple[object, ...] = (None, [], {}, "")
_NO_TOOLS = "tools are not served (no tool calling here)"
# field: (values that ask for nothing, why any other value is refused); both routes unless listed per route below
UNSERVED: dict[str, tuple[tuple, str]] = {
    "n": ((None, 1), "only n=1 is served (greedy decoding gives one answer)"),
    "best_of": ((None, 1), "only best_of=1 is served (greedy decoding)"),
    "logit_bias": (_NOTHING, "logit_bias is not served"),
    "presence_penalty": ((None, 0), "penalties are not served (greedy decoding of the model as it is)"),
    "frequency_penalty": ((None, 0), "penalties are not served (greedy decoding of the model as it is)"),
    "repetition_penalty": ((None, 1), "penalties are not served (greedy decoding of the model as it is)"),
    "min_p": ((None, 0), "min_p is not served (greedy decoding)"),
    "repeat_penalty": ((None, 1), "penalties are not served (greedy decoding of the model as it is)"),
    "include_stop_str_in_output": ((None, False), "the stop string is never included in the output here"),
    "skip_special_tokens": ((None, True), "special tokens are always skipped in the output text here"),
    "response_format": ((None, {"type": "text"}), "response_format is not served (no structured output)"),
    "guided_json": (_NOTHING, "guided decoding is not served"),
    "guided_regex": (_NOTHING, "guided decoding is not served"),
    "guided_choice": (_NOTHING, "guided decoding is not served"),
    "guided_grammar": (_NOTHING, "guided decoding is not served"),
    "store": ((None, False), "stored completions are not served"),
}
COMPLETION_UNSERVED = {"suffix": (_NOTHING, "suffix (insertion) is not served")}
CHAT_UNSERVED = {
    "tools": (_NOTHING, _NO_TOOLS), "tool_choice": ((None, "none"), _NO_TOOLS),
    "functions": (_NOTHING, _NO_TOOLS), "function_call": ((None, "none"), _NO_TOOLS),
    "logprobs": ((None, False), "logprobs are served on /v1/completions only"),
    "top_logprobs": ((None, 0), "logprobs are served on /v1/completions only"),
    "modalities": ((None, ["text"]), "text is the only modality served"),
    "audio": ((None,), "audio is not served"), "prediction": ((None,), "predicted outputs are not served"),
    "reasoning_effort": ((None,), "reasoning_effort is not served"),
    "web_search_options": ((None,), "web search is not served"),
    "echo": ((None, False), "echo is served on /v1/completions only"),
}


class BadRequest(Exception):
    status = 400


class TooLarge(BadRequest):
    status = 413


class RequestBase(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    temperature: float | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool = False  # vLLM's extension: always generate max_tokens tokens (load tests)
    min_tokens: int = Field(0, ge=0)  # vLLM's and llama.cpp's: served as 0, or >= max_tokens (= ignore_eos)
    return_token_ids: bool = False  # our extension: the generated token ids in each choice (greedy checks)
    # harmless under greedy decoding (module docstring)
    user: str | None = None
    seed: int | None = None
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = None
    parallel_tool_calls: bool | None = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        stops = [v] if isinstance(v, str) else list(v or [])
        if any(s == "" for s in stops):
            raise ValueError("a stop string may not be empty")
        return stops

    @property
    def stops(self) -> list[str]:
        return list(self.stop or [])


class CompletionRequest(RequestBase):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, strict=True)

    @property
    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: a string or a list of token ids."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(cast("list[str] | list[list[int]]", p))  # a list of ids (not empty) was returned above


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def for_template(self) -> dict:
        """The message as chat templates read it: content parts joined into one string (as vLLM does)."""
        text = self.content if isinstance(self.content, str) or self.content is None else \
            "\n".join(p.text for p in self.content)
        return {"role": self.role, "content": text or "", **({"name": self.name} if self.name else {})}


class ChatRequest(RequestBase):
    messages: list[Message] = Field(min_length=1)


def unserved(raw: dict, table: dict[str, tuple[tuple, str]]) -> None:
    """Drop the not-served fields that ask for nothing; 400 naming the first that asks for something."""
    for name, (nothing, why) in table.items():
        if name in raw:
            value = raw.pop(name)
            if value is not None and not any(value == ok and isinstance(value, bool) == isinstance(ok, bool)
                                             for ok in nothing if ok is not None):
                raise BadRequest(f"{name}: {why} (got {json.dumps(value)[:80]})")


def bad_text(value: Any, where: str = "body") -> str | None:
    """Where in a parsed JSON value a string is not valid Unicode (a lone surrogate such as "\\ud800", which JSON
    escapes allow but no tokenizer can encode), or None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return where
    elif isinstance(value, dict):
        for k, v in value.items():
            found = bad_text(k, where) or bad_text(v, f"{where}.{k}" if where != "body" else str(k))
            if found:
                return found
    elif isinstance(value, list):
        for i, v in enumerate(value):
            found = bad_text(v, f"{where}.{i}")
            if found:
                return found
    return None


def validate(raw: Any, model: type[RequestBase]) -> RequestBase:
    """The parsed JSON body as `model`, or BadRequest naming the first problem."""
    if not isinstance(raw, dict):
        raise BadRequest("the request body must be a JSON object")
    where = bad_text(raw)
    if where:
        raise BadRequest(f"{where}: not valid Unicode (a lone surrogate code point)")
    raw = dict(raw)
    unserved(raw, {**UNSERVED, **(CHAT_UNSERVED if model is ChatRequest else COMPLETION_UNSERVED)})
    try:
        return model.model_validate(raw)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(x) for x in first.get("loc", ())) or "body"
        if first.get("type") == "extra_forbidden":
            raise BadRequest(f"{where}: unknown field (not served by this server; remove it)") from None
        raise BadRequest(f"{where}: {first.get('msg')}") from None


async def read_body(receive_chunks, declared: str | None, limit: int) -> bytes:
    """The request body, at most `limit` bytes (TooLarge past it, before reading it when Content-Length says so)."""
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise TooLarge(f"the request body ({int(declared)} bytes) is larger than this server's limit of {limit} "
                       "bytes")
    body = bytearray()
    async for chunk in receive_chunks:
        body += chunk
        if len(body) > limit:
            raise TooLarge(f"the request body is larger than this server's limit of {limit} bytes")
    return bytes(body)


MAX_DEPTH = 32  # no served field nests deeper than a few levels (messages.0.content.0.text)


def parse_json(body: bytes) -> Any:
    """The parsed body, or BadRequest: not JSON, or nested deeper than MAX_DEPTH (json.loads itself raises
    RecursionError past ~1000 levels, and the walks of a parsed body recurse)."""
    try:
        raw = json.loads(body)
    except ValueError:  # also a body that is not UTF-8
        raise BadRequest("the request body is not valid JSON") from None
    except RecursionError:
        raise BadRequest(f"the request body nests deeper than {MAX_DEPTH} levels") from None
    if _depth(raw) > MAX_DEPTH:
        raise BadRequest(f"the request body nests deeper than {MAX_DEPTH} levels")
    return raw


def _depth(value: Any) -> int:
    """How deep lists and objects nest in a parsed JSON value (iterative: any depth)."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        v, d = todo.pop()
        if isinstance(v, dict | list):
            deepest = max(deepest, d)
            if d <= MAX_DEPTH:
                todo.extend((x, d + 1) for x in (v.values() if isinstance(v, dict) else v))
    return deepest
