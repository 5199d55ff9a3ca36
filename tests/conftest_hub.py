"""`hub_server` fixture: a loopback Hub plus an environment that can only reach it.

Use it from a test module with `from tests.conftest_hub import hub_server  # noqa: F401`
(or list "tests.conftest_hub" in `pytest_plugins` of the root conftest.py).
"""
from __future__ import annotations

import pytest

from tests.hubserver import HubServer

FAKE_TOKEN = "hf_FAKEtokenLoopbackDoNotLeak0123456789"


@pytest.fixture
def hub_env(monkeypatch, tmp_path):
    """huggingface_hub pointed away from the real Hub and the user's login; HF_TOKEN = FAKE_TOKEN.

    Some huggingface_hub settings are read at import time, so the constants are patched too;
    still pass `endpoint=` explicitly to HfApi / snapshot_download.
    """
    from huggingface_hub import constants

    home = tmp_path / "hf-home"
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    monkeypatch.setenv("HF_TOKEN", FAKE_TOKEN)
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_OIDC_RESOURCE", "HUGGING_FACE_HUB_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_TELEMETRY", True, raising=False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(home / "token"))
    monkeypatch.setattr(constants, "HF_STORED_TOKENS_PATH", str(home / "stored_tokens"))
    return home


@pytest.fixture
def hub_server(hub_env, monkeypatch):
    """A running loopback Hub that requires FAKE_TOKEN for writes; HF_ENDPOINT points at it."""
    with HubServer(token=FAKE_TOKEN) as server:
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        yield server
        assert not server.errors, "loopback hub internal errors:\n" + "\n".join(server.errors)
