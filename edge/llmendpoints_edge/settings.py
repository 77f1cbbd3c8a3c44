"""``EdgeSettings``: every environment variable the runtime and the gateway share, one name and
one default each. ``RuntimeSettings`` and ``GatewaySettings`` extend it; the generated settings
tables of both show these rows the same way.

The one deliberate difference is ``PORT``'s default (the runtime listens on 8000, the gateway on
8080, as the design fixes); the subclasses redeclare that field and nothing else of this class.
"""

from __future__ import annotations

from typing import Literal

from llmendpoints_common.destinations import DestinationPolicy
from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from llmendpoints_edge.keys import parse_key_list

# The request line and headers of one request (nginx's default large buffers hold 32 KiB).
DEFAULT_MAX_HEADER_BYTES = 64 * 1024


class EdgeSettings(BaseSettings):
    """Field aliases are the environment variable names."""

    model_config = SettingsConfigDict(populate_by_name=False, extra="ignore", frozen=True)

    host: str = Field("0.0.0.0", validation_alias="HOST", description="Interface to listen on.")
    port: int = Field(8000, ge=1, le=65535, validation_alias="PORT", description="HTTP port.")
    api_keys: SecretStr | None = Field(
        None,
        validation_alias="API_KEYS",
        description="Comma-separated API keys. Clients send `Authorization: Bearer <key>` or "
        "`x-api-key: <key>`; a key with no name is known by a short hash of it.",
    )
    api_keys_file: str | None = Field(
        None,
        validation_alias="API_KEYS_FILE",
        description="File of API keys (a mounted Secret), re-read when it changes: one key per "
        "line, `#` comments (the gateway also reads YAML `keys: [{name, key, endpoints, "
        "admin}]`).",
    )
    max_request_body_bytes: int = Field(
        10 * 1024 * 1024,
        ge=1024,
        validation_alias="MAX_REQUEST_BODY_BYTES",
        description="Larger request bodies get 413 (every path but /runsync).",
    )
    max_runsync_body_bytes: int = Field(
        20 * 1024 * 1024,
        ge=1024,
        validation_alias="MAX_RUNSYNC_BODY_BYTES",
        description="Larger /runsync bodies get 413 (RunPod: 10 MB for /run, 20 MB for /runsync).",
    )
    request_read_timeout_seconds: float = Field(
        30.0,
        gt=0,
        validation_alias="REQUEST_READ_TIMEOUT_SECONDS",
        description="Request headers not complete this long after the request began, or a body "
        "not complete this long after its headers, get 408 and the connection is closed.",
    )
    max_header_bytes: int = Field(
        DEFAULT_MAX_HEADER_BYTES,
        ge=4096,
        le=1024 * 1024,
        validation_alias="MAX_HEADER_BYTES",
        description="Request line and headers larger than this get 431 and the connection is "
        "closed.",
    )
    keep_alive_timeout_seconds: float = Field(
        75.0,
        gt=0,
        validation_alias="KEEP_ALIVE_TIMEOUT_SECONDS",
        description="How long an idle connection is kept open for its next request. Longer than "
        "the idle timeout of the proxies in front (nginx and cloud load balancers: 60 s), so "
        "that they, not this server, close idle connections: a request sent on a connection "
        "the server is closing fails as a 502.",
    )
    drain_timeout_seconds: float = Field(
        30.0,
        ge=0,
        validation_alias="DRAIN_TIMEOUT_SECONDS",
        description="After SIGTERM, how long in-flight requests, streams and jobs may take to "
        "finish.",
    )
    log_format: Literal["text", "json"] = Field(
        "text", validation_alias="LOG_FORMAT", description="`text` or `json` (one object per line)."
    )
    log_level: Literal["debug", "info", "warning", "error"] = Field(
        "info", validation_alias="LLMEP_LOG_LEVEL", description="Level of our own log lines."
    )
    jobs_queue_url: SecretStr | None = Field(
        None,
        validation_alias="JOBS_QUEUE_URL",
        description="NATS URL of the shared job queue (`nats://host:4222` with "
        "JOBS_QUEUE_CREDS_FILE; `nats://user:pass@host:4222` on a NATS you bring); unset: no "
        "shared queue (a runtime keeps its jobs in the pod).",
    )
    jobs_queue_creds_file: str | None = Field(
        None,
        validation_alias="JOBS_QUEUE_CREDS_FILE",
        description="NATS creds file (user JWT and nkey seed) for JOBS_QUEUE_URL: this "
        "component's own credential (a runtime pod's reaches only its endpoint's subjects, "
        "records and consumers; the operator and the chart mint them).",
    )
    webhook_destinations: str = Field(
        "",
        validation_alias="LLMEP_WEBHOOK_DESTINATIONS",
        description="Comma-separated hosts (exact or *.suffix) and CIDRs job webhooks may reach; "
        "empty: any but link-local/metadata/multicast (see docs/jobs.md).",
    )
    webhook_timeout_seconds: float = Field(
        10.0,
        gt=0,
        validation_alias="WEBHOOK_TIMEOUT_SECONDS",
        description="One webhook attempt's deadline, from connecting to the answer's status "
        "line (nothing after it is read); then the attempt has failed.",
    )
    webhook_max_concurrency: int = Field(
        64,
        ge=1,
        validation_alias="WEBHOOK_MAX_CONCURRENCY",
        description="Webhook attempts under way at once; more wait for a slot (never dropped).",
    )

    @field_validator("log_format", "log_level", mode="before")
    @classmethod
    def _lower(cls, value: object) -> object:
        return value.lower() if isinstance(value, str) else value

    @field_validator("webhook_destinations")
    @classmethod
    def _destinations_parse(cls, value: str) -> str:
        DestinationPolicy.parse(value)  # ValueError names the entry that is wrong
        return value

    @property
    def webhook_policy(self) -> DestinationPolicy:
        return DestinationPolicy.parse(self.webhook_destinations)

    @property
    def queue_url(self) -> str | None:
        return self.jobs_queue_url.get_secret_value() if self.jobs_queue_url else None

    def static_api_keys(self) -> tuple[str, ...]:
        """The keys of API_KEYS."""
        return parse_key_list(self.api_keys.get_secret_value() if self.api_keys else "")


def settings_variables(settings: type[BaseSettings]) -> dict[str, str]:
    """Environment variable name -> description, for every field of ``settings``."""
    return {
        str(info.validation_alias): info.description or ""
        for info in settings.model_fields.values()
    }
