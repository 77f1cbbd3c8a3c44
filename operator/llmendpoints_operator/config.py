"""Operator-wide settings, read from `LLMEP_OPERATOR_*` environment variables.

These are the cluster administrator's knobs (which runtime image endpoints get by default, how
GPUs are named on this cluster, how often drift is corrected). Everything a user sets per
endpoint lives in the LLMEndpoint spec instead (see spec.py).
"""

from __future__ import annotations

from typing import Any

from pydantic import Field
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
    field_manager: str = Field(
        "llmendpoints-operator",
        min_length=1,
        description="Field manager name the operator writes children with (server-side apply).",
    )
