"""Operator-wide settings, read from `LLMEP_OPERATOR_*` environment variables.

These are the cluster administrator's knobs (which runtime image endpoints get by default, how
GPUs are named on this cluster, how often drift is corrected). Everything a user sets per
endpoint lives in the LLMEndpoint spec instead (see spec.py).
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

from llmendpoints_common.gateway_token import read_secret
from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from llmendpoints_operator import __version__

DEFAULT_RUNTIME_IMAGE = f"ghcr.io/llmendpoints/runtime:{__version__}"


def _default_container_security_context() -> dict[str, Any]:
    return {
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
    }


def _default_pod_security_context() -> dict[str, Any]:
    # fsGroup makes a freshly provisioned model-cache volume writable by the runtime's user.
    return {
        "runAsNonRoot": True,
        "runAsUser": 1000,
        "runAsGroup": 1000,
        "fsGroup": 1000,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


class OperatorSettings(BaseSettings):
    """Settings of the operator process (environment prefix `LLMEP_OPERATOR_`)."""

    model_config = SettingsConfigDict(env_prefix="LLMEP_OPERATOR_", extra="ignore", frozen=True)

    runtime_image: str = Field(
        DEFAULT_RUNTIME_IMAGE,
        min_length=1,
        description="Runtime image for endpoints that do not set spec.engine.image.",
    )
    gpu_resource_name: str = Field(
        "nvidia.com/gpu",
        min_length=1,
        description="Extended resource that counts GPUs on this cluster, unless "
        "spec.resources.gpuResourceName overrides it (e.g. amd.com/gpu).",
    )
    resync_seconds: float = Field(
        300.0,
        gt=0,
        description="Every endpoint is reconciled again this often, correcting drift in its children.",
    )
    runtime_security_context: dict[str, Any] = Field(
        default_factory=_default_container_security_context,
        description="SecurityContext (JSON object) of every runtime container.",
    )
    runtime_pod_security_context: dict[str, Any] = Field(
        default_factory=_default_pod_security_context,
        description="PodSecurityContext (JSON object) of every runtime pod.",
    )
    metrics_port: int = Field(
        8080,
        ge=0,
        le=65535,
        description="Port of the operator's own Prometheus /metrics; 0 serves no metrics.",
    )
    cluster_domain: str = Field(
        "cluster.local",
        pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$",
        description="DNS domain of this cluster (the kubelet's clusterDomain): endpoints' "
        "status URLs are http://<service>.<namespace>.svc.<cluster domain>.",
    )
    field_manager: str = Field(
        "llmendpoints-operator",
        min_length=1,
        description="Field manager name the operator writes children with (server-side apply).",
    )
    jobs_queue_url: str | None = Field(
        None,
        description="NATS URL of the shared job queue. Runtime pods get it as JOBS_QUEUE_URL "
        "(with ENDPOINT_NAMESPACE and ENDPOINT_ID), so every replica and the gateway share one "
        "queue; the autoscaler reads each endpoint's queued jobs there. With "
        "LLMEP_OPERATOR_JOBS_QUEUE_KEYS_DIR: nats://host:4222, no password (each endpoint gets "
        "its own credential); without: nats://user:pass@host:4222, passed to the pods through "
        "a Secret per endpoint. Unset: each pod keeps its jobs in memory.",
    )
    jobs_queue_keys_dir: str | None = Field(
        None,
        description="Folder holding the queue account's keys (files `account` and "
        "`account-signing`; the chart mounts them): the operator mints with them a NATS "
        "credential per endpoint (Secret <endpoint>-queue-creds-v2, allowed only that endpoint's "
        "subjects, records and consumers) and its own. Unset: one password in the URL for "
        "everyone (weaker; docs/security.md).",
    )
    jobs_queue_replicas: int | None = Field(
        None,
        ge=1,
        le=5,
        description="Replicas of each JetStream stream the runtime pods create in the shared job "
        "queue (passed as LLMEP_JOBS_QUEUE_REPLICAS; the chart sets its NATS cluster's size). "
        "Unset: the runtime's default, 1.",
    )
    jobs_queue_files_max_bytes: int | None = Field(
        None,
        ge=1024 * 1024,
        description="Bound of the queue's object store of batch files and results "
        "(OBJ_LLMEP_FILES), set by the operator on the stream (the chart sets it from "
        "queue.nats.batchFilesMaxBytes); uploads and results beyond it get 507. Unset: 1 GiB.",
    )
    jobs_queue_endpoint_max_bytes: int = Field(
        128 * 1024 * 1024,
        ge=1024 * 1024,
        description="Bytes each endpoint's own queue may hold: its job records and results, "
        "stream chunks, idempotency keys and admissions (the stream LLMEP_RECORDS_<ns>_<name>), "
        "reserved for it alone on every NATS server, so a full endpoint (or its pods filling "
        "it) stops no other. Beyond it that endpoint's new jobs get 503 naming this setting. "
        "The operator sets it on existing endpoints' streams too. Every endpoint reserves it "
        "(and 8 MiB for its jobs): size the NATS storage for your endpoints (docs/jobs.md).",
    )
    jobs_queue_usage_max_bytes: int | None = Field(
        None,
        ge=1024 * 1024,
        description="Bytes of usage records kept (the stream LLMEP_USAGE; the chart sets it "
        "from queue.nats.usageMaxBytes): beyond, the oldest records go, as they do after 400 "
        "days. Export them before (llmendpoints-gateway usage). Unset: 1 GiB.",
    )
    jobs_max_queued_per_owner: int = Field(
        1_000,
        ge=0,
        description="Jobs one API key (owner) may have queued or running per endpoint and "
        "priority in the shared job queue; over it /run and /runsync answer 429. Enforced by "
        "NATS JetStream itself (the jobs stream's per-subject limit, set by the operator), so "
        "across every gateway replica and pod. 0: no per-key cap (10,000 per key).",
    )
    gateway_url: str | None = Field(
        None,
        description="URL of the gateway in front of all endpoints (the chart sets it when it "
        "installs the gateway). When set, endpoints' status URLs point there; with "
        "LLMEP_OPERATOR_JOBS_QUEUE_URL set too, spec.scaling.minReplicas: 0 is allowed (the "
        "gateway holds requests while an endpoint has no replica, and the autoscaler reads them "
        "in the queue).",
    )
    gateway_token_secret_file: str | None = Field(
        None,
        description="File with the secret the gateway derives its per-endpoint tokens from (the "
        "chart mounts the same Secret into the gateway): the operator writes each endpoint's "
        "token into <endpoint>-gateway-token, mounted into its pods as GATEWAY_TOKEN_FILE, so "
        "the gateway reaches the pods without a client's key. Unset: no gateway token.",
    )
    inference_pool_default: bool = Field(
        False,
        description="Whether endpoints that do not set spec.api.inferencePool.enabled get an "
        "InferencePool (inference.networking.k8s.io/v1) selecting their pods, for Gateway API "
        "gateways with an endpoint picker (docs/gateway-api.md).",
    )

    fit_check: bool = Field(
        True,
        description="Check before rollout whether each endpoint's model fits the GPUs it asks "
        'for (status.fit, condition ModelFits; docs/operator.md, "Will it fit?"): a model '
        "that does not fit gets no pods. Reads config.json and safetensors headers from the "
        "hub, and the nodes' GPU labels.",
    )
    fit_timeout_seconds: float = Field(
        10.0,
        gt=0,
        description="How long a reconcile waits for the hub's answer about a model it has not "
        "read yet; then ModelFits is Unknown, the rollout goes on and the read finishes in the "
        "background for the next reconcile.",
    )
    fit_cache_seconds: float = Field(
        3600.0,
        gt=0,
        description="How long a model's config.json and headers are reused, per hub, model, "
        "revision and token Secret (a failed read is retried after a minute).",
    )
    fit_nodes_seconds: float = Field(
        60.0,
        gt=0,
        description="How long the list of nodes (their GPU labels) is reused by the fit check.",
    )
    fit_read_token_secrets: bool = Field(
        False,
        description="Whether the fit check reads the Secret of spec.model.hfTokenSecretRef to "
        "read private and gated models (the chart then grants `get` on Secrets). Unset, such "
        "models are Unknown and roll out unchecked.",
    )
    fit_allowed_hubs: str | None = Field(
        None,
        description="Other hubs (comma-separated base URLs) the fit check may read when an "
        "endpoint's spec.engine.env sets HF_ENDPOINT; an endpoint naming any other hub gets "
        "ModelFits Unknown (the operator contacts no address an endpoint author picks). Unset: "
        "only the operator's own hub.",
    )
    hf_endpoint: str | None = Field(
        None,
        description="The hub the fit check reads models from, unless an endpoint sets "
        "HF_ENDPOINT in spec.engine.env. Unset: the operator's HF_ENDPOINT, else "
        "https://huggingface.co.",
    )

    # -- cluster-admin policy (policy.py; docs/security.md). Lists are comma-separated; unset
    # means no restriction, an empty value allows nothing. Globs: `*` any run of characters,
    # `?` one character.
    allowed_images: str | None = Field(
        None,
        description="Images endpoints may run (spec.engine.image), comma-separated globs such as "
        "`registry.example.com/llm/*`. The operator's own runtime image is always allowed. "
        "Unset: any image.",
    )
    allowed_service_types: str | None = Field(
        None,
        description="Service types endpoints may ask for (spec.api.service.type), comma-separated "
        "from ClusterIP, NodePort, LoadBalancer. Unset: all three.",
    )
    allow_env_value_from: bool = Field(
        True,
        description="Whether spec.engine.env may read Secrets and ConfigMaps (valueFrom "
        "secretKeyRef / configMapKeyRef) beyond the ones the spec declares in its own fields.",
    )
    allow_trust_remote_code: bool = Field(
        True,
        description="Whether spec.model.trustRemoteCode may be true (runs the model repository's "
        "Python code in the pod).",
    )
    allowed_priority_classes: str | None = Field(
        None,
        description="PriorityClasses endpoints may use (spec.resources.priorityClassName), "
        "comma-separated globs. Unset: any.",
    )
    allowed_ingress_annotations: str | None = Field(
        None,
        description="Annotation keys an endpoint's Ingress may carry (spec.api.ingress.annotations), "
        "comma-separated globs such as `nginx.ingress.kubernetes.io/proxy-*`. Unset: any.",
    )
    allowed_existing_claims: str | None = Field(
        None,
        description="PersistentVolumeClaims endpoints may mount (spec.cache.existingClaim), "
        "comma-separated globs. Unset: any claim of the endpoint's namespace.",
    )

    @field_validator("allowed_service_types")
    @classmethod
    def _known_service_types(cls, value: str | None) -> str | None:
        unknown = sorted(set(split_list(value) or ()) - set(SERVICE_TYPES))
        if unknown:
            raise ValueError(
                f"unknown Service types {unknown}; choose from {', '.join(SERVICE_TYPES)}"
            )
        return value

    @model_validator(mode="after")
    def _no_password_with_keys(self) -> OperatorSettings:
        url = self.jobs_queue_url
        if self.jobs_queue_keys_dir and url and urlsplit(url).password is not None:
            raise ValueError(
                "LLMEP_OPERATOR_JOBS_QUEUE_URL carries a password while "
                "LLMEP_OPERATOR_JOBS_QUEUE_KEYS_DIR is set: with per-endpoint credentials "
                "the URL must not hold one (it would reach every pod)"
            )
        return self

    @field_validator("gateway_token_secret_file")
    @classmethod
    def _token_secret_readable(cls, value: str | None) -> str | None:
        if value is not None:
            try:
                read_secret(value)
            except OSError as exc:
                raise ValueError(f"cannot read {value!r}: {exc.strerror}") from None
        return value

    @property
    def scales_to_zero(self) -> bool:
        """Whether endpoints may have minReplicas 0: a gateway holds their requests while no
        replica runs, and the autoscaler reads those held requests (and queued jobs) in the
        shared queue, so it can bring the first replica back."""
        return self.gateway_url is not None and self.jobs_queue_url is not None


SERVICE_TYPES = ("ClusterIP", "NodePort", "LoadBalancer")


def split_list(value: str | None) -> tuple[str, ...] | None:
    """A comma-separated setting: None stays None (no restriction), "" is the empty list."""
    if value is None:
        return None
    return tuple(item.strip() for item in value.split(",") if item.strip())
