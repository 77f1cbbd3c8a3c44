"""Multi-node endpoints on the real operator and an emulated API server, in the order a user meets
them: asked for before LeaderWorkerSet is installed (the status names it and how to install it;
nothing else breaks), LWS installed (the group appears: one LeaderWorkerSet valid against LWS
v0.9.0's real schema, group size 2, no Deployment, a Service selecting the leaders), its state in
the status (groups ready, the pod and node that keep one from being ready), the autoscaler adding
whole groups, sizes that do not fit refused, and back to one node.

One emulator and operator for the module; the tests run in file order and build on each other.
The emulator has no controllers: the tests write what LWS and the kubelet would (statuses, pods,
the EndpointSlice of the Service). The resync stays at its default (300 s): everything here is the
operator reacting to events.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import kmock
import lws_schema
import pytest
import pytest_asyncio
from ports import free_port

from .kube_emulator import (
    CHILD_RESOURCES,
    LLMEP,
    VERBS,
    Cluster,
    Operator,
    endpoint,
    endpoint_slice,
    serve_metrics,
    until,
)

pytestmark = [pytest.mark.kube, pytest.mark.asyncio(loop_scope="module")]

NS = "models"
LWS = "leaderworkerset.x-k8s.io/v1/leaderworkersets"
PODS = "v1/pods"
SLICES = "discovery.k8s.io/v1/endpointslices"
CRDS = "apiextensions.k8s.io/v1/customresourcedefinitions"
DEPLOYMENTS = CHILD_RESOURCES["Deployment"]
INSTALL = (
    "kubectl apply --server-side -f "
    "https://github.com/kubernetes-sigs/lws/releases/download/v0.9.0/manifests.yaml"
)
BIG = {
    "model": {"name": "org/big"},
    "resources": {"gpus": 8, "nodes": 2},
    "scaling": {
        "minReplicas": 1,
        "maxReplicas": 3,
        "intervalSeconds": 1,
        "stableWindowSeconds": 2,
        "panicWindowSeconds": 1,
    },
}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def cluster() -> AsyncIterator[Cluster]:
    """A cluster without LeaderWorkerSet (yet)."""
    async with Cluster() as cluster:
        cluster.kmock.uninstalled.add(LWS)
        cluster.kmock.resources[PODS] = kmock.ResourceInfo(
            kind="Pod", namespaced=True, verbs=VERBS, subresources={"status"}
        )
        yield cluster


async def install_leader_worker_set(cluster: Cluster) -> None:
    """What `kubectl apply --server-side -f .../lws/.../manifests.yaml` does to the API."""
    cluster.kmock.uninstalled.discard(LWS)
    cluster.kmock.resources[LWS] = kmock.ResourceInfo(
        kind="LeaderWorkerSet", namespaced=True, verbs=VERBS, subresources={"status", "scale"}
    )
    crd = {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": "leaderworkersets.leaderworkerset.x-k8s.io"},
        "spec": {
            "group": "leaderworkerset.x-k8s.io",
            "names": {"kind": "LeaderWorkerSet", "plural": "leaderworkersets"},
            "scope": "Namespaced",
            "versions": [
                {
                    "name": "v1",
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": lws_schema.schema()},
                    "subresources": {
                        "status": {},
                        "scale": {
                            "specReplicasPath": ".spec.replicas",
                            "statusReplicasPath": ".status.replicas",
                            "labelSelectorPath": ".status.hpaPodSelector",
                        },
                    },
                }
            ],
        },
    }
    await cluster.create(CRDS, "", crd)


def _status(cluster: Cluster, name: str) -> dict[str, Any]:
    return (cluster.get(LLMEP, NS, name) or {}).get("status") or {}


def _condition(cluster: Cluster, name: str, type_: str) -> dict[str, Any]:
    conditions = _status(cluster, name).get("conditions") or []
    return next((c for c in conditions if c["type"] == type_), {})


async def test_without_leader_worker_set_the_status_says_how_to_install_it(
    cluster: Cluster, operator: Operator
) -> None:
    await cluster.create(LLMEP, NS, endpoint("big", NS, BIG))
    await cluster.create(LLMEP, NS, endpoint("small", NS, {"model": {"name": "org/small"}}))

    ready = await until(
        operator,
        lambda: (
            (c := _condition(cluster, "big", "Ready")).get("reason")
            == "LeaderWorkerSetNotInstalled"
            and c
        ),
        "the Ready condition to name LeaderWorkerSet",
    )
    assert ready["status"] == "False"
    assert "LeaderWorkerSet" in ready["message"] and INSTALL in ready["message"]
    assert _status(cluster, "big")["observedGeneration"] == 1  # a reconcile that succeeded
    # The rest of the endpoint is there; no Deployment stands in for the groups.
    assert cluster.get(CHILD_RESOURCES["Service"], NS, "big") is not None
    assert cluster.get(DEPLOYMENTS, NS, "big") is None
    warning = await until(
        operator,
        lambda: [
            e for e in cluster.events(NS, "big") if e["reason"] == "LeaderWorkerSetNotInstalled"
        ],
        "a Warning Event",
    )
    assert warning[0]["type"] == "Warning"
    # A single-node endpoint reconciles as ever, and the operator keeps running.
    await until(
        operator,
        lambda: _status(cluster, "small").get("observedGeneration") == 1,
        "the single-node endpoint's status",
    )
    assert cluster.get(DEPLOYMENTS, NS, "small") is not None
    assert operator.alive


async def test_installing_it_makes_one_valid_leader_worker_set_of_two_node_groups(
    cluster: Cluster, operator: Operator
) -> None:
    await install_leader_worker_set(cluster)

    lws = await until(
        operator, lambda: cluster.get(LWS, NS, "big-group"), "the LeaderWorkerSet", timeout=60
    )
    # What the emulator stored passes LWS v0.9.0's schema and its webhook's checks.
    lws_schema.validate(lws)
    owner = cluster.get(LLMEP, NS, "big")
    [ref] = lws["metadata"]["ownerReferences"]
    assert (ref["kind"], ref["name"], ref["uid"], ref["controller"]) == (
        "LLMEndpoint",
        "big",
        owner["metadata"]["uid"],
        True,
    )
    lwt = lws["spec"]["leaderWorkerTemplate"]
    assert (lwt["size"], lwt["restartPolicy"]) == (2, "RecreateGroupOnPodRestart")
    assert lws["spec"]["replicas"] == 1
    assert cluster.get(DEPLOYMENTS, NS, "big") is None
    # The Service (and so its EndpointSlices, which the gateway reads) selects the leaders.
    service = cluster.get(CHILD_RESOURCES["Service"], NS, "big")
    assert service["spec"]["selector"] == {
        "llmendpoints.dev/endpoint": "big",
        "leaderworkerset.sigs.k8s.io/worker-index": "0",
    }
    await until(
        operator,
        lambda: _condition(cluster, "big", "Ready").get("reason") == "Starting",
        "the endpoint to wait for its group",
    )
    assert _status(cluster, "big")["groups"] == {
        "name": "big-group",
        "size": 2,
        "ready": 0,
        "desired": 1,
    }


# What LWS reports for one group on the current template with every pod ready.
GROUP_READY = {"replicas": 1, "readyReplicas": 1, "updatedReplicas": 1}


def _pod(group: int, worker: int, node: str, **status: Any) -> dict[str, Any]:
    name = f"big-group-{group}" if worker == 0 else f"big-group-{group}-{worker}"
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": NS,
            "labels": {
                "llmendpoints.dev/endpoint": "big",
                "leaderworkerset.sigs.k8s.io/name": "big-group",
                "leaderworkerset.sigs.k8s.io/group-index": str(group),
                "leaderworkerset.sigs.k8s.io/worker-index": str(worker),
            },
        },
        "spec": {"nodeName": node, "containers": []},
        "status": status,
    }


async def test_the_status_counts_groups_and_names_the_pod_that_keeps_one_down(
    cluster: Cluster, operator: Operator
) -> None:
    # LWS reports the group ready: the endpoint serves.
    await cluster.patch(LWS, NS, "big-group", {"status": GROUP_READY})
    await until(
        operator,
        lambda: _status(cluster, "big").get("phase") == "Ready",
        "the endpoint to be Ready",
    )
    assert _condition(cluster, "big", "Available")["message"] == "1/1 groups available"

    # The worker's container crashes on node gpu-7: LWS counts the group unready.
    ready = {"conditions": [{"type": "Ready", "status": "True"}], "phase": "Running"}
    crashed = {
        "phase": "Running",
        "conditions": [{"type": "Ready", "status": "False"}],
        "containerStatuses": [
            {
                "name": "runtime",
                "ready": False,
                "restartCount": 3,
                "state": {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 80s"}},
                "lastState": {"terminated": {"reason": "OOMKilled", "exitCode": 137}},
            }
        ],
    }
    await cluster.create(PODS, NS, _pod(0, 0, "gpu-6", **ready))
    await cluster.create(PODS, NS, _pod(0, 1, "gpu-7", **crashed))
    await cluster.patch(LWS, NS, "big-group", {"status": {**GROUP_READY, "readyReplicas": 0}})

    groups = await until(
        operator,
        lambda: (g := _status(cluster, "big").get("groups") or {}).get("unready") and g,
        "the status to name the unready pod",
    )
    [pod] = groups["unready"]
    assert (pod["pod"], pod["node"], pod["workerIndex"], pod["reason"]) == (
        "big-group-0-1",
        "gpu-7",
        1,
        "CrashLoopBackOff",
    )
    assert groups["lastFailure"]["node"] == "gpu-7"
    progressing = _condition(cluster, "big", "Progressing")
    assert progressing["reason"] == "GroupFailing"
    assert "worker 1 (pod big-group-0-1 on node gpu-7) CrashLoopBackOff" in progressing["message"]
    assert _status(cluster, "big")["phase"] == "Failed"

    # LWS recreated the group and it is ready again.
    await cluster.delete(PODS, NS, "big-group-0-1")
    await cluster.patch(LWS, NS, "big-group", {"status": GROUP_READY})
    await until(operator, lambda: _status(cluster, "big").get("phase") == "Ready", "Ready again")
    assert "unready" not in _status(cluster, "big")["groups"]
    assert _status(cluster, "big")["groups"]["lastFailure"]["pod"] == "big-group-0-1"


async def test_a_queue_on_the_leader_scales_the_leader_worker_set_by_whole_groups(
    cluster: Cluster, operator: Operator
) -> None:
    """The leader's /metrics carry the whole group's queue; the Service's EndpointSlice lists
    leaders only; the autoscaler writes the LeaderWorkerSet's replicas."""
    port = free_port()
    scrapes = 0

    def metrics() -> str:
        nonlocal scrapes
        scrapes += 1
        return "llmendpoints_queue_depth 12\nllmendpoints_requests_in_flight 4\n"

    runner = await serve_metrics("127.0.0.1", port, metrics)
    try:
        leader = {"big-group-0": "127.0.0.1"}
        slice_ = endpoint_slice("big", NS, port, leader, port_name="control")
        await cluster.create(SLICES, NS, slice_)
        scaled = await until(
            operator,
            lambda: (r := cluster.get(LWS, NS, "big-group")["spec"]["replicas"]) > 1 and r,
            "the autoscaler to add groups",
        )
    finally:
        await runner.cleanup()
    assert scrapes > 0 and 1 < scaled <= 3  # whole groups, at most maxReplicas groups
    assert cluster.get(DEPLOYMENTS, NS, "big") is None
    # Events are posted in the background: the ScaleUp may follow the replicas it reports.
    await until(
        operator,
        lambda: any(e["reason"] == "ScaleUp" for e in cluster.events(NS, "big")),
        "a ScaleUp Event",
        timeout=30,
    )


async def test_sizes_that_do_not_fit_the_gpus_are_refused_naming_them(
    cluster: Cluster, operator: Operator
) -> None:
    spec = {**BIG, "engine": {"tensorParallelSize": 8}}  # 8 x 1 x 1 on 2 x 8 GPUs
    await cluster.create(LLMEP, NS, endpoint("bad", NS, spec))
    ready = await until(
        operator,
        lambda: (c := _condition(cluster, "bad", "Ready")).get("reason") == "InvalidSpec" and c,
        "InvalidSpec",
    )
    assert ready["message"] == (
        "spec.engine.tensorParallelSize: tensorParallelSize 8 x pipelineParallelSize 1 x "
        "dataParallelSize 1 = 8, but resources.gpus 8 x resources.nodes 2 = 16: every GPU of a "
        'replica holds one shard (sizes left out are derived: docs/operator.md, "Parallelism")'
    )
    assert cluster.get(LWS, NS, "bad-group") is None and cluster.get(DEPLOYMENTS, NS, "bad") is None
    assert operator.alive


async def test_back_to_one_node_replaces_the_groups_with_a_deployment(
    cluster: Cluster, operator: Operator
) -> None:
    groups = cluster.get(LWS, NS, "big-group")["spec"]["replicas"]
    await cluster.patch(LLMEP, NS, "big", {"spec": {"resources": {"nodes": 1}}})

    deployment = await until(
        operator, lambda: cluster.get(DEPLOYMENTS, NS, "big"), "the Deployment", timeout=60
    )
    await until(operator, lambda: cluster.get(LWS, NS, "big-group") is None, "the LWS deletion")
    assert deployment["spec"]["replicas"] == groups  # the autoscaler's count, carried over
    await until(
        operator,
        lambda: not _status(cluster, "big").get("groups"),
        "the status to stop reporting groups",
    )
