"""`compress serve` on the tiny random model, over loopback: routes, validation, greedy equality with `generate`,
the bounded queue under 64 concurrent streams, a client killed mid-stream, SIGTERM during load, SIGTERM with a
request held open (the port stays open: 503 with Retry-After during the drain, exit 0 after), the API key, and the
refusals at start (non-loopback bind without a key, not an export folder, port in use, engine that cannot serve)."""
from __future__ import annotations

import asyncio
import json
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request

import pytest

from tests.serve_helpers import Server, env, free_port, post, serve_cmd, tiny_export

pytestmark = pytest.mark.slow  # each server is a subprocess that imports torch and transformers (~5 s)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tiny_export(tmp_path_factory.mktemp("serve") / "tiny")


@pytest.fixture(scope="module")
def server(folder, tmp_path_factory):
    s = Server(folder, "--slots", "2", "--max-queue", "8", "--queue-timeout-s", "3",
               log=tmp_path_factory.mktemp("log") / "server.log")
    yield s
    assert s.stop() == 0


def _run(cmd_args, timeout=60, **extra):
    return subprocess.run(cmd_args, env=env(**extra), capture_output=True, text=True, timeout=timeout)


async def _stream(url, body, timeout, kill_after_chunks=None):
    """(status, chunks, finished with [DONE], error)."""
    import aiohttp

    chunks, done = 0, False
    try:
        async with aiohttp.ClientSession() as s:
            async with s.post(url + "/v1/completions", json={**body, "stream": True},
                              timeout=aiohttp.ClientTimeout(total=timeout)) as r:
                if r.status != 200:
                    return r.status, 0, False, await r.text()
                async for raw in r.content:
                    line = raw.decode().strip()
                    if line == "data: [DONE]":
                        done = True
                    elif line.startswith("data: "):
                        if "error" in json.loads(line[6:]):
                            return 200, chunks, False, line
                        chunks += 1
                        if kill_after_chunks and chunks >= kill_after_chunks:
                            return 200, chunks, False, "killed by the client"
                return 200, chunks, done, None
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        return None, chunks, False, f"{type(e).__name__}"


def test_models_health_and_validation(server):
    import urllib.request

    with urllib.request.urlopen(server.url + "/v1/models") as r:
        assert json.loads(r.read())["data"][0]["id"] == "tiny"
    h = server.health()
    assert h["status"] == "ok" and h["active"] == 0 and h["engine"].startswith("transformers")
    url = server.url + "/v1/completions"
    cases = [({"model": "nope", "prompt": "t3", "max_tokens": 2}, "unknown"),
             ({"model": "tiny", "prompt": "t3", "max_tokens": 0}, "must be > 0"),
             ({"model": "tiny", "prompt": "t3", "max_tokens": 5000}, "above this server's limit 2048"),
             ({"model": "tiny", "prompt": " ".join(["t3"] * 130), "max_tokens": 2}, "context of 128 tokens"),
             ({"model": "tiny", "prompt": "t3", "max_tokens": 2, "temperature": 0.7}, "greedy"),
             (b"{not json", "not valid JSON"),
             ({"model": "tiny"}, "prompt: Field required")]
    for body, needle in cases:
        status, out = post(url, body)
        assert status == 400, (body, out)
        assert needle in out["error"]["message"], (needle, out)


def test_greedy_equals_generate(server, folder):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    prompts = [[1, 5, 9, 33, 7], [1, 8, 8, 100], [1, 400, 3, 3, 3, 3, 77, 12], [1, 250]]
    for ids in prompts:
        ref = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)[0, len(ids):].tolist()
        status, out = post(server.url + "/v1/completions",
                           {"model": "tiny", "prompt": ids, "max_tokens": 12, "return_token_ids": True})
        assert status == 200
        assert out["choices"][0]["token_ids"] == ref
    # streamed and batched together: the same tokens
    async def all_streams():
        import aiohttp

        async def one(ids):
            toks = []
            async with aiohttp.ClientSession() as s, s.post(server.url + "/v1/completions", json={
                    "model": "tiny", "prompt": ids, "max_tokens": 12, "stream": True, "return_token_ids": True}) as r:
                async for raw in r.content:
                    line = raw.decode().strip()
                    if line.startswith("data: {"):
                        toks += json.loads(line[6:]).get("token_ids", [])
            return toks
        return await asyncio.gather(*(one(p) for p in prompts))

    refs = [model.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False)[0, len(p):].tolist()
            for p in prompts]
    assert asyncio.run(all_streams()) == refs


def test_chat_completion(server):
    status, out = post(server.url + "/v1/chat/completions",
                       {"model": "tiny", "messages": [{"role": "user", "content": "t5 t6"}], "max_tokens": 3})
    assert status == 200 and out["object"] == "chat.completion"
    assert out["usage"]["completion_tokens"] <= 3 and out["choices"][0]["message"]["role"] == "assistant"


def test_64_streams_against_a_queue_of_8(server):
    body = {"model": "tiny", "prompt": "t4 t5 t6", "max_tokens": 120, "ignore_eos": True}

    async def go():
        return await asyncio.gather(*(_stream(server.url, body, timeout=30) for _ in range(64)))

    t0 = time.monotonic()
    results = asyncio.run(go())
    assert time.monotonic() - t0 < 60
    done = [r for r in results if r[0] == 200 and r[2]]
    busy = [r for r in results if r[0] == 503]
    assert len(done) + len(busy) == 64, [r for r in results if r not in done and r not in busy][:3]
    assert len(done) >= 2 and len(busy) >= 1  # how many fit depends on arrival times; never more than 2 + 8 at once
    assert all(r[1] == 120 for r in done)
    h = server.health()
    assert h["active"] == 0 and h["waiting"] == 0 and h["status"] == "ok"
    status, out = post(server.url + "/v1/completions", {"model": "tiny", "prompt": "t9", "max_tokens": 2})
    assert status == 200 and out["usage"]["completion_tokens"] <= 2


def test_client_killed_mid_stream_frees_its_slot(server):
    body = {"model": "tiny", "prompt": "t4 t5", "max_tokens": 120, "ignore_eos": True}
    status, chunks, done, why = asyncio.run(_stream(server.url, body, timeout=30, kill_after_chunks=3))
    assert status == 200 and chunks == 3 and not done
    end = time.monotonic() + 10
    while server.health()["active"] and time.monotonic() < end:
        time.sleep(0.1)
    assert server.health()["active"] == 0
    # both slots still usable: two long requests at once complete
    async def two():
        b = {"model": "tiny", "prompt": "t7", "max_tokens": 20, "ignore_eos": True}
        return await asyncio.gather(_stream(server.url, b, 30), _stream(server.url, b, 30))
    assert all(r[0] == 200 and r[2] and r[1] == 20 for r in asyncio.run(two()))


def _until(cond, timeout: float = 30) -> None:
    """Wait for a state of the server (an event, not a duration)."""
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "the server never reached the expected state"
        time.sleep(0.02)


def test_sigterm_during_load_drains_and_exits_0(folder, tmp_path):
    drain = 3.0
    s = Server(folder, "--slots", "4", "--max-queue", "4", "--drain-s", str(drain), log=tmp_path / "s.log")
    body = {"model": "tiny", "prompt": "t4", "max_tokens": 120, "ignore_eos": True}

    async def go():
        tasks = [asyncio.create_task(_stream(s.url, body, timeout=30)) for _ in range(6)]
        await asyncio.to_thread(_until, lambda: s.health()["active"] > 0)  # generating: then the signal
        s.proc.send_signal(signal.SIGTERM)
        return await asyncio.gather(*tasks)

    results = asyncio.run(go())
    rc = s.proc.wait(timeout=drain + 30)  # generous: the drain is bounded by drain_s (+1 s to close)
    assert rc == 0, s.log.read_text()[-2000:]
    for status, chunks, done, why in results:  # finished, or ended with an error: none hangs
        assert (status == 200 and done and chunks == 120) or why is not None or status == 503
    s.stop()


def test_sigterm_keeps_the_socket_open_answering_503_until_in_flight_requests_end(folder, tmp_path):
    """A real SIGTERM to a real server: the request in flight (its body still arriving, held open by this test)
    keeps the drain going; meanwhile a new request is answered 503 with Retry-After, not refused; once the held
    request is sent and answered 200 the server exits 0, and only then is the port closed."""
    s = Server(folder, "--slots", "2", "--drain-s", "120", log=tmp_path / "d.log")
    body = json.dumps({"model": "tiny", "prompt": "t4 t5", "max_tokens": 3}).encode()
    held = socket.create_connection(("127.0.0.1", s.port), timeout=30)
    try:
        held.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body[:10])
        _until(lambda: s.health()["in_flight"] == 1)
        s.proc.send_signal(signal.SIGTERM)
        _until(lambda: s.health()["draining"])
        req = urllib.request.Request(s.url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(req, timeout=30)
        assert refused.value.code == 503 and int(refused.value.headers["Retry-After"]) >= 1
        assert json.loads(refused.value.read())["error"]["message"] == "the server is shutting down"
        assert s.proc.poll() is None  # still draining: the held request is in flight
        held.sendall(body[10:])
        reply = b""
        while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
            chunk = held.recv(65536)
            if not chunk:
                break
            reply += chunk
    finally:
        held.close()
    head, _, payload = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), reply[:300]
    assert json.loads(payload)["usage"]["completion_tokens"] == 3
    assert s.proc.wait(timeout=60) == 0, s.log.read_text()[-2000:]
    with pytest.raises(ConnectionRefusedError):  # after the drain, and only then, the port is closed
        socket.create_connection(("127.0.0.1", s.port), timeout=5).close()
    s.stop()


def test_key_required_and_never_logged(folder, tmp_path):
    key = "sk-test-7f3a9c1d2e"
    s = Server(folder, log=tmp_path / "k.log", key_env=key)
    try:
        url = s.url + "/v1/completions"
        body = {"model": "tiny", "prompt": "t3", "max_tokens": 2}
        assert post(url, body)[0] == 401
        assert post(url, body, {"Authorization": "Bearer wrong"})[0] == 401
        assert post(url, body, {"Authorization": f"Bearer {key}"})[0] == 200
        assert s.health()["status"] == "ok"  # /health needs no key (liveness probes)
    finally:
        assert s.stop() == 0
    assert key not in (tmp_path / "k.log").read_text()


def test_refusals_at_start(folder, tmp_path):
    r = _run(serve_cmd(folder, free_port(), "--host", "0.0.0.0"))
    assert r.returncode == 2 and "needs an API key" in r.stderr and "COMPRESS_API_KEY" in r.stderr
    (tmp_path / "empty").mkdir()
    r = _run(serve_cmd(tmp_path / "empty", free_port()))
    assert r.returncode == 2 and "missing config.json" in r.stderr
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "config.json").write_text("{}")
    r = _run(serve_cmd(tmp_path / "half", free_port()))
    assert r.returncode == 2 and "model weights" in r.stderr and "tokenizer" in r.stderr
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen(1)
        port = held.getsockname()[1]
        r = _run(serve_cmd(folder, port))
    assert r.returncode == 2 and f"port {port}" in r.stderr and "in use" in r.stderr
    r = _run(serve_cmd(folder, free_port(), "--engine", "llama.cpp"))
    assert r.returncode == 2, r.stderr
    assert (f"engine llama.cpp cannot serve {folder} (unquantized checkpoints) here: does not serve unquantized "
            "checkpoints on CPU (it serves a .gguf file); engines that can: transformers") in r.stderr
