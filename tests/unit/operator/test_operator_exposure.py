"""No accidental exposure: an endpoint published outside the cluster needs API keys, or says in
so many words that it does without (spec.api.allowUnauthenticated)."""

from __future__ import annotations

from typing import Any

import pytest
from llmendpoints_operator.spec import InvalidSpecError, parse

KEYS = {"apiKeysSecretRef": {"name": "keys", "key": "api-keys"}}
PUBLISHED = {
    "LoadBalancer": {"service": {"type": "LoadBalancer"}},
    "NodePort": {"service": {"type": "NodePort"}},
    "Ingress": {"ingress": {"enabled": True, "host": "llm.example.com"}},
}


def _spec(api: dict[str, Any]) -> dict[str, Any]:
    return {"model": {"name": "org/m"}, "api": api}


@pytest.mark.parametrize("way", list(PUBLISHED))
def test_published_without_keys_is_refused_naming_api_keys_secret_ref(way: str) -> None:
    with pytest.raises(InvalidSpecError) as caught:
        parse("demo", "ns", _spec(PUBLISHED[way]))
    (problem,) = caught.value.problems
    assert problem.field == "spec.api.apiKeysSecretRef"
    assert "published outside the cluster" in problem.message
    assert way.lower() in problem.message.lower()
    assert "spec.api.allowUnauthenticated: true" in problem.message


@pytest.mark.parametrize("way", list(PUBLISHED))
def test_published_with_keys_is_accepted(way: str) -> None:
    ep = parse("demo", "ns", _spec({**PUBLISHED[way], **KEYS}))
    assert ep.spec.api.published_outside_cluster()


@pytest.mark.parametrize("way", list(PUBLISHED))
def test_published_without_keys_when_the_spec_says_so(way: str) -> None:
    ep = parse("demo", "ns", _spec({**PUBLISHED[way], "allowUnauthenticated": True}))
    assert ep.spec.api.allow_unauthenticated
    assert ep.spec.api.api_keys_secret_ref is None


def test_in_cluster_without_keys_is_accepted() -> None:
    ep = parse("demo", "ns", _spec({"service": {"type": "ClusterIP"}}))
    assert ep.spec.api.published_outside_cluster() == []
    assert not ep.spec.api.allow_unauthenticated  # the default


def test_every_way_out_is_named_at_once() -> None:
    with pytest.raises(InvalidSpecError) as caught:
        parse("demo", "ns", _spec({**PUBLISHED["NodePort"], **PUBLISHED["Ingress"]}))
    message = caught.value.problems[0].message
    assert "service.type NodePort" in message and "an Ingress" in message
