"""The SIGTERM drain of `compress serve` (transformers and llama.cpp engines), with the listening socket kept open.

uvicorn's own graceful shutdown closes the listening socket first, so a client arriving during the drain gets
"connection refused". Here the first SIGTERM/SIGINT only starts the drain: the socket stays open, every new request
but /health and /metrics is answered 503 with Retry-After (and Connection: close), requests already in flight (from
their first byte, queued ones included) get up to `drain_s` seconds to finish; when none is left, or at the
deadline, uvicorn's shutdown runs (listening socket closed, what is still running cut after CLOSE_S). A second
signal skips the rest of the drain. Exit 0.
"""
from __future__ import annotations

import json
import logging
import math
import signal
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import uvicorn

log = logging.getLogger("compress.serve")
EXEMPT = ("/health", "/metrics")  # probes and scrapes are answered during the drain, and are not waited for
CLOSE_S = 1.0  # after the drain: how long uvicorn's shutdown lets responses still being written finish


@dataclass
class Drain:
    draining: bool = False
    in_flight: int = 0
    refused: int = 0
    deadline: float = 0.0
    on_refuse: Callable[[], None] = field(default=lambda: None, repr=False)

    def begin(self, drain_s: float) -> bool:
        """Start draining (True the first time)."""
        if self.draining:
            return False
        self.draining, self.deadline = True, time.monotonic() + drain_s
        return True

    def done(self) -> bool:
        return self.draining and (self.in_flight == 0 or time.monotonic() >= self.deadline)

    def retry_after(self) -> str:
        return str(max(1, math.ceil(self.deadline - time.monotonic())))


class DrainMiddleware:
    """Counts the requests in flight; during the drain answers new ones 503 (pure ASGI: it sees a request from its
    first byte, before its body has arrived)."""

    def __init__(self, app, drain: Drain) -> None:
        self.app, self.drain = app, drain

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] in EXEMPT:
            return await self.app(scope, receive, send)
        d = self.drain
        if d.draining:
            d.refused += 1
            d.on_refuse()
            body = json.dumps({"error": {"message": "the server is shutting down", "type": "server_busy"}}).encode()
            await send({"type": "http.response.start", "status": 503,
                        "headers": [(b"content-type", b"application/json"), (b"retry-after", d.retry_after().encode()),
                                    (b"connection", b"close"), (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})
            return
        d.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            d.in_flight -= 1


def run(asgi_app, drain: Drain, sock: socket.socket, drain_s: float) -> None:
    """Serve on `sock` until a signal and its drain have ended."""
    class _Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            if drain.begin(drain_s):
                log.warning("signal %s: draining in-flight requests for up to %g s (new ones get 503)", sig, drain_s)
                self._captured_signals.append(sig)
            else:  # a second signal: stop now
                super().handle_exit(sig, frame)

        async def on_tick(self, counter: int) -> bool:
            if drain.done():
                self.should_exit = True
            return await super().on_tick(counter)

    # uvicorn annotates timeout_graceful_shutdown as int but passes it to asyncio.wait_for, which takes seconds as float
    config = uvicorn.Config(asgi_app, log_level="warning",
                            timeout_graceful_shutdown=CLOSE_S,  # type: ignore[arg-type]
                            access_log=False, timeout_keep_alive=5)
    for sig in (signal.SIGTERM, signal.SIGINT):
        # uvicorn restores the handlers it found and re-raises the signal it drained on: a no-op here makes the
        # drained exit 0 (not -15)
        signal.signal(sig, lambda *_: None)
    _Server(config).run(sockets=[sock])
