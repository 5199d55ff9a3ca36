"""A run's own serving units start a private loopback server for their own clients: COMPRESS_API_KEY in the user's
environment (what `compress serve --help` recommends for a real deployment) is not that server's key, so the load
test and the served-perplexity client, which send none, are answered (they got HTTP 401 on every request)."""
from tests.serve_helpers import post, tiny_export


def test_the_measurement_server_ignores_the_users_serving_key(tmp_path, monkeypatch):
    from pipeline.serve.measure import serving

    monkeypatch.setenv("COMPRESS_API_KEY", "users-secret")
    folder = tiny_export(tmp_path / "export")
    with serving(folder, "transformers", ["--threads", "1"], tmp_path / "server.log", 60) as server:
        status, body = post(server.url + "/v1/completions", {"model": "export", "prompt": "t3 t4", "max_tokens": 2})
    assert status == 200, body
    assert body["choices"][0]["text"] is not None
