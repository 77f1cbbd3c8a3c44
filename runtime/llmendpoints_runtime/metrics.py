"""Our Prometheus collectors. `/metrics` serves these followed by vLLM's own series.

`llmendpoints_queue_depth` and `llmendpoints_requests_in_flight` (names in
llmendpoints_common.signals) are the contract the operator's autoscaler reads from every pod
(docs/contracts.md): keep their names and meaning.
They never count a request twice: in flight = running in the engine now; queue = waiting
(for an admission slot, in vLLM's scheduler queue, or as a queued job). Their sum is the pod's
outstanding work, and a pod with a queue runs all it can, so its in-flight count is then its
capacity, whether max_num_seqs or the KV cache bounds it.

Sources: `add_queue_source` (work not handed to the engine yet), `add_in_flight_source` (work
holding a slot: handed to the engine) and `set_engine_waiting_source` (of the handed work, what
vLLM's scheduler has not started). The engine's waiting requests move from in flight to queue.
"""

from __future__ import annotations

from collections.abc import Callable

from llmendpoints_common import signals
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
)
from prometheus_client.exposition import generate_latest

# startup: process start -> the engine's start (imports, configuration); compile: the part of
# load vLLM reports as its compile (startup_report.py); ready: the total, start-up to ready.
PHASES = ("startup", "download", "load", "compile", "warmup", "ready")
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Latency buckets from 5 ms to an hour: LLM requests span that whole range (a /runsync or a long
# stream lasts minutes; the gateway's own buckets are the same).
_LATENCY_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1200, 1800,
    3600,
)  # fmt: skip


QUEUE_DEPTH_HELP = (
    "Requests admitted but not running yet: waiting for an admission slot, in the "
    "engine's scheduler queue, or queued as jobs."
)
IN_FLIGHT_HELP = (
    "Requests and jobs the engine is running now (waiting ones are in llmendpoints_queue_depth)."
)


def split_signals(waiting: int, handed: int, engine_waiting: int) -> tuple[int, int]:
    """(queue depth, in flight) from the work not handed to the engine, the work handed to it
    and what of that the engine's scheduler holds waiting (pure): the engine's waiting requests
    count as queue, never twice. Clamped: the engine may count a request the handed-over
    sources already released (it finishes between the two reads), or one job may hold
    several engine requests."""
    engine = min(max(engine_waiting, 0), handed)
    return waiting + engine, handed - engine


class RuntimeMetrics:
    """``pod``: one of several API processes (API_SERVER_COUNT > 1, prometheus_client in
    multiprocess mode): the two signal gauges are then the pod's, computed where /metrics is
    rendered (pod/metrics.py) from every process's ``raw_signals``; the other gauges say how
    their values combine across processes."""

    def __init__(self, *, pod: bool = False) -> None:
        # No `_created` series (process-wide, vLLM's too): they double the series count and
        # nothing reads them.
        disable_created_metrics()
        self.registry = CollectorRegistry(auto_describe=True)
        self._queue_sources: list[Callable[[], int]] = []
        self._in_flight_sources: list[Callable[[], int]] = []
        self._engine_waiting: Callable[[], int] = lambda: 0
        self._refreshers: list[Callable[[], None]] = []

        if not pod:
            self.queue_depth = Gauge(signals.QUEUE_DEPTH, QUEUE_DEPTH_HELP, registry=self.registry)
            self.queue_depth.set_function(lambda: self.signals()[0])
            self.in_flight = Gauge(signals.IN_FLIGHT, IN_FLIGHT_HELP, registry=self.registry)
            self.in_flight.set_function(lambda: self.signals()[1])
        self.engine_ready = Gauge(
            "llmendpoints_engine_ready",
            "1 when the engine serves requests.",
            registry=self.registry,
            multiprocess_mode="livemin",  # the pod: ready when every API process is
        )
        self.startup_phase_seconds = Gauge(
            "llmendpoints_startup_phase_seconds",
            "Duration of each start-up phase: startup (process start to engine start), download, "
            "load (compile: the part of it vLLM reports as compiling), warmup; ready = the "
            "engine's start to ready.",
            ["phase"],
            registry=self.registry,
            multiprocess_mode="livemax",
        )
        self.compile_source = Gauge(
            "llmendpoints_startup_compile_source",
            "1 for where this start-up's compiled model came from: cache (the shared compile "
            "cache), compiled, or reload_failed (a cached one would not load; compiled again).",
            ["source"],
            registry=self.registry,
        )
        self.http_requests = Counter(
            "llmendpoints_http_requests",
            "HTTP requests by route template, method and HTTP status code.",
            ["route", "method", "code"],
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

    def set_engine_waiting_source(self, source: Callable[[], int]) -> None:
        self._engine_waiting = source

    def raw_signals(self) -> tuple[int, int]:
        """(work not handed to the engine, work handed to it), from the sources."""
        handed = sum(f() for f in self._in_flight_sources)
        return sum(f() for f in self._queue_sources), handed

    def signals(self) -> tuple[int, int]:
        """(queue depth, in flight): the engine's waiting requests count as queue, never twice.
        The two are read one after the other, so under churn one sample can be off by the
        requests that moved in between; the sum is exact whenever they did not."""
        waiting, handed = self.raw_signals()
        return split_signals(waiting, handed, self._engine_waiting())

    def add_refresher(self, refresh: Callable[[], None]) -> None:
        """A gauge of a feature to set before a pod's /metrics is rendered (in multiprocess
        mode a gauge's value is what was last set, never a function's)."""
        self._refreshers.append(refresh)

    def refresh(self) -> None:
        for refresh in self._refreshers:
            refresh()

    def observe_phase(self, phase: str, seconds: float) -> None:
        self.startup_phase_seconds.labels(phase=phase).set(seconds)

    def render(self, *extra_registries: object) -> bytes:
        parts = [generate_latest(self.registry)]
        for registry in extra_registries:
            if registry is not None and registry is not self.registry:
                parts.append(generate_latest(registry))
        return b"".join(parts)
