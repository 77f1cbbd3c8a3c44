"""The real operator autoscaling an endpoint against kmock's in-memory Kubernetes API.

Stand-in runtime pods are small metrics servers on 127.0.0.N (one per replica, the same port on
each address, as pods have), listed in the endpoint Service's EndpointSlice. A loop in the test
plays the Deployment controller and the kubelet: it follows the Deployment's replicas with
ready stand-ins. The load is a closed loop: `work` concurrent requests spread over the ready
pods, each running at most CAPACITY and queueing the rest, as the runtime's admission does.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio
from aiohttp import web
from ports import free_port

from .kube_emulator import (
    CHILD_RESOURCES,
    LLMEP,
    Cluster,
    Operator,
    endpoint,
    endpoint_slice,
    serve_metrics,
    until,
)

pytestmark = [pytest.mark.kube, pytest.mark.asyncio(loop_scope="module")]

NS = "scaling"
NAME = "chat"
DEPLOYMENTS = CHILD_RESOURCES["Deployment"]
SLICES = "discovery.k8s.io/v1/endpointslices"
CAPACITY = 4  # requests one stand-in pod runs at once
SCALE_DOWN_WINDOW = 8
SCALING = {
    "minReplicas": 1,
    "maxReplicas": 4,
    "targetQueueDepth": 2,
    "intervalSeconds": 1,
    "stableWindowSeconds": 4,
    "panicWindowSeconds": 2,
    "scaleDownStabilizationSeconds": SCALE_DOWN_WINDOW,
}


class StandInPods:
    """Ready 'pods' that follow the Deployment's replicas and report the load's share."""

    def __init__(self, cluster: Cluster, port: int) -> None:
        self.cluster, self.port = cluster, port
        self.work = 0  # concurrent requests sent to the endpoint
        self.scrapes = 0  # GET /metrics the operator sent
        self._runners: list[web.AppRunner] = []
        self._listed = 0  # pods in the EndpointSlice

    def _share(self, index: int) -> tuple[int, int]:
        # The load goes to the pods the EndpointSlice lists (as a Service's would): a pod that
        # is up but not listed yet gets none, so a scrape in between never misses a share.
        pods = self._listed
        if index >= pods:
            return 0, 0
        mine = self.work // pods + (1 if index < self.work % pods else 0)
        return max(0, mine - CAPACITY), min(mine, CAPACITY)

    async def _start_pod(self) -> None:
        index = len(self._runners)

        def metrics() -> str:
            self.scrapes += 1
            queued, running = self._share(index)
            return (
                "# TYPE llmendpoints_queue_depth gauge\n"
                f"llmendpoints_queue_depth {queued}\n"
                "# TYPE llmendpoints_requests_in_flight gauge\n"
                f"llmendpoints_requests_in_flight {running}\n"
            )

        self._runners.append(await serve_metrics(f"127.0.0.{index + 1}", self.port, metrics))

    async def _publish(self) -> None:
        pods = {f"{NAME}-pod-{i}": f"127.0.0.{i + 1}" for i in range(len(self._runners))}
        body = endpoint_slice(NAME, NS, self.port, pods)
        if self.cluster.get(SLICES, NS, body["metadata"]["name"]) is None:
            await self.cluster.create(SLICES, NS, body)
        else:
            await self.cluster.patch(SLICES, NS, body["metadata"]["name"], body)
        count = self._listed = len(self._runners)
        await self.cluster.patch(
            DEPLOYMENTS,
            NS,
            NAME,
            {"status": {k: count for k in ("replicas", "readyReplicas", "availableReplicas")}},
        )

    async def follow(self) -> None:
        """Play the Deployment controller and the kubelet: as many ready stand-ins as
        spec.replicas, in the EndpointSlice and in the Deployment's status."""
        while True:
            deployment = self.cluster.get(DEPLOYMENTS, NS, NAME)
            wanted = (deployment or {}).get("spec", {}).get("replicas", 0)
            if wanted != len(self._runners):
                self._listed = min(self._listed, wanted)  # the Service stops routing first
                while len(self._runners) < wanted:
                    await self._start_pod()
                while len(self._runners) > wanted:
                    await self._runners.pop().cleanup()
                await self._publish()
                self._listed = wanted
            await asyncio.sleep(0.1)

    async def close(self) -> None:
        for runner in self._runners:
            await runner.cleanup()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def pods(cluster: Cluster) -> AsyncIterator[StandInPods]:
    pods = StandInPods(cluster, free_port())
    task = asyncio.create_task(pods.follow())
    yield pods
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    await pods.close()


def _epoch(rfc3339: str) -> float:
    return (
        datetime.datetime.strptime(rfc3339, "%Y-%m-%dT%H:%M:%SZ")
        .replace(tzinfo=datetime.UTC)
        .timestamp()
    )


def _replicas(cluster: Cluster) -> int | None:
    return ((cluster.get(DEPLOYMENTS, NS, NAME) or {}).get("spec") or {}).get("replicas")


def _autoscaling(cluster: Cluster) -> dict[str, Any]:
    return ((cluster.get(LLMEP, NS, NAME) or {}).get("status") or {}).get("autoscaling") or {}


async def test_queue_up_scales_up_fast_load_gone_holds_then_returns_to_min(
    cluster: Cluster, operator: Operator, pods: StandInPods
) -> None:
    await cluster.create(
        LLMEP, NS, endpoint(NAME, NS, {"model": {"name": "org/model"}, "scaling": SCALING})
    )
    await until(operator, lambda: _replicas(cluster) == 1, "the Deployment with 1 replica")
    await until(operator, lambda: _autoscaling(cluster).get("signals"), "a first autoscaler tick")
    assert _autoscaling(cluster)["reason"].startswith("hold at 1")

    # 24 concurrent requests on one pod of 4: 20 queued, 10x the target. At the known capacity
    # the work needs 24 / (4 + 2) = 4 replicas; growth is at most x2 per decision. The path is
    # 1 -> 2 -> 4, or 1 -> 2 -> 3 -> 4 when the load began late in the averaging window (the
    # windows' averages still held the idle ticks before it: seen once in CI, 12 then 16).
    pods.work = 24
    await until(operator, lambda: (_replicas(cluster) or 0) > 1, "a scale-up", timeout=60)
    await until(operator, lambda: _replicas(cluster) == 4, "4 replicas", timeout=60)

    def ups() -> list[dict[str, Any]]:  # newest first, as status lists them
        return [d for d in _autoscaling(cluster).get("lastDecisions", []) if d["to"] > d["from"]]

    await until(operator, lambda: ups() and ups()[0]["to"] == 4, "the scale-ups in status", 30)
    ups = ups()
    steps = [(d["from"], d["to"]) for d in reversed(ups)]
    assert steps in ([(1, 2), (2, 4)], [(1, 2), (2, 3), (3, 4)]), steps
    for up in ups:  # each for a queue far over the target, at most doubling
        assert "burst" in up["reason"] and up["signals"]["queueDepth"] > 2 * up["from"], up

    text = await operator.metrics()
    labels = f'endpoint="{NS}/{NAME}"'
    assert f"llmendpoints_autoscaler_desired_replicas{{{labels}}} 4.0" in text
    up_count = f'llmendpoints_autoscaler_decisions_total{{direction="up",{labels}}} {len(ups)}.0'
    assert up_count in text

    # The load goes away and the operator restarts in the middle of the scale-down window: the
    # size holds through the window all the same, then returns to min (in one step, or two when
    # the tick that saw the drop still averaged some load). The restarted operator resumes the
    # state kept in status (the decisions recorded before the restart are still listed).
    pods.work = 0
    gone = time.time()
    await asyncio.sleep(2)
    await operator.stop()
    await operator.start()
    await until(operator, lambda: _replicas(cluster) == 1, "back to minReplicas", timeout=120)
    await until(
        operator,
        lambda: _autoscaling(cluster).get("desiredReplicas") == 1,
        "status at 1",
        timeout=30,
    )
    status = _autoscaling(cluster)
    downs = [d for d in status["lastDecisions"] if d["to"] < d["from"]]
    assert 1 <= len(downs) <= 2 and downs[0]["to"] == 1 and downs[-1]["from"] == 4
    assert "clamped to minReplicas 1" in downs[0]["reason"]
    assert status["lastDecisions"][len(downs) :] == ups
    held = min(_epoch(d["time"]) for d in downs) - gone
    # The last loaded tick may precede `gone` by a tick, and status times are whole seconds.
    assert held >= SCALE_DOWN_WINDOW - 2
    assert status["state"]["v"] == 1

    def scale_events() -> list[str]:
        return [e["reason"] for e in cluster.events(NS, NAME) if e["reason"].startswith("Scale")]

    # Events are posted in the background: the last one may follow the status write.
    expected = ["ScaleUp"] * len(ups) + ["ScaleDown"] * len(downs)
    await until(operator, lambda: len(scale_events()) >= len(expected), "the Events", timeout=30)
    assert scale_events() == expected
    events = [(e["reason"], e["message"]) for e in cluster.events(NS, NAME)]
    assert any(m.startswith("scale down") and "->1" in m for r, m in events if r == "ScaleDown")

    text = await operator.metrics()  # the restarted process counts from zero
    assert f"llmendpoints_autoscaler_desired_replicas{{{labels}}} 1.0" in text
    assert (
        f'llmendpoints_autoscaler_decisions_total{{direction="down",{labels}}} {len(downs)}.0'
        in text
    )


async def test_only_the_controllers_pod_endpoints_are_fetched(
    cluster: Cluster, operator: Operator, pods: StandInPods
) -> None:
    """A slice labelled with the Service's name by someone else, or an endpoint that is no Pod,
    never makes the operator send a request (docs/security.md)."""
    if cluster.get(LLMEP, NS, NAME) is None:  # run alone: bring the endpoint up first
        spec = {"model": {"name": "org/m"}, "scaling": SCALING}
        await cluster.create(LLMEP, NS, endpoint(NAME, NS, spec))
        await until(operator, lambda: pods.scrapes > 0, "the autoscaler scraping its pod")
    hits = 0

    async def bait(request: web.Request) -> web.Response:
        nonlocal hits
        hits += 1
        return web.Response(
            text="llmendpoints_queue_depth 1000\nllmendpoints_requests_in_flight 0\n"
        )

    app = web.Application()
    app.router.add_get("/metrics", bait)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.200", pods.port).start()
    forged_endpoint = {
        "addresses": ["127.0.0.200"],
        "conditions": {"ready": True},
        "targetRef": {"kind": "Pod", "name": f"{NAME}-forged"},
    }
    not_a_pod = {"addresses": ["127.0.0.200"], "conditions": {"ready": True}}
    managed = {"endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io"}
    for name, labels, endpoints in [
        ("forged", {}, [forged_endpoint]),
        ("not-a-pod", managed, [not_a_pod]),
    ]:
        await cluster.create(
            SLICES,
            NS,
            {
                "apiVersion": "discovery.k8s.io/v1",
                "kind": "EndpointSlice",
                "metadata": {
                    "name": f"{NAME}-{name}",
                    "namespace": NS,
                    "labels": {"kubernetes.io/service-name": NAME, **labels},
                },
                "addressType": "IPv4",
                "ports": [{"name": "http", "port": pods.port, "protocol": "TCP"}],
                "endpoints": endpoints,
            },
        )
    try:
        before = pods.scrapes
        await until(operator, lambda: pods.scrapes >= before + 3, "three more ticks")
        assert hits == 0
    finally:
        await runner.cleanup()
