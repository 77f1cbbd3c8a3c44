"""The gateway's settings, from the environment (pydantic-settings; aliases are the variable names).

What the gateway shares with the runtime (HOST, PORT, API_KEYS, API_KEYS_FILE, body limits, the
read deadline, MAX_HEADER_BYTES, LOG_FORMAT, LLMEP_LOG_LEVEL, DRAIN_TIMEOUT_SECONDS, the webhook
settings, JOBS_QUEUE_URL) is the edge's ``EdgeSettings``: one name, one default, one meaning in
both. The gateway's own settings start with GATEWAY_.
"""

from __future__ import annotations

import os
import socket

from llmendpoints_common.batch.limits import BatchEnv
from llmendpoints_edge.settings import EdgeSettings
from pydantic import Field

from llmendpoints_gateway.routing import DEFAULT_LOAD_FACTOR


class GatewaySettings(EdgeSettings, BatchEnv):
    # The one default the edge leaves to each component (the design fixes the gateway's 8080).
    port: int = Field(8080, ge=1, le=65535, validation_alias="PORT", description="HTTP port.")
    endpoints_file: str | None = Field(
        None,
        validation_alias="GATEWAY_ENDPOINTS_FILE",
        description="Static endpoints (YAML `endpoints: [{name, namespace, models, backends, "
        "routing}]`, and `apiKeys`); without it endpoints are discovered from Kubernetes.",
    )
    namespace: str | None = Field(
        None,
        validation_alias="GATEWAY_NAMESPACE",
        description="Kubernetes discovery: watch only this namespace (default: all namespaces).",
    )
    keys_namespace: str | None = Field(
        None,
        validation_alias="GATEWAY_KEYS_NAMESPACE",
        description="Kubernetes: the namespace whose Secrets labelled `llmendpoints.dev/api-key` "
        "are API keys with names, endpoints and limits (default: the gateway's own namespace).",
    )
    hold_timeout_seconds: float = Field(
        600.0,
        gt=0,
        validation_alias="GATEWAY_HOLD_TIMEOUT_SECONDS",
        description="How long a request waits for an endpoint with no ready replica (outlasts "
        "a cold start: pod scheduling, image pull, weight load) before a 503.",
    )
    hold_keepalive_seconds: float = Field(
        10.0,
        ge=0,
        le=14,
        validation_alias="GATEWAY_HOLD_KEEPALIVE_SECONDS",
        description="A held streamed request gets its response head after 1 s, then an SSE "
        "comment (`: waiting for a replica`) this often until the answer starts, so proxies "
        "with idle timeouts keep it (at most 14: a byte at least every 15 s); 0: no comments, "
        "the head comes with the replica's answer.",
    )
    hold_queue_length: int = Field(
        1000,
        ge=0,
        validation_alias="GATEWAY_HOLD_QUEUE_LENGTH",
        description="Most requests held per endpoint; more are answered 503 at once.",
    )
    hold_max_bytes: int = Field(
        256 * 1024 * 1024,
        ge=0,
        validation_alias="GATEWAY_HOLD_MAX_BYTES",
        description="Bytes of request bodies this replica holds at most, over all endpoints "
        "(each held request keeps its body); beyond, 503 at once.",
    )
    hold_key_share: float = Field(
        0.25,
        gt=0,
        le=1,
        validation_alias="GATEWAY_HOLD_KEY_SHARE",
        description="The share of an endpoint's hold queue one key may take (at least one "
        "request): no tenant fills the queue for the others.",
    )
    require_keys: bool = Field(
        True,
        validation_alias="GATEWAY_REQUIRE_KEYS",
        description="Every request to an endpoint needs a valid key, whatever keys exist or "
        "not (no key configured: every request is refused); false: endpoints with no key "
        "anywhere are open.",
    )
    endpoint_keys: bool = Field(
        False,
        validation_alias="GATEWAY_ENDPOINT_KEYS",
        description="Kubernetes: also accept each endpoint's own keys (spec.api.apiKeysSecretRef), "
        "read from the endpoint's namespace (needs `get` on Secrets there). Off: the gateway's "
        "keys are its tenant keys alone (GATEWAY_KEYS_NAMESPACE).",
    )
    token_secret_file: str | None = Field(
        None,
        validation_alias="GATEWAY_TOKEN_SECRET_FILE",
        description="File with the secret each endpoint's gateway token is derived from (the "
        "operator derives the same tokens for the pods): the gateway presents it to a pod "
        "instead of the client's key. Without it the gateway sends pods no credential.",
    )
    metrics_port: int = Field(
        9090,
        ge=0,
        le=65535,
        validation_alias="GATEWAY_METRICS_PORT",
        description="Port of /metrics, apart from the client port (0: no metrics endpoint).",
    )
    metrics_host: str | None = Field(
        None,
        validation_alias="GATEWAY_METRICS_HOST",
        description="Address /metrics listens on (the chart sets the pod's IP: what Prometheus "
        "scrapes, not every interface); unset: HOST's.",
    )
    default_token_reservation: int = Field(
        1024,
        ge=1,
        validation_alias="GATEWAY_DEFAULT_MAX_TOKENS",
        description="A key with tokensPerMinute: the max_tokens reserved for a request that "
        "sets none (settled against what the engine reports when it ends).",
    )
    load_factor: float = Field(
        DEFAULT_LOAD_FACTOR,
        gt=1.0,
        validation_alias="GATEWAY_LOAD_FACTOR",
        description="Prefix-aware routing: a replica takes requests (even those whose prefix it "
        "holds) only while it carries less than this many times the mean in-flight load; "
        "beyond, they spill to the next best replica.",
    )
    workers: int = Field(
        1,
        ge=0,
        le=64,
        validation_alias="GATEWAY_WORKERS",
        description="Processes serving the port (SO_REUSEPORT), each using up to one core; they "
        "share limits, usage and signals through JOBS_QUEUE_URL and split the hold bounds. 1: a "
        "single process; 0: one per CPU of the pod (its CPU limit, else the CPUs it may run "
        "on), 1 without JOBS_QUEUE_URL.",
    )
    engine_load_interval_seconds: float = Field(
        1.0,
        ge=0,
        validation_alias="GATEWAY_ENGINE_LOAD_INTERVAL_SECONDS",
        description="Prefix-aware routing: how often each ready replica's engine load "
        "(running and waiting requests, KV-cache usage, adapters, prefix-cache counters) is "
        "read from its pod's control port (once per gateway pod, whatever GATEWAY_WORKERS), "
        "while its endpoint has requests in flight or held and for twice "
        "GATEWAY_IDLE_PROBE_INTERVAL_SECONDS after; never while it is idle (0: never; the "
        "scorer then weighs the gateway's own in-flight requests).",
    )
    share_prefix_index: bool = Field(
        True,
        validation_alias="GATEWAY_SHARE_PREFIX_INDEX",
        description="Prefix-aware routing with JOBS_QUEUE_URL: every gateway process (workers, "
        "replicas) tells the others which prompt blocks it sent to which replica, so each "
        "knows what all sent (batched every 20 ms on core NATS, 8 bytes per 256 characters).",
    )
    probe_interval_seconds: float = Field(
        0.5,
        gt=0,
        validation_alias="GATEWAY_PROBE_INTERVAL_SECONDS",
        description="Static endpoints: how often a backend that is not ready is probed "
        "(/ready?strict=1, on its control port once it named one) while its endpoint has "
        "requests waiting or in flight.",
    )
    idle_probe_interval_seconds: float = Field(
        5.0,
        gt=0,
        validation_alias="GATEWAY_IDLE_PROBE_INTERVAL_SECONDS",
        description="Static endpoints: how often every other backend's readiness is probed "
        "(the period of the readiness probe the operator gives runtime pods).",
    )
    upstream_connect_timeout_seconds: float = Field(
        5.0,
        gt=0,
        validation_alias="GATEWAY_CONNECT_TIMEOUT_SECONDS",
        description="Connecting to a replica; a replica that does not accept in time is "
        "retried once on another.",
    )
    gateway_id: str = Field(
        default_factory=lambda: os.environ.get("HOSTNAME") or socket.gethostname(),
        validation_alias="GATEWAY_ID",
        description="This replica's name in the signals it publishes (default: the pod name).",
    )
    metrics_key_labels: bool = Field(
        False,
        validation_alias="GATEWAY_METRICS_KEY_LABELS",
        description="Also count requests and tokens per API key name on /metrics "
        "(llmendpoints_gateway_key_requests_total, ..._key_tokens_total): a series per key, "
        "endpoint and status code. Off by default; the usage export carries per-key detail.",
    )
