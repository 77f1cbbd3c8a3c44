"""Our Prometheus collectors. `/metrics` serves these followed by vLLM's own series.

`llmendpoints_queue_depth` and `llmendpoints_requests_in_flight` are the contract the operator's
autoscaler reads from every pod: keep their names and meaning stable.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import generate_latest

PHASES = ("download", "load", "warmup", "ready")
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Latency buckets from 5 ms to 10 minutes: LLM requests span that whole range.
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class RuntimeMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._queue_sources: list[Callable[[], int]] = []
        self._in_flight_sources: list[Callable[[], int]] = []

        self.queue_depth = Gauge(
            "llmendpoints_queue_depth",
            "Requests admitted but not running yet: waiting for an admission slot, in the "
            "engine's scheduler queue, or queued as jobs.",
            registry=self.registry,
        )
        self.queue_depth.set_function(lambda: sum(f() for f in self._queue_sources))
        self.in_flight = Gauge(
            "llmendpoints_requests_in_flight",
            "Requests holding an admission slot (running in or handed to the engine).",
            registry=self.registry,
        )
        self.in_flight.set_function(lambda: sum(f() for f in self._in_flight_sources))
        self.engine_ready = Gauge(
            "llmendpoints_engine_ready",
            "1 when the engine serves requests.",
            registry=self.registry,
        )
        self.startup_phase_seconds = Gauge(
            "llmendpoints_startup_phase_seconds",
            "Duration of each start-up phase (download, load, warmup; ready = total time to ready).",
            ["phase"],
            registry=self.registry,
        )
        self.http_requests = Counter(
            "llmendpoints_http_requests",
            "HTTP requests by route template, method and status code.",
            ["route", "method", "status"],
            registry=self.registry,
        )
        self.http_latency = Histogram(
            "llmendpoints_http_request_duration_seconds",
            "Time from request start to the last byte of the response.",
            ["route", "method"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.rejected = Counter(
            "llmendpoints_requests_rejected",
            "Requests refused before reaching the engine, by reason.",
            ["reason"],
            registry=self.registry,
        )

    def add_queue_source(self, source: Callable[[], int]) -> None:
        self._queue_sources.append(source)

    def add_in_flight_source(self, source: Callable[[], int]) -> None:
        self._in_flight_sources.append(source)

    def observe_phase(self, phase: str, seconds: float) -> None:
        self.startup_phase_seconds.labels(phase=phase).set(seconds)

    def render(self, *extra_registries: object) -> bytes:
        parts = [generate_latest(self.registry)]
        for registry in extra_registries:
            if registry is not None and registry is not self.registry:
                parts.append(generate_latest(registry))
        return b"".join(parts)
