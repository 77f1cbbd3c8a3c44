"""The gateway's settings, from the environment (pydantic-settings; aliases are the variable names).

What the gateway shares with the runtime (HOST, PORT, API_KEYS, API_KEYS_FILE, body limits, the
read deadline, MAX_HEADER_BYTES, LOG_FORMAT, LLMEP_LOG_LEVEL, DRAIN_TIMEOUT_SECONDS, the webhook
settings, JOBS_QUEUE_URL) is the edge's ``EdgeSettings``: one name, one default, one meaning in
both. The gateway's own settings start with GATEWAY_.
"""

from __future__ import annotations

import os
import socket

from llmendpoints_edge.settings import EdgeSettings
from pydantic import Field

from llmendpoints_gateway.routing import DEFAULT_LOAD_FACTOR


class GatewaySettings(EdgeSettings):
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
    hold_queue_length: int = Field(
        1000,
        ge=0,
        validation_alias="GATEWAY_HOLD_QUEUE_LENGTH",
        description="Most requests held per endpoint; more are answered 503 at once.",
    )
    load_factor: float = Field(
        DEFAULT_LOAD_FACTOR,
        gt=1.0,
        validation_alias="GATEWAY_LOAD_FACTOR",
        description="Prefix-aware routing: a replica takes a prefix's requests until it carries "
        "this many times the mean in-flight load, then they spill to the next replica.",
    )
    probe_interval_seconds: float = Field(
        0.5,
        gt=0,
        validation_alias="GATEWAY_PROBE_INTERVAL_SECONDS",
        description="Static endpoints: how often each backend's /ready?strict=1 is probed.",
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
