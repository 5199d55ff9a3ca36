"""Prometheus metrics of `compress serve` (prometheus_client, one registry per app), scraped at GET /metrics (behind
the API key when one is set, like every route but /health).

    compress_serve_requests_total{route,status}      HTTP requests answered, by route and status (401, 413, 503 too)
    compress_serve_rejected_total{reason}            503s: queue_full, queue_timeout, draining
    compress_serve_queue_waiting                     requests waiting for a slot now
    compress_serve_running                           sequences generating now
    compress_serve_time_to_first_token_seconds       from the request's arrival (queueing included) to its first token
    compress_serve_inter_token_latency_seconds       between two successive outputs of one sequence
    compress_serve_request_duration_seconds{route}   from arrival to the end of the response
    compress_serve_prompt_tokens_total, compress_serve_generation_tokens_total
"""
from __future__ import annotations

import time

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")
_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_ITL = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
CONTENT_TYPE = CONTENT_TYPE_LATEST


class Metrics:
    def __init__(self, running=lambda: 0, waiting=lambda: 0) -> None:
        self.registry = r = CollectorRegistry()
        p = "compress_serve_"
        self.requests = Counter(p + "requests", "HTTP requests answered", ["route", "status"], registry=r)
        self.rejected = Counter(p + "rejected", "requests refused with 503", ["reason"], registry=r)
        Gauge(p + "queue_waiting", "requests waiting for a slot", registry=r).set_function(waiting)
        Gauge(p + "running", "sequences generating", registry=r).set_function(running)
        self.ttft = Histogram(p + "time_to_first_token_seconds", "arrival to first token", buckets=_LATENCY,
                              registry=r)
        self.itl = Histogram(p + "inter_token_latency_seconds", "time between outputs of a sequence", buckets=_ITL,
                             registry=r)
        self.duration = Histogram(p + "request_duration_seconds", "arrival to end of response", ["route"],
                                  buckets=_LATENCY, registry=r)
        self.prompt_tokens = Counter(p + "prompt_tokens", "prompt tokens of admitted sequences", registry=r)
        self.generation_tokens = Counter(p + "generation_tokens", "tokens generated", registry=r)

    def scrape(self) -> bytes:
        return generate_latest(self.registry)


class TokenClock:
    """TTFT and inter-token latency of one sequence: `tick(n_new)` at each output that brings new tokens."""

    def __init__(self, metrics: Metrics, t0: float) -> None:
        self.m, self.last, self.first = metrics, t0, True

    def tick(self, n_new: int) -> None:
        if n_new <= 0:
            return
        now = time.monotonic()
        (self.m.ttft if self.first else self.m.itl).observe(now - self.last)
        self.first, self.last = False, now
        self.m.generation_tokens.inc(n_new)


class MetricsMiddleware:
    """Counts every HTTP response by route and status and times it (pure ASGI: streamed bodies included)."""

    def __init__(self, app, metrics: Metrics) -> None:
        self.app, self.m = app, metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        route = scope["path"] if scope["path"] in ROUTES else "other"
        t0, status = time.monotonic(), [500]

        async def _send(message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, _send)
        finally:
            self.m.requests.labels(route, str(status[0])).inc()
            self.m.duration.labels(route).observe(time.monotonic() - t0)
