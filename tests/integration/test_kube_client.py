"""kube.KubeClient, the operator's only API client, against the in-memory API server."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
from llmendpoints_operator import kube

from .kube_emulator import Cluster

pytestmark = [pytest.mark.kube, pytest.mark.asyncio(loop_scope="module")]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def client() -> AsyncIterator[tuple[Cluster, kube.KubeClient]]:
    async with Cluster() as cluster:
        connection = kube.Connection(server=cluster.url, headers={}, ssl=None)
        client = kube.KubeClient(connection, field_manager="test")
        yield cluster, client
        await client.close()


def _configmap(data: dict[str, str]) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "cm", "namespace": "ns"},
        "data": data,
    }


async def test_apply_creates_then_updates(client: tuple[Cluster, kube.KubeClient]) -> None:
    cluster, api = client
    created = await api.apply(_configmap({"a": "1"}))
    assert created["data"] == {"a": "1"}
    updated = await api.apply(_configmap({"a": "2"}))
    assert updated["data"] == {"a": "2"}
    assert cluster.get("v1/configmaps", "ns", "cm")["data"] == {"a": "2"}


async def test_missing_objects(client: tuple[Cluster, kube.KubeClient]) -> None:
    _, api = client
    assert await api.delete("v1", "ConfigMap", "ns", "absent") is False
    with pytest.raises(kube.NotFound):
        await api.patch("v1", "ConfigMap", "ns", "absent", {"data": {}})


async def test_create_twice_is_a_conflict(client: tuple[Cluster, kube.KubeClient]) -> None:
    cluster, api = client
    body = {**_configmap({}), "metadata": {"name": "once", "namespace": "ns"}}
    await api.create(body)
    with pytest.raises(kube.Conflict):
        await api.create(body)
    assert await api.delete("v1", "ConfigMap", "ns", "once") is True
    assert cluster.get("v1/configmaps", "ns", "once") is None


def _deployment(replicas: int | None) -> dict:
    spec = {"selector": {"matchLabels": {"app": "d"}}, "template": {"metadata": {}}}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "d", "namespace": "ns"},
        "spec": spec if replicas is None else {"replicas": replicas, **spec},
    }


async def test_replicas_written_by_an_apply_are_reset_by_the_next_apply_without_them(
    client: tuple[Cluster, kube.KubeClient],
) -> None:
    """Why the reconcile never applies replicas (docs/operator.md, "Who owns the Deployment's
    replicas"): the emulator keeps the API server's ownership rule for this field."""
    cluster, api = client
    await api.apply(_deployment(replicas=3))
    assert cluster.replicas_owners("ns", "d") == {("test", "Apply")}
    await api.apply(_deployment(replicas=None))
    assert cluster.get("apps/v1/deployments", "ns", "d")["spec"]["replicas"] == 1
    assert cluster.replicas_owners("ns", "d") == set()

    # Written by an Update (a merge patch, or the create), they survive applies without them.
    await api.patch("apps/v1", "Deployment", "ns", "d", {"spec": {"replicas": 3}})
    assert cluster.replicas_owners("ns", "d") == {("test", "Update")}
    await api.apply(_deployment(replicas=None))
    assert cluster.get("apps/v1/deployments", "ns", "d")["spec"]["replicas"] == 3
    await api.delete("apps/v1", "Deployment", "ns", "d")
