"""What the OpenAI-compatible routes of `compress serve` accept and answer, around the fake engine of
test_serve_app.py (token i reads " w{i}", generation 10, 11, ...), over loopback, without torch: stop strings
(streamed and not), echo, logprobs and batched prompts on /v1/completions, 400 naming every field not served,
400 for a bad role or a lone surrogate, 413 past the body cap, tokenizing off the event loop, /metrics, and the
drain's 503 while the listening socket stays open (the real SIGTERM: test_serve.py)."""
from __future__ import annotations

import asyncio
import json
import urllib.request

import pytest
from fastapi import Request

from tests.serve_helpers import post
from tests.unit.test_serve_app import _app, run, until  # noqa: F401 - run is a fixture

CHAT = [{"role": "user", "content": "hi there"}]


def _sse(url: str, body: dict) -> list[dict]:
    req = urllib.request.Request(url, data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        events = [line.decode().strip()[6:] for line in r if line.startswith(b"data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_stop_strings_end_the_text_before_them_streamed_and_not(run):
    app = _app(max_tokens_limit=20)
    srv = run(app)
    url = srv.url + "/v1/completions"
    body = {"model": "fake", "prompt": "a b", "max_tokens": 10}
    status, out = post(url, {**body, "stop": " w12"})
    assert status == 200 and out["choices"][0]["text"] == " w10 w11"
    assert out["choices"][0]["finish_reason"] == "stop" and out["usage"]["completion_tokens"] == 3
    assert app.state.fake.closed_early == 1  # the generation was cancelled at the stop string, not run to 10
    # a stop string across two tokens (" w11" + " w12"); streamed, no chunk may show any of it
    chunks = _sse(url, {**body, "stop": ["zz", "1 w12"]})
    texts = [c["choices"][0]["text"] for c in chunks]
    assert "".join(texts) == " w10 w1" and chunks[-1]["choices"][0]["finish_reason"] == "stop"
    status, out = post(url, {**body, "stop": ["zz"]})  # never met: all 10 tokens, "length"
    assert out["choices"][0]["text"] == "".join(f" w{i}" for i in range(10, 20))
    assert out["choices"][0]["finish_reason"] == "length"
    chat = {"model": "fake", "messages": CHAT, "max_tokens": 10, "stop": [" w11"]}
    status, out = post(srv.url + "/v1/chat/completions", chat)
    assert status == 200 and out["choices"][0]["message"]["content"] == " w10"
    assert out["choices"][0]["finish_reason"] == "stop"
    chunks = _sse(srv.url + "/v1/chat/completions", chat)
    deltas = [c["choices"][0]["delta"].get("content", "") for c in chunks]
    assert "".join(deltas) == " w10" and chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_logprobs_echo_and_batched_prompts(run):
    srv = run(_app(slots=2, max_queue=1))
    url = srv.url + "/v1/completions"
    # lm-eval's local-completions loglikelihood request: a batch of token-id lists, echo, logprobs 1, max_tokens 1
    status, out = post(url, {"model": "fake", "prompt": [[5, 6, 7], [8, 9]], "echo": True, "logprobs": 1,
                             "max_tokens": 1, "temperature": 0, "seed": 1234})
    assert status == 200, out
    c0, c1 = sorted(out["choices"], key=lambda c: c["index"])
    assert c0["text"] == " w5 w6 w7 w10" and c1["text"] == " w8 w9 w10"
    assert c0["logprobs"] == {"tokens": [" w5", " w6", " w7", " w10"], "token_logprobs": [None, -0.06, -0.07, -0.1],
                              "top_logprobs": [None, {" w1": -0.001, " w6": -0.06}, {" w1": -0.001, " w7": -0.07},
                                               {" w1": -0.001, " w10": -0.1}],
                              "text_offset": [0, 3, 6, 9]}
    assert out["usage"] == {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}
    # max_tokens 0 with echo: the prompt's logprobs only
    status, out = post(url, {"model": "fake", "prompt": [5, 6], "echo": True, "logprobs": 0, "max_tokens": 0})
    assert status == 200 and out["choices"][0]["text"] == " w5 w6"
    assert out["choices"][0]["logprobs"]["token_logprobs"] == [None, -0.06]
    assert out["choices"][0]["logprobs"]["top_logprobs"] == [None, {" w6": -0.06}]
    # without echo: the generated tokens only, offsets after the prompt's text; a batch of strings
    status, out = post(url, {"model": "fake", "prompt": ["a b", "cc"], "logprobs": 2, "max_tokens": 2})
    lp = out["choices"][1]["logprobs"]
    assert lp["tokens"] == [" w10", " w11"] and lp["token_logprobs"] == [-0.1, -0.11]
    assert lp["text_offset"] == [2, 6] and set(lp["top_logprobs"][0]) == {" w1", " w2", " w10"}
    for body, needle in [({"prompt": [[5], [6], [7], [8]]}, "prompt: a batch of 4 prompts is more than this "
                                                           "server's slots + queue (3); send fewer at once"),
                         ({"prompt": [5], "max_tokens": 0}, "max_tokens: must be > 0 (got 0; 0 is served with "
                                                            "echo=true only)"),
                         ({"prompt": [[5], []]}, "prompt.1: empty"),
                         ({"prompt": "a", "logprobs": 21}, "logprobs: Input should be less than or equal to 20")]:
        status, out = post(url, {"model": "fake", "max_tokens": 1, **body})
        assert status == 400 and out["error"]["message"] == needle, (body, out)


NOT_SERVED = [  # (route, extra fields, what the 400 must say)
    ("completions", {"n": 3}, "n: only n=1 is served"),
    ("completions", {"best_of": 2}, "best_of: only best_of=1"),
    ("completions", {"suffix": "end"}, "suffix: suffix (insertion) is not served"),
    ("completions", {"logit_bias": {"5": 10}}, "logit_bias: logit_bias is not served"),
    ("completions", {"presence_penalty": 0.5}, "presence_penalty: penalties are not served"),
    ("completions", {"frobnicate": 1}, "frobnicate: unknown field"),
    ("completions", {"prompt": "hi \ud800 there"}, "prompt: not valid Unicode"),
    ("completions", {"stream": True, "logprobs": 1}, "logprobs: logprobs is not served with stream=true"),
    ("completions", {"stream": True, "prompt": ["a", "b"]}, "prompt: a batch of prompts is not served with stream"),
    ("completions", {"stop": ""}, "stop: Value error, a stop string may not be empty"),
    ("completions", {"min_tokens": 1}, "min_tokens: 1 < max_tokens is not served"),
    ("completions", {"repeat_penalty": 1.1}, "repeat_penalty: penalties are not served"),
    ("chat", {"n": 3}, "n: only n=1 is served"),
    ("chat", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools: tools are not served"),
    ("chat", {"tool_choice": "auto"}, "tool_choice: tools are not served"),
    ("chat", {"functions": [{"name": "f"}]}, "functions: tools are not served"),
    ("chat", {"response_format": {"type": "json_object"}}, "response_format: response_format is not served"),
    ("chat", {"logprobs": True}, "logprobs: logprobs are served on /v1/completions only"),
    ("chat", {"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role: Input should be 'system'"),
    ("chat", {"messages": [{"role": "assistant", "content": "x", "tool_calls": []}]},
     "messages.0.tool_calls: unknown field"),
    ("chat", {"messages": [{"role": "user", "content": "a \udfff"}]}, "messages.0.content: not valid Unicode"),
]


@pytest.mark.parametrize("route,extra,needle", NOT_SERVED, ids=[f"{r}-{next(iter(e))}" for r, e, _ in NOT_SERVED])
def test_fields_not_served_get_400_naming_them(run, route, extra, needle):
    srv = run(_app())
    base = {"model": "fake", "max_tokens": 2, **({"prompt": "a b"} if route == "completions" else {"messages": CHAT})}
    status, out = post(f"{srv.url}/v1/{'chat/' if route == 'chat' else ''}completions", {**base, **extra})
    assert status == 400 and out["error"]["message"].startswith(needle), out


def test_harmless_fields_are_accepted(run):
    app = _app()
    srv = run(app)
    harmless = {"n": 1, "best_of": 1, "user": "u1", "seed": 7, "top_p": 0.9, "logit_bias": {}, "presence_penalty": 0,
                "stream_options": None}
    status, out = post(srv.url + "/v1/completions", {"model": "fake", "prompt": "a", "max_tokens": 2, **harmless})
    assert status == 200, out
    # what the load generator sends to every engine (pipeline/serve/loadtest.py): min_tokens = max_tokens is ignore_eos
    from pipeline.serve.loadtest import FIXED_LENGTH_GREEDY

    body = {"model": "fake", "prompt": "a", "max_tokens": 3, "min_tokens": 3, "stream": True,
            "stream_options": {"include_usage": True}, **FIXED_LENGTH_GREEDY}
    assert _sse(srv.url + "/v1/completions", body)[-1]["usage"]["completion_tokens"] == 3
    assert app.state.fake.ignore_eos == [False, True]
    chat = {"model": "fake", "max_tokens": 2, "tools": [], "tool_choice": "none", "response_format": {"type": "text"},
            "parallel_tool_calls": False, "logprobs": False, "n": 1,
            "messages": [{"role": "system", "content": "s"}, {"role": "developer", "content": "d"},
                         {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]}
    status, out = post(srv.url + "/v1/chat/completions", chat)
    assert status == 200 and out["choices"][0]["message"]["content"] == " w10 w11", out


def test_body_cap_is_413_and_tokenizing_is_off_the_event_loop(run):
    import aiohttp

    app = _app(max_body_bytes=2000)
    srv = run(app)
    url = srv.url + "/v1/completions"
    status, out = post(url, {"model": "fake", "prompt": "a " * 1500, "max_tokens": 2})
    assert status == 413 and "larger than this server's limit of 2000 bytes" in out["error"]["message"]

    async def chunked():  # no Content-Length: cut while reading
        async def gen():
            yield b'{"model": "fake", "prompt": "'
            for _ in range(30):
                yield b"a " * 100
            yield b'"}'
        async with aiohttp.ClientSession() as s, s.post(url, data=gen()) as r:
            return r.status, r.headers.get("Transfer-Encoding")

    assert asyncio.run(chunked()) == (413, None)
    assert post(url, {"model": "fake", "prompt": "a b", "max_tokens": 2})[0] == 200
    assert post(srv.url + "/v1/chat/completions", {"model": "fake", "messages": CHAT, "max_tokens": 2})[0] == 200
    assert app.state.fake.tokenizer.threads and all(t.startswith("tokenize") for t in app.state.fake.tokenizer.threads)


def test_metrics_scrape_behind_the_key(run):
    srv = run(_app(api_key="k1"))
    key = {"Authorization": "Bearer k1"}
    assert post(srv.url + "/v1/completions", {"model": "fake", "prompt": "a b", "max_tokens": 3}, key)[0] == 200
    assert post(srv.url + "/v1/completions", {"model": "fake", "prompt": "a", "n": 2}, key)[0] == 400
    try:
        urllib.request.urlopen(srv.url + "/metrics", timeout=5)
        raise AssertionError("/metrics answered without the key")
    except urllib.error.HTTPError as e:
        assert e.code == 401
    with urllib.request.urlopen(urllib.request.Request(srv.url + "/metrics", headers=key), timeout=5) as r:
        assert r.headers["Content-Type"].startswith("text/plain")
        text = r.read().decode()
    lines = dict(ln.rsplit(" ", 1) for ln in text.splitlines() if ln and not ln.startswith("#"))
    assert lines['compress_serve_requests_total{route="/v1/completions",status="200"}'] == "1.0"
    assert lines['compress_serve_requests_total{route="/v1/completions",status="400"}'] == "1.0"
    assert lines['compress_serve_requests_total{route="/metrics",status="401"}'] == "1.0"
    assert lines["compress_serve_prompt_tokens_total"] == "2.0"
    assert lines["compress_serve_generation_tokens_total"] == "3.0"
    assert lines["compress_serve_time_to_first_token_seconds_count"] == "1.0"
    assert lines["compress_serve_inter_token_latency_seconds_count"] == "2.0"
    assert lines["compress_serve_queue_waiting"] == "0.0" and lines["compress_serve_running"] == "0.0"


def test_drain_answers_503_while_requests_in_flight_finish(run):
    import aiohttp

    app = _app()
    srv = run(app)
    app.state.fake.hold.clear()

    async def go():
        async with aiohttp.ClientSession() as s:
            async def one():
                async with s.post(srv.url + "/v1/completions",
                                  json={"model": "fake", "prompt": "a", "max_tokens": 2}) as r:
                    return r.status, await r.json(), dict(r.headers)

            first = asyncio.create_task(one())
            while app.state.drain.in_flight == 0:
                await asyncio.sleep(0.005)
            app.state.drain.begin(30)  # what the first SIGTERM does (the real signal: test_serve.py)
            second = await one()
            got = await s.get(srv.url + "/health")
            health = (got.status, await got.json())
            app.state.fake.hold.set()
            return await first, second, health

    first, second, (health_status, health) = asyncio.run(go())
    # a load balancer's probe reads the status: a draining server is not ready (#42: it answered 200)
    assert first[0] == 200 and health["draining"] is True and health_status == 503
    assert second[0] == 503 and second[1]["error"]["message"] == "the server is shutting down"
    assert int(second[2]["Retry-After"]) >= 1 and second[2]["Connection"] == "close"
    until(lambda: app.state.drain.in_flight == 0)  # the middleware's count drops just after the last byte is sent
    assert app.state.drain.done()


def _echo_app(**deps):
    """Stands for llama_cpp.server's app (not installed here): its generation routes answer the body they got."""
    from fastapi import Depends, FastAPI

    app = FastAPI()

    async def echo(request: Request):
        return {"body": await request.json(), "length": request.headers["content-length"]}

    for path in ("/v1/completions", "/v1/chat/completions"):
        app.add_api_route(path, echo, methods=["POST"], dependencies=[Depends(d) for d in deps.values()])
    return app


def test_llama_cpp_max_tokens_limit_and_body_cap(run):
    from pipeline.serve.engines.llamacpp import TokenCap

    app = _echo_app()
    app.add_middleware(TokenCap, limit=8, max_body_bytes=2000)
    url = run(app).url
    status, out = post(url + "/v1/completions", {"prompt": "x", "max_tokens": 9})
    assert status == 400 and out["error"]["message"] == "max_tokens: 9 is above this server's limit 8"
    assert post(url + "/v1/chat/completions", {"messages": [], "max_completion_tokens": 20})[0] == 400
    for path, body, want in [("/v1/chat/completions", {"messages": []}, 8),  # llama.cpp: absent = the context
                             ("/v1/completions", {"prompt": "x"}, 8),  # its default 16, at most the limit
                             ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 8),  # 0 = the context
                             ("/v1/completions", {"prompt": "x", "max_tokens": None}, 8),
                             ("/v1/completions", {"prompt": "x", "max_tokens": 5}, 5)]:
        status, out = post(url + path, body)
        assert status == 200 and out["body"]["max_tokens"] == want, (body, out)
        assert int(out["length"]) == len(json.dumps(out["body"]).encode())
    status, out = post(url + "/v1/completions", {"prompt": "a " * 1500})
    assert status == 413 and "limit of 2000 bytes" in out["error"]["message"]


def test_llama_cpp_key_compared_in_constant_time(run, monkeypatch):
    import hmac

    from pipeline.serve import auth  # the llama.cpp engine's key check: needs fastapi, not the [gguf-serve] extra

    calls, real = [], hmac.compare_digest
    monkeypatch.setattr(auth.hmac, "compare_digest", lambda a, b: calls.append((a, b)) or real(a, b))
    url = run(_echo_app(auth=auth.bearer_check("sk-7"))).url
    body = {"prompt": "x", "max_tokens": 2}
    assert post(url + "/v1/completions", body)[0] == 401
    assert post(url + "/v1/completions", body, {"Authorization": "Bearer sk-8"})[0] == 401
    assert post(url + "/v1/completions", body, {"Authorization": "Bearer sk-7"})[0] == 200
    assert calls == [(b"", b"sk-7"), (b"sk-8", b"sk-7"), (b"sk-7", b"sk-7")]


def test_stop_text_and_continuation_on_plain_strings():
    from pipeline.serve.output import StopText, continuation

    view = StopText(["ab", "xyz"])  # holds back len("xyz") - 1 = 2 characters while generating
    assert view.update("hello a", False) == ("hello", False)
    assert view.update("hello xa", False) == ("hello ", False)
    assert view.update("hello xab and more", False) == ("hello x", True)  # the earliest stop string wins
    assert StopText([]).update("caf\ufffd", False) == ("caf", False)  # half a UTF-8 character waits for the rest
    assert StopText([]).update("caf\ufffd", True) == ("caf\ufffd", False)
    assert StopText(["."]).update("a.b", True) == ("a", True)

    def words(ids):  # a tokenizer that joins words with spaces (the tiny model's word-level one)
        return " ".join(f"t{i}" for i in ids)
    assert continuation(words, [5, 6], [7, 8]) == " t7 t8" and words([5, 6]) + continuation(words, [5, 6], [7]) == \
        words([5, 6, 7])
    assert continuation(words, [], [7]) == "t7" and continuation(words, [5], []) == ""


def test_chat_without_max_tokens_gets_the_remaining_context(run):
    """#42: OpenAI and vLLM default a chat request's max_tokens to the rest of the context (capped by this server's
    limit); it stopped at 16 tokens. /v1/completions keeps OpenAI's 16."""
    srv = run(_app(max_tokens_limit=100))  # the fake engine's context: 64 tokens
    status, out = post(srv.url + "/v1/chat/completions", {"model": "fake", "messages": CHAT})
    assert status == 200, out
    assert out["usage"]["completion_tokens"] == 64 - out["usage"]["prompt_tokens"] == 61
    assert out["choices"][0]["finish_reason"] == "length"
    status, out = post(srv.url + "/v1/completions", {"model": "fake", "prompt": "a b"})
    assert status == 200 and out["usage"]["completion_tokens"] == 16, out
    srv2 = run(_app(max_tokens_limit=20))  # below the rest of the context: the server's limit
    status, out = post(srv2.url + "/v1/chat/completions", {"model": "fake", "messages": CHAT})
    assert status == 200 and out["usage"]["completion_tokens"] == 20, out


@pytest.mark.parametrize("depth", [200, 900, 5000, 100000])
def test_a_deeply_nested_body_is_400_not_500(run, depth):
    """#42: json.loads raises RecursionError past ~1000 levels (and a walk of a parsed body could too): 500 before."""
    srv = run(_app())
    for route in ("/v1/completions", "/v1/chat/completions"):
        body = b'{"model": "fake", "prompt": ' + b"[" * depth + b"]" * depth + b"}"
        status, out = post(srv.url + route, body)
        assert status == 400, (route, status, out)
        assert out["error"]["type"] == "invalid_request_error" and out["error"]["message"], out
