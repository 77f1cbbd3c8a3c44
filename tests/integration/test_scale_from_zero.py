"""Scale from zero and back, end to end: the real operator against kmock's Kubernetes API, the
held-request signal and nudges in a real nats-server, stand-in pods that take a while to become
ready (a cold start). The gateway itself is not here: the test plays its part in NATS (it holds a
request -> publishes the count, nudges; it answers it -> publishes 0).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import httpx
import kmock
import nats
import pytest
import pytest_asyncio
from aiohttp import web
from gateway.harness import launch_gateway, launch_standin
from llmendpoints_common.jobs.models import parse_job_request
from llmendpoints_common.queue import signals
from llmendpoints_common.queue.client import QueueConnection, QueueJobService
from llmendpoints_operator import manifests
from ports import free_port

from .kube_emulator import (
    CHILD_RESOURCES,
    LLMEP,
    Cluster,
    Operator,
    endpoint,
    endpoint_slice,
    serve_metrics,
    wait_for,
)
from .nats_kit import nats_server

pytestmark = [pytest.mark.kube, pytest.mark.asyncio(loop_scope="module")]

NS = "zero"
DEPLOYMENTS = CHILD_RESOURCES["Deployment"]
SLICES = "discovery.k8s.io/v1/endpointslices"
COLD_START = 1.5  # seconds a stand-in pod takes to become ready
IDLE_AFTER = 4
SCALING = {
    "minReplicas": 0,
    "maxReplicas": 3,
    "targetQueueDepth": 2,
    "intervalSeconds": 2,
    "stableWindowSeconds": 4,
    "panicWindowSeconds": 2,
    "scaleDownStabilizationSeconds": 4,
    "scaleToZeroAfterSeconds": IDLE_AFTER,
}


class SlowPods:
    """Stand-in pods of one endpoint that follow its Deployment's replicas and become ready
    COLD_START seconds after they are asked for. They report an idle /metrics."""

    def __init__(self, cluster: Cluster, name: str, subnet: int) -> None:
        self.cluster, self.name, self.subnet, self.port = cluster, name, subnet, free_port()
        self._runners: list[web.AppRunner] = []

    async def _start_pod(self) -> None:
        address = f"127.0.{self.subnet}.{len(self._runners) + 1}"
        idle = "llmendpoints_queue_depth 0\nllmendpoints_requests_in_flight 0\n"
        self._runners.append(await serve_metrics(address, self.port, lambda: idle))

    async def _publish(self) -> None:
        count = len(self._runners)
        pods = {f"{self.name}-pod-{i}": f"127.0.{self.subnet}.{i + 1}" for i in range(count)}
        body = endpoint_slice(self.name, NS, self.port, pods)
        if self.cluster.get(SLICES, NS, body["metadata"]["name"]) is None:
            await self.cluster.create(SLICES, NS, body)
        else:
            await self.cluster.patch(SLICES, NS, body["metadata"]["name"], body)
        await self.cluster.patch(
            DEPLOYMENTS,
            NS,
            self.name,
            {"status": {k: count for k in ("replicas", "readyReplicas", "availableReplicas")}},
        )

    async def follow(self) -> None:
        while True:
            deployment = self.cluster.get(DEPLOYMENTS, NS, self.name)
            wanted = (deployment or {}).get("spec", {}).get("replicas", 0)
            if wanted > len(self._runners):
                await asyncio.sleep(COLD_START)  # scheduling, image, model load
                while len(self._runners) < wanted:
                    await self._start_pod()
                await self._publish()
            elif wanted < len(self._runners):
                while len(self._runners) > wanted:
                    await self._runners.pop().cleanup()
                await self._publish()
            await asyncio.sleep(0.1)

    async def close(self) -> None:
        for runner in self._runners:
            await runner.cleanup()
        # kmock lists ignore label selectors: a stale slice would show up in other endpoints.
        with contextlib.suppress(Exception):
            await self.cluster.delete(SLICES, NS, f"{self.name}-x7k2p")


@pytest.fixture(scope="module")
def nats_url() -> AsyncIterator[str]:
    with nats_server() as url:
        yield url


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def cluster() -> AsyncIterator[Cluster]:
    async with Cluster() as cluster:
        yield cluster


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def operator(cluster, nats_url, tmp_path_factory) -> AsyncIterator[tuple[Operator, int]]:
    tmp = tmp_path_factory.mktemp("operator")
    metrics_port = free_port()
    operator = Operator(
        cluster.write_kubeconfig(tmp / "kubeconfig"),
        tmp / "operator.log",
        env={
            "LLMEP_OPERATOR_METRICS_PORT": str(metrics_port),
            "LLMEP_OPERATOR_JOBS_QUEUE_URL": nats_url,
            # Never contacted here: its presence says a gateway holds requests (minReplicas 0).
            "LLMEP_OPERATOR_GATEWAY_URL": "http://gateway.llmendpoints.svc:8080",
        },
    )
    await operator.start()
    yield operator, metrics_port
    await operator.stop()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def js(nats_url):
    client = await nats.connect(nats_url)
    yield client
    await client.drain()


@contextlib.asynccontextmanager
async def slow_pods(cluster: Cluster, name: str, subnet: int) -> AsyncIterator[SlowPods]:
    pods = SlowPods(cluster, name, subnet)
    task = asyncio.create_task(pods.follow())
    try:
        yield pods
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await pods.close()


def _replicas(cluster: Cluster, name: str) -> int | None:
    return ((cluster.get(DEPLOYMENTS, NS, name) or {}).get("spec") or {}).get("replicas")


def _status(cluster: Cluster, name: str) -> dict[str, Any]:
    return (cluster.get(LLMEP, NS, name) or {}).get("status") or {}


async def _until(operator: Operator, predicate: Any, what: str, timeout: float = 30) -> Any:
    def check() -> Any:
        assert operator.alive, f"operator exited:\n{operator.log()[-3000:]}"
        return predicate()

    try:
        return await wait_for(check, timeout=timeout, what=what)
    except TimeoutError as exc:
        raise AssertionError(f"{exc}; operator log:\n{operator.log()[-4000:]}") from None


async def _last_decision(op: Operator, cluster: Cluster, name: str, to: int) -> dict[str, Any]:
    """The newest scale change in status once it is there (written right after the patch)."""

    def newest() -> dict[str, Any] | None:
        decisions = _status(cluster, name).get("autoscaling", {}).get("lastDecisions") or []
        return decisions[0] if decisions and decisions[0]["to"] == to else None

    return await _until(op, newest, f"the scale change to {to} in status")


async def _operator_metrics(port: int) -> str:
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"http://127.0.0.1:{port}/metrics") as response,
    ):
        return await response.text()


async def test_held_request_scales_from_zero_in_a_tick_and_idle_goes_back_to_zero(
    cluster, operator, js
):
    op, metrics_port = operator
    name = "chat"
    spec = {"model": {"name": "org/model"}, "scaling": SCALING}
    async with slow_pods(cluster, name, subnet=10):
        await cluster.create(LLMEP, NS, endpoint(name, NS, spec))
        # minReplicas 0: the Deployment is created at 0 and stays there with nothing to do.
        await _until(op, lambda: _replicas(cluster, name) == 0, "a Deployment at 0")
        await _until(
            op,
            lambda: (
                "nothing held, queued or running"
                in _status(cluster, name).get("autoscaling", {}).get("reason", "")
            ),
            "a first tick at zero",
        )
        assert _status(cluster, name)["phase"] == "ScaledToZero"

        # The gateway holds a request for it (no nudge: the tick alone must find it).
        await signals.publish_held(js.jetstream(), f"{NS}/{name}", "gw-a", 1)
        await _until(
            op,
            lambda: _replicas(cluster, name) == 1,
            "0 -> 1 within a tick",
            timeout=SCALING["intervalSeconds"] + 2,
        )
        decision = await _last_decision(op, cluster, name, to=1)
        assert "from zero: 1 request(s) held by the gateway" in decision["reason"]

        # The stand-in pod becomes ready COLD_START s later; the cold start is in status.
        await _until(
            op,
            lambda: "readyTime" in _status(cluster, name)["autoscaling"].get("coldStart", {}),
            "the cold start recorded",
        )
        cold = _status(cluster, name)["autoscaling"]["coldStart"]
        assert cold["seconds"] >= COLD_START - 1  # status times are whole seconds
        text = await _operator_metrics(metrics_port)
        labels = f'endpoint="{NS}/{name}"'
        assert f"llmendpoints_autoscaler_cold_start_seconds_count{{{labels}}} 1.0" in text
        assert f"llmendpoints_autoscaler_held_requests{{{labels}}} 1.0" in text
        assert f'llmendpoints_autoscaler_queued_jobs{{{labels},priority="normal"}}' in text

        # The gateway answered it (its count goes to 0): idle for IDLE_AFTER s -> back to 0.
        answered = time.time()
        await signals.publish_held(js.jetstream(), f"{NS}/{name}", "gw-a", 0)
        await _until(op, lambda: _replicas(cluster, name) == 0, "back to zero", timeout=20)
        assert time.time() - answered >= IDLE_AFTER - 1
        await _until(op, lambda: _status(cluster, name).get("phase") == "ScaledToZero", "phase")
        st = _status(cluster, name)
        ready = next(c for c in st["conditions"] if c["type"] == "Ready")
        assert ready["reason"] == "ScaledToZero"
        # The idle rule with its setting; how long it was idle depends on when the tick came
        # (seconds later on a loaded machine), and the floor is asserted above.
        assert f"(scaleToZeroAfterSeconds {IDLE_AFTER})" in ready["message"], ready["message"]
        assert "idle for" in st["autoscaling"]["scaledToZero"]["reason"]
        reasons = [e["reason"] for e in cluster.events(NS, name)]
        assert "ScaleFromZero" in reasons and "ScaleToZero" in reasons


async def test_a_nudge_scales_from_zero_without_waiting_for_the_tick(cluster, operator, js):
    op, _ = operator
    name = "nudged"
    slow_ticks = {**SCALING, "intervalSeconds": 60, "stableWindowSeconds": 60}
    async with slow_pods(cluster, name, subnet=11):
        await cluster.create(
            LLMEP, NS, endpoint(name, NS, {"model": {"name": "org/model"}, "scaling": slow_ticks})
        )
        await _until(
            op,
            lambda: (
                "nothing held" in _status(cluster, name).get("autoscaling", {}).get("reason", "")
            ),
            "a first tick at zero",
        )
        # The next tick is a minute away: only the nudge can make this happen within 10 s.
        await signals.publish_held(js.jetstream(), f"{NS}/{name}", "gw-b", 2)
        await signals.nudge(js, f"{NS}/{name}")
        await _until(op, lambda: _replicas(cluster, name) == 1, "0 -> 1 on the nudge", timeout=10)


async def test_a_queued_job_scales_from_zero_and_keeps_the_replica_while_it_waits(
    cluster, operator, nats_url
):
    """A job in the real shared queue for an endpoint with no pod: 0 -> 1 within a tick. No
    worker takes it here (the stand-in pods do not pull), so it stays queued, and the endpoint
    must not go back to zero however long it waits; once it is gone, it does."""
    op, _ = operator
    name = "batch"
    connection = await QueueConnection.connect(nats_url, name="test-client")
    jobs = QueueJobService(connection, f"{NS}/{name}")
    try:
        async with slow_pods(cluster, name, subnet=12):
            await cluster.create(
                LLMEP, NS, endpoint(name, NS, {"model": {"name": "org/model"}, "scaling": SCALING})
            )
            await _until(
                op,
                lambda: (
                    "nothing held"
                    in _status(cluster, name).get("autoscaling", {}).get("reason", "")
                ),
                "a first tick at zero",
            )
            job = await jobs.submit(
                parse_job_request(b'{"input": {"prompt": "a"}, "policy": {"lowPriority": true}}'),
                sync=False,
                owner="alice",
            )
            await _until(
                op,
                lambda: _replicas(cluster, name) == 1,
                "0 -> 1 within a tick",
                timeout=SCALING["intervalSeconds"] + 2,
            )
            decision = await _last_decision(op, cluster, name, to=1)
            assert "1 queued low-priority job(s)" in decision["reason"]
            # Twice the idle time with the job still queued: the replica stays.
            await asyncio.sleep(2 * IDLE_AFTER + SCALING["intervalSeconds"])
            assert _replicas(cluster, name) == 1
            assert _status(cluster, name)["autoscaling"]["signals"]["queuedLowPriorityJobs"] == 1
            await jobs.cancel(job.id, owner="alice")
            await _until(op, lambda: _replicas(cluster, name) == 0, "back to zero", timeout=20)
    finally:
        await connection.nc.drain()


# --- end to end: the real gateway holds the request, the operator scales, the request is answered


async def test_a_request_held_by_the_gateway_is_answered_after_the_scale_from_zero(
    cluster, operator, nats_url, tmp_path_factory
):
    """Client -> the real gateway (Kubernetes discovery against kmock, held-request signals in
    the real nats-server) -> no ready replica: the gateway holds the request and nudges -> the
    operator scales 0 -> 1 -> a stand-in backend becomes ready COLD_START s later and is listed
    in the EndpointSlice -> the gateway forwards the held request -> 200, and the gateway's held
    count is back to 0."""
    op, _ = operator
    logs = tmp_path_factory.mktemp("e2e")
    cluster.kmock.resources["v1/secrets"] = kmock.ResourceInfo(
        kind="Secret", namespaced=True, verbs={"get", "list", "watch"}
    )
    name, model = "e2e", "e2e-model"
    gateway = launch_gateway(
        logs,
        KUBECONFIG=str(cluster.write_kubeconfig(logs / "kubeconfig")),
        JOBS_QUEUE_URL=nats_url,
        GATEWAY_REQUIRE_KEYS="false",  # the endpoint is open: this is about scaling
    )
    backend = None
    try:
        await asyncio.to_thread(gateway.wait_http, "/health")
        spec = {"model": {"name": "org/model", "servedModelName": model}, "scaling": SCALING}
        await cluster.create(LLMEP, NS, endpoint(name, NS, spec))
        await _until(op, lambda: _replicas(cluster, name) == 0, "a Deployment at 0")

        body = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
        request = asyncio.create_task(
            asyncio.to_thread(
                httpx.post, gateway.url + "/v1/chat/completions", json=body, timeout=60
            )
        )
        await _until(op, lambda: _replicas(cluster, name) == 1, "0 -> 1 on the held request")
        decision = await _last_decision(op, cluster, name, to=1)
        assert "request(s) held by the gateway" in decision["reason"]

        # The pod: ready after a cold start, then listed in the Service's EndpointSlice.
        await asyncio.sleep(COLD_START)
        backend = launch_standin(logs, "pod-0")
        await asyncio.to_thread(backend.wait_http, "/ready")
        await cluster.create(
            SLICES,
            NS,
            {
                "apiVersion": "discovery.k8s.io/v1",
                "kind": "EndpointSlice",
                "metadata": {
                    "name": f"{name}-1",
                    "namespace": NS,
                    # As the EndpointSlice controller writes it: the Service's labels (the
                    # operator's, which the gateway selects slices by) plus its own.
                    "labels": {
                        **manifests.labels(name),
                        "kubernetes.io/service-name": name,
                        "endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io",
                    },
                },
                "addressType": "IPv4",
                "ports": [{"name": "http", "port": backend.port, "protocol": "TCP"}],
                "endpoints": [
                    {
                        "addresses": ["127.0.0.1"],
                        "conditions": {"ready": True},
                        "targetRef": {"kind": "Pod", "name": f"{name}-pod-0"},
                    }
                ],
            },
        )
        await cluster.patch(
            DEPLOYMENTS,
            NS,
            name,
            {"status": {"replicas": 1, "readyReplicas": 1, "availableReplicas": 1}},
        )
        response = await request
        assert response.status_code == 200, response.text
        assert response.json()["replica"] == "pod-0"

        # The gateway no longer holds anything for it: what lets the endpoint go back to zero
        # (the first test follows that path; this stand-in backend serves no /metrics, and an
        # unreadable replica is never taken for idle).
        async with await nats.connect(nats_url) as client:
            assert await signals.read_held(client.jetstream(), f"{NS}/{name}") == 0
        await cluster.delete(SLICES, NS, f"{name}-1")
    finally:
        gateway.stop()
        if backend is not None:
            backend.stop()


async def test_a_replica_that_never_gets_ready_goes_back_to_zero_once_its_job_is_gone(
    cluster, operator, nats_url
):
    """Woken from zero by a queued job; the pod never becomes ready (no GPU free, an image that
    does not pull: here, no pod at all); the job is cancelled before any pod could take it.
    Nothing waits for the endpoint any more: after scaleToZeroAfterSeconds it is back at zero,
    and the status says why -- not "hold at 1: no ready replica to measure yet" for ever."""
    op, _ = operator
    name = "stuck"
    connection = await QueueConnection.connect(nats_url, name="test-client")
    jobs = QueueJobService(connection, f"{NS}/{name}")
    try:
        await cluster.create(
            LLMEP, NS, endpoint(name, NS, {"model": {"name": "org/model"}, "scaling": SCALING})
        )
        await _until(op, lambda: _replicas(cluster, name) == 0, "a Deployment at 0")
        job = await jobs.submit(
            parse_job_request(b'{"input": {"prompt": "a"}}'), sync=False, owner="alice"
        )
        await _until(op, lambda: _replicas(cluster, name) == 1, "0 -> 1 for the queued job")
        # While the job waits, the replica that is not ready is kept, whatever the idle time.
        await asyncio.sleep(2 * IDLE_AFTER + SCALING["intervalSeconds"])
        assert _replicas(cluster, name) == 1
        assert "waiting for it: 1 queued job(s)" in _status(cluster, name)["autoscaling"]["reason"]

        cancelled = time.time()
        await jobs.cancel(job.id, owner="alice")
        await _until(op, lambda: _replicas(cluster, name) == 0, "back to zero", timeout=30)
        assert time.time() - cancelled >= IDLE_AFTER - 1
        decision = await _last_decision(op, cluster, name, to=0)
        assert (
            "no replica became ready and nothing is held, queued or running" in (decision["reason"])
        )
        await _until(op, lambda: _status(cluster, name).get("phase") == "ScaledToZero", "phase")
        st = _status(cluster, name)
        assert "no replica became ready" in st["autoscaling"]["scaledToZero"]["reason"]
        ready = next(c for c in st["conditions"] if c["type"] == "Ready")
        assert ready["reason"] == "ScaledToZero" and "no replica became ready" in ready["message"]
        assert "ScaleToZero" in [e["reason"] for e in cluster.events(NS, name)]
    finally:
        await connection.nc.drain()
