"""The gateway's Prometheus metrics, per endpoint (prefix ``llmendpoints_gateway_``)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "llmendpoints_gateway_requests",
            "Requests answered, by API key name (empty: no key), endpoint and HTTP status code "
            "(499: the client went away; 429: over the key's limits).",
            ["key", "endpoint", "code"],
            registry=r,
        )
        self.tokens = Counter(
            "llmendpoints_gateway_tokens",
            "Tokens the engine reported for answered requests and jobs, by API key name, "
            "endpoint and kind (prompt, completion).",
            ["key", "endpoint", "kind"],
            registry=r,
        )
        self.held = Gauge(
            "llmendpoints_gateway_held_requests",
            "Requests waiting for a ready replica of the endpoint (scale-from-zero signal).",
            ["endpoint"],
            registry=r,
        )
        self.hold_rejected = Counter(
            "llmendpoints_gateway_hold_rejected",
            "Held requests answered 503: the hold queue was full, the hold timed out, or the "
            "gateway was shutting down.",
            ["endpoint", "reason"],
            registry=r,
        )
        self.in_flight = Gauge(
            "llmendpoints_gateway_in_flight_requests",
            "Requests this gateway has outstanding at each replica.",
            ["endpoint", "replica"],
            registry=r,
        )
        self.ready_replicas = Gauge(
            "llmendpoints_gateway_ready_replicas",
            "Replicas of the endpoint the gateway routes to.",
            ["endpoint"],
            registry=r,
        )
        self.routing = Counter(
            "llmendpoints_gateway_routing_decisions",
            "How replicas were chosen: affinity (the prefix's own replica), spilled (over its "
            "load bound), least_loaded, round_robin, retry (after a failure before any byte).",
            ["endpoint", "outcome"],
            registry=r,
        )
        self.ttft = Histogram(
            "llmendpoints_gateway_upstream_ttft_seconds",
            "From sending a request upstream to its first response byte.",
            ["endpoint"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.duration = Histogram(
            "llmendpoints_gateway_upstream_duration_seconds",
            "From sending a request upstream to its last response byte.",
            ["endpoint"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
