"""Prometheus metrics: request counts and latencies per route, and the service's own events.

Each app gets its own registry (several apps can live in one test process). The middleware is
plain ASGI, not Starlette's BaseHTTPMiddleware, which would add a task per request.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from starlette.routing import compile_path
from starlette.types import ASGIApp, Message, Receive, Scope, Send


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "tuner_http_requests", "HTTP requests", ["method", "route", "status"], registry=r
        )
        self.latency = Histogram(
            "tuner_http_request_seconds", "HTTP request latency", ["route"], registry=r,
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10),
        )  # fmt: skip
        self.measurements = Counter(
            "tuner_measurements", "measurements received", ["result"], registry=r
        )
        self.misses = Counter(
            "tuner_misses_reported", "misses reported (summed counts)", registry=r
        )
        self.winner_changes = Counter("tuner_winner_changes", "served winners set", registry=r)
        self.pending = Counter(
            "tuner_pending_changes", "large changes held for confirmation", registry=r
        )
        self.leases = Counter("tuner_leases", "queue lease events", ["event"], registry=r)
        self.artifacts = Counter(
            "tuner_artifact_publishes", "artifacts published, by outcome (new, same, conflict, "
            "known conflict)", ["outcome"], registry=r,
        )  # fmt: skip

    def add_collector(self, collect: Callable[[], Iterator[GaugeMetricFamily]]) -> None:
        """Gauges computed at scrape time (queue depth, served winners) from the database."""

        class _Scrape(Collector):
            def collect(self) -> Iterator[GaugeMetricFamily]:
                return collect()

        self.registry.register(_Scrape())


class MetricsMiddleware:
    """Counts and times each request by its route's path template. A request answered before
    routing (a body over the limit) is put under the template its path matches among
    ``paths()`` (the API's, asked for once, when first needed)."""

    def __init__(self, app: ASGIApp, metrics: Metrics, paths: Callable[[], list[str]]) -> None:
        self.app, self.metrics, self.paths = app, metrics, paths
        self._templates: list[tuple[re.Pattern[str], str]] | None = None

    def _route(self, scope: Scope) -> str:
        route = scope.get("route")
        if route is not None:
            return getattr(route, "path", "unmatched")
        if self._templates is None:
            self._templates = [(compile_path(p)[0], p) for p in self.paths()]
        path = scope["path"]
        return next((p for regex, p in self._templates if regex.match(path)), "unmatched")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            route = self._route(scope)
            self.metrics.requests.labels(scope["method"], route, str(status)).inc()
            self.metrics.latency.labels(route).observe(time.perf_counter() - started)
