"""The operator's own Prometheus metrics about autoscaling (served on LLMEP_OPERATOR_METRICS_PORT).

In the registry they are given: the operator's startup (handlers.py) passes the one __main__
serves; without one (tests) they get a fresh registry of their own.

Every series names its LLMEndpoint as ``endpoint="<namespace>/<name>"``, the label and value the
gateway uses and the chart's PodMonitor gives the runtime pods' series, so one dashboard variable
selects an endpoint across the three components. (No ``namespace`` label of our own: Prometheus
gives every target its own, here the operator's.)
"""

from __future__ import annotations

import contextlib

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics

from .decision import Decision, Outside

DIRECTIONS = {"ScaleUp": "up", "ScaleDown": "down", "Hold": "none"}
PRIORITIES = ("normal", "low", "batch")
# A cold start is a pod scheduled, an image pulled, a model downloaded and loaded: 5 s to 30 min.
_COLD_START_BUCKETS = (5, 10, 20, 30, 45, 60, 90, 120, 180, 300, 600, 900, 1800)


def endpoint_label(namespace: str, name: str) -> str:
    """The ``endpoint`` label's value: ``<namespace>/<name>`` (DECISIONS §2's endpoint id)."""
    return f"{namespace}/{name}"


class AutoscalerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        disable_created_metrics()  # process-wide: no `_created` series (nothing reads them)
        self.registry = registry or CollectorRegistry(auto_describe=True)
        labels = ["endpoint"]
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

        self.held = Gauge(
            "llmendpoints_autoscaler_held_requests",
            "Requests the gateway replicas hold for the endpoint (no ready replica), last tick.",
            labels,
            registry=self.registry,
        )
        self.queued_jobs = Gauge(
            "llmendpoints_autoscaler_queued_jobs",
            "Jobs waiting in the shared queue for the endpoint at the last tick, by priority.",
            [*labels, "priority"],
            registry=self.registry,
        )
        self.running_jobs = Gauge(
            "llmendpoints_autoscaler_running_jobs",
            "Jobs of the endpoint that runtime pods run, per the shared queue, at the last tick.",
            labels,
            registry=self.registry,
        )
        self.batch_requests = Gauge(
            "llmendpoints_autoscaler_batch_requests",
            "Requests of the endpoint's running batches not answered yet, at the last tick.",
            labels,
            registry=self.registry,
        )
        self.batches_at_risk = Gauge(
            "llmendpoints_autoscaler_batches_at_risk",
            "Running batches of the endpoint that will not finish inside their completion "
            "window at the rate they go, even at maxReplicas (see the BatchAtRisk Event).",
            labels,
            registry=self.registry,
        )
        self.outside_errors = Counter(
            "llmendpoints_autoscaler_queue_read_errors",
            "Reads of held requests / queued jobs from NATS that failed.",
            labels,
            registry=self.registry,
        )
        self.cold_start = Histogram(
            "llmendpoints_autoscaler_cold_start_seconds",
            "Time from a scale-up-from-zero decision to the endpoint's first ready replica.",
            labels,
            buckets=_COLD_START_BUCKETS,
            registry=self.registry,
        )

    def record_outside(self, namespace: str, endpoint: str, outside: Outside) -> None:
        ref = endpoint_label(namespace, endpoint)
        self.held.labels(ref).set(outside.held)
        self.queued_jobs.labels(ref, "normal").set(outside.jobs_queued)
        self.queued_jobs.labels(ref, "low").set(outside.jobs_queued_low_priority)
        self.queued_jobs.labels(ref, "batch").set(outside.jobs_queued_batch)
        self.running_jobs.labels(ref).set(outside.jobs_running)
        self.batch_requests.labels(ref).set(outside.batch_requests)

    def outside_failed(self, namespace: str, endpoint: str) -> None:
        self.outside_errors.labels(endpoint_label(namespace, endpoint)).inc()

    def cold_started(self, namespace: str, endpoint: str, seconds: float | None) -> None:
        if seconds is not None:
            self.cold_start.labels(endpoint_label(namespace, endpoint)).observe(seconds)

    def record(self, namespace: str, endpoint: str, current: int, decision: Decision) -> None:
        """One tick's outcome."""
        key = (endpoint_label(namespace, endpoint),)
        self.desired.labels(*key).set(decision.replicas)
        self.current.labels(*key).set(current)
        self.ready.labels(*key).set(decision.signals.get("readyReplicas", 0))
        self.signal.labels(*key, "queue_depth").set(decision.signals.get("queueDepth", 0))
        self.signal.labels(*key, "in_flight").set(decision.signals.get("inFlight", 0))
        self.decisions.labels(*key, DIRECTIONS[decision.action]).inc()
        self.batches_at_risk.labels(*key).set(len(decision.batches_at_risk))

    def scrape_failed(self, namespace: str, endpoint: str, count: int = 1) -> None:
        self.scrape_errors.labels(endpoint_label(namespace, endpoint)).inc(count)

    def forget(self, namespace: str, endpoint: str) -> None:
        """Drop a deleted endpoint's series."""
        ref = endpoint_label(namespace, endpoint)
        series = [
            *((m, (ref,)) for m in self._per_endpoint()),
            *((self.queued_jobs, (ref, p)) for p in PRIORITIES),
            (self.scrape_errors, (ref,)),
            *((self.signal, (ref, s)) for s in ("queue_depth", "in_flight")),
            *((self.decisions, (ref, d)) for d in DIRECTIONS.values()),
        ]
        for metric, labels in series:
            with contextlib.suppress(KeyError):
                metric.remove(*labels)

    def _per_endpoint(self) -> tuple:
        return (
            self.desired, self.current, self.ready, self.held, self.running_jobs,
            self.outside_errors, self.cold_start, self.batch_requests, self.batches_at_risk,
        )  # fmt: skip
