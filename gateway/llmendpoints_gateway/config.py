"""The gateway's settings, from the environment (pydantic-settings; aliases are the variable names).

Names shared with the runtime keep the runtime's spelling (HOST, PORT, API_KEYS, API_KEYS_FILE,
JOBS_QUEUE_URL, LOG_FORMAT, DRAIN_TIMEOUT_SECONDS, LLMEP_WEBHOOK_DESTINATIONS, WEBHOOK_TIMEOUT_SECONDS,
WEBHOOK_MAX_CONCURRENCY); the gateway's own ones start with GATEWAY_.
"""

from __future__ import annotations

import os
import socket
from typing import Literal

from llmendpoints_common.destinations import DestinationPolicy
from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from llmendpoints_gateway.routing import DEFAULT_LOAD_FACTOR


class GatewaySettings(BaseSettings):
    model_config = SettingsConfigDict(populate_by_name=False, extra="ignore", frozen=True)

    host: str = Field("0.0.0.0", validation_alias="HOST", description="Interface to listen on.")
    port: int = Field(8080, ge=1, le=65535, validation_alias="PORT", description="HTTP port.")
    api_keys: SecretStr | None = Field(
        None,
        validation_alias="API_KEYS",
        description="Comma-separated API keys allowed on every endpoint (named by a short hash).",
    )
    api_keys_file: str | None = Field(
        None,
        validation_alias="API_KEYS_FILE",
        description="File of API keys, re-read when it changes: one key per line (as the "
        "runtime's), or YAML `keys: [{name, key, endpoints, admin}]`.",
    )
    endpoints_file: str | None = Field(
        None,
        validation_alias="GATEWAY_ENDPOINTS_FILE",
        description="Static endpoints (YAML `endpoints: [{name, models, backends, routing}]`); "
        "without it endpoints are discovered from Kubernetes.",
    )
    jobs_queue_url: SecretStr | None = Field(
        None,
        validation_alias="JOBS_QUEUE_URL",
        description="NATS URL of the shared job queue; held-request counts and scale-from-zero "
        "nudges are published there.",
    )
    webhook_destinations: str = Field(
        "",
        validation_alias="LLMEP_WEBHOOK_DESTINATIONS",
        description="Comma-separated hosts (exact or *.suffix) and CIDRs the webhooks of jobs "
        "cancelled or purged here may reach; empty: any but link-local/metadata/multicast "
        "(as the runtime's; see docs/jobs.md).",
    )
    webhook_timeout_seconds: float = Field(
        10.0,
        gt=0,
        validation_alias="WEBHOOK_TIMEOUT_SECONDS",
        description="One webhook attempt's deadline, from connecting to the answer's status "
        "line (nothing after it is read), as the runtime's.",
    )
    webhook_max_concurrency: int = Field(
        64,
        ge=1,
        validation_alias="WEBHOOK_MAX_CONCURRENCY",
        description="Webhook attempts under way at once; more wait for a slot (never dropped).",
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
    max_request_body_bytes: int = Field(
        16 * 1024 * 1024,
        ge=1024,
        validation_alias="MAX_REQUEST_BODY_BYTES",
        description="Largest request body accepted (413 beyond), /runsync excepted.",
    )
    max_runsync_body_bytes: int = Field(
        20 * 1024 * 1024,
        ge=1024,
        validation_alias="MAX_RUNSYNC_BODY_BYTES",
        description="Largest /v2/{endpoint}/runsync body accepted (413 beyond; RunPod's limit).",
    )
    max_header_bytes: int = Field(
        32 * 1024,
        ge=1024,
        validation_alias="GATEWAY_MAX_HEADER_BYTES",
        description="Largest total size of request headers accepted (431 beyond).",
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
    drain_timeout_seconds: float = Field(
        30.0,
        ge=0,
        validation_alias="DRAIN_TIMEOUT_SECONDS",
        description="On SIGTERM: held requests get 503 at once, in-flight ones this long to finish.",
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
    log_format: Literal["text", "json"] = Field(
        "json", validation_alias="LOG_FORMAT", description="`json` lines or `text`."
    )
    log_level: Literal["debug", "info", "warning", "error"] = Field(
        "info", validation_alias="LOG_LEVEL", description="Log level."
    )

    @field_validator("webhook_destinations")
    @classmethod
    def _destinations_parse(cls, value: str) -> str:
        DestinationPolicy.parse(value)  # ValueError names the entry that is wrong
        return value

    @property
    def webhook_policy(self) -> DestinationPolicy:
        return DestinationPolicy.parse(self.webhook_destinations)
