"""kube.py's pure parts: URL paths and API error mapping."""

from __future__ import annotations

import json

import pytest
from llmendpoints_operator import kube


def test_paths() -> None:
    assert (
        kube.object_path("apps/v1", "Deployment", "ns", "d")
        == "/apis/apps/v1/namespaces/ns/deployments/d"
    )
    assert kube.object_path("v1", "Service", "ns") == "/api/v1/namespaces/ns/services"
    assert (
        kube.object_path("llmendpoints.dev/v1alpha1", "LLMEndpoint", "ns", "e")
        == "/apis/llmendpoints.dev/v1alpha1/namespaces/ns/llmendpoints/e"
    )
    assert kube.object_path("v1", "Secret", "ns") == "/api/v1/namespaces/ns/secrets"  # create only
    with pytest.raises(ValueError, match="does not manage Role"):
        kube.object_path("rbac.authorization.k8s.io/v1", "Role", "ns")


def test_errors_keep_the_api_servers_words() -> None:
    body = json.dumps(
        {"kind": "Status", "reason": "Forbidden", "message": "cannot patch deployments"}
    )
    error = kube._error(403, body)
    assert (type(error), error.status, error.reason, error.message) == (
        kube.ApiError,
        403,
        "Forbidden",
        "cannot patch deployments",
    )
    assert isinstance(kube._error(404, "{}"), kube.NotFound)
    assert isinstance(kube._error(409, "not json"), kube.Conflict)
    assert kube._error(500, "not json").message == "not json"
