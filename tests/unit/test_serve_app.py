"""The admission of `compress serve` (pipeline/serve/app.py, admission.py) around a fake engine, over loopback,
without torch: the bounded queue (a full queue and a wait past queue_timeout_s both get 503 with Retry-After, ordered
by the server's state, not by sleeps) and streamed chat completions (SSE); and the engine's stream
(pipeline/serve/engine.py) against a fake continuous-batching manager that answers before add_request returns.
The fake engine and tokenizer here also serve test_serve_api.py (what the routes accept and answer).
Each test takes a few seconds at most."""
from __future__ import annotations

import asyncio
import itertools
import json
import queue
import threading
import time

import pytest

from pipeline.serve.app import build_app
from pipeline.serve.engine import Step, TransformersEngine
from tests.serve_helpers import free_port, post


class FakeTokenizer:
    """Token i reads " w{i}"; a word of the prompt is token 3 + len(word) % 90. Records the threads it ran on."""
    chat_template = "{{ messages }}"

    def __init__(self) -> None:
        self.threads: set[str] = set()

    def __len__(self) -> int:
        return 100

    def _ids(self, text: str) -> list[int]:
        return [3 + len(w) % 90 for w in text.split()]

    def __call__(self, text, add_special_tokens: bool = False) -> dict:
        self.threads.add(threading.current_thread().name)
        return {"input_ids": [self._ids(t) for t in text] if isinstance(text, list) else self._ids(text)}

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(f" w{i}" for i in ids)

    def apply_chat_template(self, messages, **_) -> list[int]:
        self.threads.add(threading.current_thread().name)
        return [5] + [7 for m in messages for _ in str(m.get("content", "")).split()]


class FakeEngine:
    """Generates token 10, 11, ... one every `delay` seconds; while `hold` is clear, the first output waits.
    score(): log p(token t) = -t / 100 at every position, top-k the ids 1..k with -id / 1000."""
    name, context, versions = "fake", 64, {"fake": "1"}

    def __init__(self, delay: float) -> None:
        self.tokenizer, self.delay = FakeTokenizer(), delay
        self.hold = threading.Event()
        self.hold.set()
        self.closed_early = 0
        self.ignore_eos: list[bool] = []  # what each generation was asked

    def alive(self) -> bool:
        return True

    def drop_orphans(self) -> None:
        pass

    async def generate(self, ids, n, ignore_eos):
        self.ignore_eos.append(ignore_eos)
        while not self.hold.is_set():
            await asyncio.sleep(0.01)
        done = False
        try:
            for k in range(1, n + 1):
                await asyncio.sleep(self.delay)
                done = k == n
                yield Step(list(range(10, 10 + k)), done)
        finally:
            self.closed_early += not done

    def score(self, ids, first, k):
        return [(-ids[i] / 100, [(j, -j / 1000) for j in range(1, k + 1)]) for i in range(first, len(ids))]


class Running:
    """The app under uvicorn in a thread on a free loopback port."""

    def __init__(self, app) -> None:
        import uvicorn

        self.url = f"http://127.0.0.1:{free_port()}"
        port = int(self.url.rsplit(":", 1)[1])
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        end = time.monotonic() + 10
        while not self.server.started and time.monotonic() < end:
            time.sleep(0.02)
        assert self.server.started

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def _app(delay: float = 0.0, **kw):
    args = {"slots": 1, "max_queue": 1, "queue_timeout_s": 0.5, "max_tokens_limit": 32, "api_key": None, **kw}
    engine = FakeEngine(delay)
    app = build_app(engine, "fake", **args)
    app.state.fake = engine
    return app


@pytest.fixture
def run():
    started = []

    def start(app) -> Running:
        started.append(Running(app))
        return started[-1]

    yield start
    for r in started:
        r.stop()


def until(cond, timeout: float = 10) -> None:
    """Wait for a state of the server (an event, not a duration)."""
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "the server never reached the expected state"
        time.sleep(0.005)


def test_full_queue_and_queue_timeout_get_503_with_retry_after(run):
    """Ordered by the server's own state, not by sleeps: the first request holds the only slot until released, the
    second waits in the queue (max_queue 1) and gets 503 after queue_timeout_s, a third finds the queue full."""
    import aiohttp

    app = _app()
    adm, engine = app.state.admission, app.state.fake
    engine.hold.clear()
    srv = run(app)
    body = {"model": "fake", "prompt": "a b", "max_tokens": 10}

    async def go():
        async with aiohttp.ClientSession() as s:
            async def one():
                t0 = time.monotonic()
                async with s.post(srv.url + "/v1/completions", json=body) as r:
                    return r.status, await r.json(), dict(r.headers), time.monotonic() - t0

            first = asyncio.create_task(one())
            await asyncio.to_thread(until, lambda: adm.active == 1)
            second = asyncio.create_task(one())
            await asyncio.to_thread(until, lambda: adm.waiting == 1)
            s3, o3, h3, _ = await one()  # slot busy and queue full: 503 at once
            s2, o2, h2, t2 = await second  # the first still holds the slot: the second's wait ran out
            assert not first.done()
            engine.hold.set()
            return await first, (s2, o2, h2, t2), (s3, o3, h3)

    (s1, o1, _, _), (s2, o2, h2, t2), (s3, o3, h3) = asyncio.run(go())
    assert s1 == 200 and o1["usage"]["completion_tokens"] == 10
    assert s2 == 503 and "no slot within 0.5 s" in o2["error"]["message"] and h2["Retry-After"] == "1"
    assert t2 >= 0.45  # it waited its queue_timeout_s (a lower bound: no upper bound on a shared machine)
    assert s3 == 503 and "the queue is full (1 requests waiting for 1 slots)" in o3["error"]["message"]
    assert h3["Retry-After"] == "1"
    assert adm.rejected == 2 and adm.active == 0 and adm.waiting == 0
    assert post(srv.url + "/v1/completions", body)[0] == 200  # and it serves the next request


def test_streamed_chat_completion(run):
    import urllib.request

    srv = run(_app())
    body = {"model": "fake", "messages": [{"role": "user", "content": "hi there"}], "max_tokens": 3, "stream": True,
            "stream_options": {"include_usage": True}}
    req = urllib.request.Request(srv.url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        assert r.headers["Content-Type"].startswith("text/event-stream")
        events = [line.decode().strip()[6:] for line in r if line.startswith(b"data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" and c["model"] == "fake" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant"}
    deltas = [c["choices"][0]["delta"]["content"] for c in chunks[1:] if c["choices"]]
    assert "".join(deltas) == " w10 w11 w12"
    assert [c["choices"][0]["finish_reason"] for c in chunks[1:] if c["choices"]][-1] == "length"
    assert chunks[-1]["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}


class _Out:
    def __init__(self, rid: str, tokens: list[int], done: bool) -> None:
        self.request_id, self.generated_tokens, self._done, self.error = rid, tokens, done, None

    def is_finished(self) -> bool:
        return self._done


class EagerManager:
    """transformers' manager as far as the engine uses it (OutputRouter.deliver and register_result_handler, as in
    transformers 5.24's continuous_api.py), with a generation thread faster than its caller: every output of a
    request is delivered before add_request returns. An output with no handler yet goes to the shared queue."""

    def __init__(self) -> None:
        self.output_router = type("Router", (), {})()
        self.output_router._lock, self.output_router.result_handlers = threading.Lock(), {}
        self.output_router.output_queue = queue.Queue()
        self.cancelled: list[str] = []

    def _deliver(self, out: _Out) -> None:
        with self.output_router._lock:
            entry = self.output_router.result_handlers.get(out.request_id)
        if entry is None:
            self.output_router.output_queue.put(out)
        else:
            entry[1].call_soon_threadsafe(entry[0], out)

    def register_result_handler(self, rid: str, callback) -> None:
        def cleanup(out):
            callback(out)
            if out.is_finished():
                with self.output_router._lock:
                    self.output_router.result_handlers.pop(rid, None)

        with self.output_router._lock:
            self.output_router.result_handlers[rid] = (cleanup, asyncio.get_running_loop())

    def add_request(self, ids, request_id, max_new_tokens, streaming, eos_token_id):
        for k in range(1, max_new_tokens + 1):
            self._deliver(_Out(request_id, list(range(100, 100 + k)), k == max_new_tokens))
        return request_id

    def cancel_request(self, rid: str) -> None:
        self.cancelled.append(rid)


def _engine(manager: EagerManager, poll_s: float | None = None) -> TransformersEngine:
    """A TransformersEngine with no model: the fake manager stands for it (its generation thread, healthy)."""
    eng = TransformersEngine.__new__(TransformersEngine)
    eng._cb, eng._ids, eng.eos = manager, itertools.count(), [2]
    eng._cb.background_thread_status = type("Status", (), {"fatal_error": None})()
    if poll_s is not None:
        eng.POLL_S = poll_s
    return eng


def _generate(eng: TransformersEngine, ids: list[int], n: int) -> list[Step]:
    """Every step of one request's stream, within 5 s."""
    async def collect() -> list[Step]:
        return [s async for s in eng.generate(ids, n, ignore_eos=False)]

    return asyncio.run(asyncio.wait_for(collect(), 5))


def test_engine_stream_gets_outputs_emitted_before_add_request_returns():
    """A request's outputs may come before add_request returns (the generation thread runs beside the event loop):
    none may be lost, or a stream misses tokens, or a short request never ends and keeps its slot."""
    eng = _engine(EagerManager())
    for n in (1, 3):
        steps = _generate(eng, [1, 5, 9], n)
        assert [s.tokens for s in steps] == [list(range(100, 100 + k)) for k in range(1, n + 1)]
        assert steps[-1].finished and not any(s.finished for s in steps[:-1])
    assert eng._cb.output_router.output_queue.empty() and eng._cb.output_router.result_handlers == {}
    assert eng._cb.cancelled == []


def test_engine_stream_ends_when_the_generation_thread_has_stopped():
    """A manager whose thread died delivers nothing more: the request ends with an error, not a wait forever."""
    class Dead(EagerManager):
        def add_request(self, ids, request_id, max_new_tokens, streaming, eos_token_id):
            return request_id  # accepted, then the thread stops: no output ever comes

        def is_running(self) -> bool:
            return False

    eng = _engine(Dead(), poll_s=0.05)
    steps = _generate(eng, [1, 5], 4)
    assert len(steps) == 1 and steps[0].finished and steps[0].error == "the generation thread stopped"
    assert eng._cb.output_router.result_handlers == {}


def test_a_wait_past_queue_timeout_is_busy():
    """asyncio.wait_for's timeout is a 503 queue_timeout, not a 500."""
    from pipeline.serve.admission import Admission, Busy

    adm = Admission(slots=1, max_queue=1, timeout_s=0.05)

    async def second_waits_too_long() -> str:
        await adm.acquire()
        with pytest.raises(Busy) as refused:
            await adm.acquire()
        return refused.value.reason

    assert asyncio.run(second_waits_too_long()) == "queue_timeout"
    assert (adm.active, adm.waiting, adm.rejected) == (1, 0, 1)


def test_engine_stream_outlives_poll_timeouts():
    """A request whose first output comes after several POLL_S waits (a long prefill) still gets it: each wait's
    timeout is caught as a poll timeout, not the end of the stream."""
    class Slow(EagerManager):
        def add_request(self, ids, request_id, max_new_tokens, streaming, eos_token_id):
            threading.Timer(0.2, self._deliver, (_Out(request_id, [100], True),)).start()
            return request_id

        def is_running(self) -> bool:
            return True

    eng = _engine(Slow(), poll_s=0.02)
    steps = _generate(eng, [1, 5], 1)
    assert [s.tokens for s in steps] == [[100]] and steps[0].finished and steps[0].error is None
