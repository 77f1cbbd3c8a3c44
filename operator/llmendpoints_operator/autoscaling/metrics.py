"""The operator's own Prometheus metrics about autoscaling (served on LLMEP_OPERATOR_METRICS_PORT).

A registry of its own, so that tests and several operators in one process never collide.
"""

from __future__ import annotations

import contextlib

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, start_http_server

from .decision import Decision

DIRECTIONS = {"ScaleUp": "up", "ScaleDown": "down", "Hold": "none"}


class AutoscalerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry(auto_describe=True)
        labels = ["namespace", "endpoint"]
        self.desired = Gauge(
            "llmendpoints_autoscaler_desired_replicas",
            "Replicas the autoscaler decided on at its last tick.",
            labels,
            registry=self.registry,
        )
        self.current = Gauge(
            "llmendpoints_autoscaler_current_replicas",
            "Replicas the Deployment had when the autoscaler last looked.",
            labels,
            registry=self.registry,
        )
        self.ready = Gauge(
            "llmendpoints_autoscaler_ready_replicas",
            "Ready replicas (listed ready in the Service's EndpointSlices) at the last tick.",
            labels,
            registry=self.registry,
        )
        self.signal = Gauge(
            "llmendpoints_autoscaler_signal",
            "Signal totals over the ready pods at the last tick (queue_depth, in_flight).",
            [*labels, "signal"],
            registry=self.registry,
        )
        self.decisions = Counter(
            "llmendpoints_autoscaler_decisions",
            "Autoscaler decisions by direction (up, down, none).",
            [*labels, "direction"],
            registry=self.registry,
        )
        self.scrape_errors = Counter(
            "llmendpoints_autoscaler_scrape_errors",
            "Pod /metrics reads that failed (timeout, HTTP error, missing gauges).",
            labels,
            registry=self.registry,
        )

    def record(self, namespace: str, endpoint: str, current: int, decision: Decision) -> None:
        """One tick's outcome."""
        key = (namespace, endpoint)
        self.desired.labels(*key).set(decision.replicas)
        self.current.labels(*key).set(current)
        self.ready.labels(*key).set(decision.signals.get("readyReplicas", 0))
        self.signal.labels(*key, "queue_depth").set(decision.signals.get("queueDepth", 0))
        self.signal.labels(*key, "in_flight").set(decision.signals.get("inFlight", 0))
        self.decisions.labels(*key, DIRECTIONS[decision.action]).inc()

    def scrape_failed(self, namespace: str, endpoint: str, count: int = 1) -> None:
        self.scrape_errors.labels(namespace, endpoint).inc(count)

    def forget(self, namespace: str, endpoint: str) -> None:
        """Drop a deleted endpoint's series."""
        series = [
            *((m, (namespace, endpoint)) for m in (self.desired, self.current, self.ready)),
            (self.scrape_errors, (namespace, endpoint)),
            *((self.signal, (namespace, endpoint, s)) for s in ("queue_depth", "in_flight")),
            *((self.decisions, (namespace, endpoint, d)) for d in DIRECTIONS.values()),
        ]
        for metric, labels in series:
            with contextlib.suppress(KeyError):
                metric.remove(*labels)

    def serve(self, port: int, addr: str = "0.0.0.0"):
        """Serve /metrics in a background thread; returns (server, thread)."""
        return start_http_server(port, addr=addr, registry=self.registry)


_shared: AutoscalerMetrics | None = None


def shared_metrics() -> AutoscalerMetrics:
    """The operator process's instance, in prometheus_client's default registry (the one
    __main__ serves on LLMEP_OPERATOR_METRICS_PORT). Created once per process."""
    global _shared
    if _shared is None:
        _shared = AutoscalerMetrics(REGISTRY)
    return _shared
