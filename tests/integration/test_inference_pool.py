"""The InferencePool child on the real operator and an emulated API server, in the order a user
meets it: asked for before the InferencePool CRD exists (the status says so, the endpoint serves
anyway), the CRD installed (the pool appears, owned by its endpoint, valid against the real v1
schema), not asked for (no pool), no longer asked for (removed).

One emulator and operator for the module; the tests run in file order and build on each other.
The resync stays at its default (300 s), so the pool appearing after the CRD's installation is
the operator reacting to the CRD itself, not a periodic retry.
"""

from __future__ import annotations

import pathlib
from collections.abc import AsyncIterator
from typing import Any

import jsonschema
import kmock
import pytest
import pytest_asyncio
import yaml

from .kube_emulator import CHILD_RESOURCES, LLMEP, VERBS, Cluster, Operator, endpoint, until

pytestmark = [pytest.mark.kube, pytest.mark.asyncio(loop_scope="module")]

NS = "models"
POOLS = "inference.networking.k8s.io/v1/inferencepools"
CRDS = "apiextensions.k8s.io/v1/customresourcedefinitions"
SCHEMA = pathlib.Path(__file__).parents[1] / "unit/operator/schemas/inferencepool-v1.6.0.yaml"
ASKS = {
    "model": {"name": "org/model"},
    "api": {
        "inferencePool": {
            "enabled": True,
            "endpointPickerRef": {"name": "chat-epp", "port": {"number": 9002}},
        }
    },
}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def cluster() -> AsyncIterator[Cluster]:
    """A cluster without the Gateway API Inference Extension's CRDs (yet)."""
    async with Cluster() as cluster:
        cluster.kmock.uninstalled.add(POOLS)
        yield cluster


async def install_inference_pool_crd(cluster: Cluster) -> None:
    """What `kubectl apply -f .../inference.networking.k8s.io_inferencepools.yaml` does."""
    cluster.kmock.uninstalled.discard(POOLS)
    cluster.kmock.resources[POOLS] = kmock.ResourceInfo(
        kind="InferencePool", namespaced=True, verbs=VERBS, subresources={"status"}
    )
    schema = yaml.safe_load(SCHEMA.read_text())
    crd = {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": "inferencepools.inference.networking.k8s.io"},
        "spec": {
            "group": "inference.networking.k8s.io",
            "names": {"kind": "InferencePool", "plural": "inferencepools"},
            "scope": "Namespaced",
            "versions": [
                {
                    "name": "v1",
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": schema},
                }
            ],
        },
    }
    await cluster.create(CRDS, "", crd)


def _status(cluster: Cluster, name: str) -> dict[str, Any]:
    return (cluster.get(LLMEP, NS, name) or {}).get("status") or {}


def _pool_condition(cluster: Cluster, name: str) -> dict[str, Any] | None:
    conditions = _status(cluster, name).get("conditions") or []
    return next((c for c in conditions if c["type"] == "InferencePool"), None)


async def test_without_the_crd_the_status_says_so_and_the_endpoint_is_served(
    cluster: Cluster, operator: Operator
) -> None:
    await cluster.create(LLMEP, NS, endpoint("chat", NS, ASKS))

    condition = await until(
        operator, lambda: _pool_condition(cluster, "chat"), "the InferencePool condition"
    )
    assert (condition["status"], condition["reason"]) == ("False", "CRDNotInstalled")
    assert "inference.networking.k8s.io/v1" in condition["message"]
    # Everything else is there and the operator keeps running (no crash loop, no retry storm).
    assert cluster.get(CHILD_RESOURCES["Deployment"], NS, "chat") is not None
    assert _status(cluster, "chat")["observedGeneration"] == 1
    assert operator.alive
    # Events are posted by a background task, after the status.
    warning = await until(
        operator,
        lambda: [
            e for e in cluster.events(NS, "chat") if e["reason"] == "InferencePoolCRDNotInstalled"
        ],
        "the Warning Event",
    )
    assert warning[0]["type"] == "Warning"


async def test_installing_the_crd_creates_the_pool_owned_by_its_endpoint(
    cluster: Cluster, operator: Operator
) -> None:
    await install_inference_pool_crd(cluster)

    pool = await until(operator, lambda: cluster.get(POOLS, NS, "chat"), "the InferencePool")
    owner = cluster.get(LLMEP, NS, "chat")
    [ref] = pool["metadata"]["ownerReferences"]
    assert (ref["kind"], ref["name"], ref["uid"]) == (
        "LLMEndpoint",
        "chat",
        owner["metadata"]["uid"],
    )
    assert ref["controller"] is True
    # Selects the pods of the endpoint's Deployment, on the port its runtime listens on.
    deployment = cluster.get(CHILD_RESOURCES["Deployment"], NS, "chat")
    assert pool["spec"]["selector"]["matchLabels"] == deployment["spec"]["selector"]["matchLabels"]
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    assert pool["spec"]["targetPorts"] == [{"number": container["ports"][0]["containerPort"]}]
    assert pool["spec"]["endpointPickerRef"]["name"] == "chat-epp"
    # What the emulator stored passes the real InferencePool v1 schema.
    jsonschema.Draft4Validator(yaml.safe_load(SCHEMA.read_text())).validate(pool)

    await until(
        operator,
        lambda: (_pool_condition(cluster, "chat") or {}).get("reason") == "Created",
        "the InferencePool condition to say Created",
    )
    assert _status(cluster, "chat")["inferencePool"] == "chat"


async def test_an_endpoint_that_does_not_ask_gets_no_pool(
    cluster: Cluster, operator: Operator
) -> None:
    await cluster.create(LLMEP, NS, endpoint("plain", NS, {"model": {"name": "org/model"}}))
    await until(
        operator, lambda: _status(cluster, "plain").get("observedGeneration") == 1, "status"
    )
    assert cluster.get(POOLS, NS, "plain") is None
    assert _pool_condition(cluster, "plain") is None
    assert "inferencePool" not in _status(cluster, "plain")


async def test_a_pool_no_longer_asked_for_is_removed(cluster: Cluster, operator: Operator) -> None:
    await cluster.patch(LLMEP, NS, "chat", {"spec": {"api": {"inferencePool": {"enabled": False}}}})

    await until(operator, lambda: cluster.get(POOLS, NS, "chat") is None, "the pool's deletion")
    await until(
        operator,
        lambda: (
            _pool_condition(cluster, "chat") is None
            and not _status(cluster, "chat").get("inferencePool")
        ),
        "the status to stop reporting the pool",
    )
    assert cluster.get(CHILD_RESOURCES["Deployment"], NS, "chat") is not None
