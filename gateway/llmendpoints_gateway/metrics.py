"""The gateway's Prometheus metrics (prefix ``llmendpoints_gateway_``).

Label names are the project's across components (docs/gateway.md, "Metrics"): ``endpoint`` is the
endpoint's id (``<namespace>/<name>`` for discovered endpoints, the file's name for static ones),
``code`` the HTTP status, ``replica`` the pod's name (a static backend's ``host:port``), ``key``
an API key's name.

Cardinality is bounded by what an operator controls (endpoints, replicas), never by what clients
send: per-key series exist only with GATEWAY_METRICS_KEY_LABELS (1,000 keys x endpoints x codes is
how a Prometheus falls over; the usage stream and ``llmendpoints-gateway usage`` carry per-key
detail without that cost), and a replica's series are removed when it leaves (``forget_replica``).
``_created`` series are off: they double the series count and nothing reads them.
"""

from __future__ import annotations

import contextlib
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Upstream latency: 5 ms to an hour. A stream of a long generation (or a /runsync that waits
# for one) lasts minutes; the longest a request can take through the gateway is a hold (up to
# GATEWAY_HOLD_TIMEOUT_SECONDS, tied to a cold start) followed by its stream.
LATENCY_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1200, 1800,
    3600,
)  # fmt: skip
# Hold time: from under a second (a replica turning ready) to a cold start of a large model
# (scheduling, image pull, download, load: up to the endpoint's startupTimeoutSeconds, 1 h).
HOLD_BUCKETS = (0.1, 0.5, 1, 2.5, 5, 10, 20, 30, 45, 60, 90, 120, 180, 300, 600, 900, 1800, 3600)
HOLD_OUTCOMES = ("released", "timeout", "shutdown", "client_gone")


class GatewayMetrics:
    """Definitions and the few operations the request path and the registry need.

    ``key_labels``: also count requests and tokens per API key name (GATEWAY_METRICS_KEY_LABELS),
    in the separate families ``llmendpoints_gateway_key_requests_total`` and
    ``..._key_tokens_total``, so that dashboards built on the per-endpoint families read the
    same with the option on or off.
    """

    def __init__(self, *, key_labels: bool = False) -> None:
        disable_created_metrics()  # process-wide; see the module docstring
        self.key_labels = key_labels
        # The request path's series, by (family, label values): prometheus_client's labels()
        # validates and converts its arguments on every call (~1 µs each, 8 a request).
        self._series: dict[tuple[Any, tuple[Any, ...]], Any] = {}
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "llmendpoints_gateway_requests",
            "Requests answered, by endpoint and HTTP status code (499: the client went away; "
            "429: over the key's limits; endpoint empty: refused before one was chosen).",
            ["endpoint", "code"],
            registry=r,
        )
        self.tokens = Counter(
            "llmendpoints_gateway_tokens",
            "Tokens the engine reported for answered requests and jobs, by endpoint and kind "
            "(prompt, completion).",
            ["endpoint", "kind"],
            registry=r,
        )
        self.key_requests = (
            Counter(
                "llmendpoints_gateway_key_requests",
                "Requests answered, by API key name (empty: no key), endpoint and HTTP status "
                "code. Only with GATEWAY_METRICS_KEY_LABELS.",
                ["key", "endpoint", "code"],
                registry=r,
            )
            if key_labels
            else None
        )
        self.key_tokens = (
            Counter(
                "llmendpoints_gateway_key_tokens",
                "Tokens by API key name, endpoint and kind (prompt, completion). Only with "
                "GATEWAY_METRICS_KEY_LABELS.",
                ["key", "endpoint", "kind"],
                registry=r,
            )
            if key_labels
            else None
        )
        self.held = Gauge(
            "llmendpoints_gateway_held_requests",
            "Requests waiting for a ready replica of the endpoint (scale-from-zero signal).",
            ["endpoint"],
            registry=r,
        )
        self.jobs_unbilled = Counter(
            "llmendpoints_gateway_jobs_unbilled",
            "Finished job records the usage meter billed to nobody: their admission disagrees "
            "(another owner, another endpoint, no admission, a run not admitted, more tokens "
            "than admitted) -- a pod's forgery, or a bug; the gateway's log says which.",
            ["endpoint"],
            registry=r,
        )
        self.hold_rejected = Counter(
            "llmendpoints_gateway_hold_rejected",
            "Held requests answered 503, by reason: queue_full, timeout, shutdown.",
            ["endpoint", "reason"],
            registry=r,
        )
        self.hold_seconds = Histogram(
            "llmendpoints_gateway_hold_duration_seconds",
            "How long requests were held for a ready replica, by outcome: released (routed), "
            "timeout, shutdown, client_gone (queue_full requests are never held).",
            ["endpoint", "outcome"],
            buckets=HOLD_BUCKETS,
            registry=r,
        )
        self.in_flight = Gauge(
            "llmendpoints_gateway_in_flight_requests",
            "Requests this gateway has outstanding at each replica (pod name); a replica's "
            "series goes when the replica does.",
            ["endpoint", "replica"],
            registry=r,
        )
        self.ready_replicas = Gauge(
            "llmendpoints_gateway_ready_replicas",
            "Replicas of the endpoint the gateway routes to (0 for an endpoint at zero: the "
            "series stays while the endpoint exists).",
            ["endpoint"],
            registry=r,
        )
        self.routing = Counter(
            "llmendpoints_gateway_routing_decisions",
            "How replicas were chosen: affinity (where the longest cached prefix is, or a new "
            "prefix's home), spilled (that replica was at its load bound), load (the replica "
            "that starts it soonest), adapter (its LoRA adapter active there), least_loaded, "
            "round_robin, retry (after a failure before any byte).",
            ["endpoint", "outcome"],
            registry=r,
        )
        self.prefix_index_queries = Counter(
            "llmendpoints_gateway_prefix_index_queries",
            "Prompt blocks (256 characters) of prefix-aware requests routed.",
            ["endpoint"],
            registry=r,
        )
        self.prefix_index_hits = Counter(
            "llmendpoints_gateway_prefix_index_hits",
            "Of those, blocks the gateway's prefix index had sent to the chosen replica before "
            "(hits / queries: the hit rate the gateway expects).",
            ["endpoint"],
            registry=r,
        )
        self.shared_records = Counter(
            "llmendpoints_gateway_prefix_index_shared_records",
            "Routing records (a request's prompt blocks and the replica they went to) this "
            "process sent to the other gateway processes, and received from them.",
            ["direction"],
            registry=r,
        )
        self.engine_prefix_queries = Counter(
            "llmendpoints_gateway_engine_prefix_cache_queries",
            "Prompt tokens the endpoint's engines looked up in their prefix caches "
            "(vllm:prefix_cache_queries, read from the replicas about once a second).",
            ["endpoint"],
            registry=r,
        )
        self.engine_prefix_hits = Counter(
            "llmendpoints_gateway_engine_prefix_cache_hits",
            "Of those, tokens found cached (vllm:prefix_cache_hits): hits / queries is the "
            "hit rate the engines report.",
            ["endpoint"],
            registry=r,
        )
        self.ttft = Histogram(
            "llmendpoints_gateway_upstream_ttft_seconds",
            "From sending a request upstream to its first response byte.",
            ["endpoint"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.duration = Histogram(
            "llmendpoints_gateway_upstream_duration_seconds",
            "From sending a request upstream to its last response byte.",
            ["endpoint"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )

    # -- the request path --

    def series(self, family: Any, *values: Any) -> Any:
        """``family.labels(*values)``, looked up once (families whose series are removed drop
        them here too: ``forget_replica``)."""
        found = self._series.get((family, values))
        if found is None:
            found = self._series[(family, values)] = family.labels(*values)
        return found

    def answered(self, endpoint: str, code: int | str, key: str | None = None) -> None:
        self.series(self.requests, endpoint, code).inc()
        if self.key_requests is not None:
            self.series(self.key_requests, key or "", endpoint, code).inc()

    def tokens_used(self, endpoint: str, kind: str, count: int, key: str | None = None) -> None:
        if count <= 0:
            return
        self.series(self.tokens, endpoint, kind).inc(count)
        if self.key_tokens is not None:
            self.series(self.key_tokens, key or "", endpoint, kind).inc(count)

    def routed(self, endpoint: str, outcome: Any) -> None:
        self.series(self.routing, endpoint, outcome).inc()

    def upstream_times(self, endpoint: str, first_byte_s: float | None, total_s: float) -> None:
        if first_byte_s is not None:
            self.series(self.ttft, endpoint).observe(first_byte_s)
        self.series(self.duration, endpoint).observe(total_s)

    def held_for(self, endpoint: str, seconds: float, outcome: str) -> None:
        self.hold_seconds.labels(endpoint, outcome).observe(seconds)

    def prefix_index(self, endpoint: str, hits: int, queries: int) -> None:
        self.prefix_index_queries.labels(endpoint).inc(queries)
        self.prefix_index_hits.labels(endpoint).inc(hits)  # 0 too: the series exists

    def engine_prefix_cache(self, endpoint: str, hits: float, queries: float) -> None:
        self.engine_prefix_queries.labels(endpoint).inc(queries)
        self.engine_prefix_hits.labels(endpoint).inc(max(hits, 0.0))

    # -- the registry --

    def set_in_flight(self, endpoint: str, replica: str, count: int) -> None:
        self.series(self.in_flight, endpoint, replica).set(count)

    def forget_replica(self, endpoint: str, replica: str) -> None:
        """A replica left (and has nothing outstanding): its series go with it."""
        self._series.pop((self.in_flight, (endpoint, replica)), None)
        with contextlib.suppress(KeyError):
            self.in_flight.remove(endpoint, replica)

    def forget_endpoint(self, endpoint: str, replicas: tuple[str, ...] = ()) -> None:
        """An endpoint was deleted: its gauges go. Counters and histograms keep their totals
        until the process ends (a deleted endpoint's history; bounded by endpoints created)."""
        for gauge in (self.held, self.ready_replicas):
            with contextlib.suppress(KeyError):
                gauge.remove(endpoint)
        for replica in replicas:
            self.forget_replica(endpoint, replica)

    def render(self) -> bytes:
        return generate_latest(self.registry)
