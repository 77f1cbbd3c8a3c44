"""status.adapters: the pods' adapter gauges -> per-adapter readiness and last error, and the
watcher that writes it (a fake Kubernetes API, real /metrics servers on 127.0.0.1)."""

from __future__ import annotations

from typing import Any

from aiohttp import web
from llmendpoints_operator.adapter_status import PodAdapter, adapter_status, parse_pod_adapters
from llmendpoints_operator.autoscaling.adapter_watch import (
    AdapterStatusWatcher,
    AdapterSubject,
    adapter_subjects,
)
from prometheus_client import CollectorRegistry, Gauge, generate_latest


def pod_metrics(ready: dict[str, int], errors: dict[str, str] | None = None) -> str:
    registry = CollectorRegistry()
    Gauge("llmendpoints_queue_depth", "q", registry=registry).set(0)
    Gauge("llmendpoints_requests_in_flight", "f", registry=registry).set(0)
    gauge = Gauge("llmendpoints_adapter_ready", "r", ["adapter"], registry=registry)
    for name, value in ready.items():
        gauge.labels(adapter=name).set(value)
    info = Gauge("llmendpoints_adapter_error_info", "e", ["adapter", "message"], registry=registry)
    for name, message in (errors or {}).items():
        info.labels(adapter=name, message=message).set(1)
    return generate_latest(registry).decode()


def test_a_pods_adapters_are_read_from_its_gauges():
    text = pod_metrics({"sql": 1, "legal": 0}, {"legal": 'rank 64 > "8"'})
    assert parse_pod_adapters(text) == {
        "sql": PodAdapter(ready=True),
        "legal": PodAdapter(ready=False, error='rank 64 > "8"'),
    }
    assert parse_pod_adapters(pod_metrics({})) == {}
    assert parse_pod_adapters("llmendpoints_adapter_ready{adapter=broken") == {}


def test_status_counts_ready_replicas_per_declared_adapter_in_spec_order():
    pods = [
        {"sql": PodAdapter(True), "legal": PodAdapter(False, "download failed: 401")},
        {"sql": PodAdapter(True), "legal": PodAdapter(True)},
        {},  # a pod whose mounted list has not been refreshed yet
    ]
    assert adapter_status(["legal", "sql", "new"], pods) == [
        {
            "name": "legal",
            "readyReplicas": 1,
            "replicas": 3,
            "lastError": "1 of 3 replicas: download failed: 401",
        },
        {"name": "sql", "readyReplicas": 2, "replicas": 3},
        {"name": "new", "readyReplicas": 0, "replicas": 3},
    ]
    assert adapter_status(["sql"], []) == [{"name": "sql", "readyReplicas": 0, "replicas": 0}]


def endpoint(name: str, adapters: list[str] | None, status: dict | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {"model": {"name": "m"}}
    if adapters is not None:
        spec["adapters"] = [{"name": a, "source": f"org/{a}"} for a in adapters]
    return {
        "apiVersion": "llmendpoints.dev/v1alpha1",
        "kind": "LLMEndpoint",
        "metadata": {"name": name, "namespace": "team"},
        "spec": spec,
        "status": status or {},
    }


def test_watched_endpoints_are_those_with_adapters_or_a_stale_adapter_status():
    subjects = adapter_subjects(
        [
            (endpoint("a", ["sql"]), 2),
            (endpoint("b", None), 1),
            (endpoint("c", None, {"adapters": [{"name": "x"}]}), 1),
            (None, 0),
        ]
    )
    assert [(s.key, s.adapters, s.ready_replicas) for s in subjects] == [
        (("team", "a"), ("sql",), 2),
        (("team", "c"), (), 1),
    ]


class FakeKube:
    def __init__(self, slices: list[dict]):
        self.slices = slices
        self.patches: list[tuple] = []
        self.lists = 0

    async def list(self, api_version, kind, namespace, *, label_selector):
        assert (kind, label_selector) == ("EndpointSlice", "kubernetes.io/service-name=chat")
        self.lists += 1
        return self.slices

    async def patch(self, api_version, kind, namespace, name, patch, *, subresource=None):
        self.patches.append((kind, name, patch, subresource))
        return {}


async def serve_metrics(bodies: dict[str, str], pod: str) -> tuple[web.AppRunner, int]:
    async def handler(request):
        return web.Response(text=bodies[pod], content_type="text/plain")

    app = web.Application()
    app.router.add_get("/metrics", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, site._server.sockets[0].getsockname()[1]


def endpoint_slice(pod: str, port: int) -> dict[str, Any]:
    """One slice per pod: each test pod listens on its own port of 127.0.0.1."""
    return {
        "ports": [{"name": "http", "port": port}],
        "endpoints": [
            {
                "addresses": ["127.0.0.1"],
                "conditions": {"ready": True},
                "targetRef": {"kind": "Pod", "name": pod},
            }
        ],
    }


async def test_the_watcher_writes_status_adapters_only_when_it_changes():
    bodies = {
        "chat-a": pod_metrics({"sql": 1, "legal": 0}, {"legal": "no adapter_config.json"}),
        "chat-b": pod_metrics({"sql": 1, "legal": 1}),
    }
    servers = [await serve_metrics(bodies, pod) for pod in bodies]
    kube = FakeKube(
        [endpoint_slice(pod, port) for pod, (_, port) in zip(bodies, servers, strict=True)]
    )
    watcher = AdapterStatusWatcher(kube=lambda: kube)
    subject = AdapterSubject(
        owner=endpoint("chat", ["sql", "legal"]),
        api_version="llmendpoints.dev/v1alpha1",
        kind="LLMEndpoint",
        service="chat",
        adapters=("sql", "legal"),
        ready_replicas=2,
    )
    try:
        block = await watcher.tick(subject)
        assert block == [
            {"name": "sql", "readyReplicas": 2, "replicas": 2},
            {
                "name": "legal",
                "readyReplicas": 1,
                "replicas": 2,
                "lastError": "1 of 2 replicas: no adapter_config.json",
            },
        ]
        assert kube.patches == [("LLMEndpoint", "chat", {"status": {"adapters": block}}, "status")]
        await watcher.tick(subject)
        assert len(kube.patches) == 1  # nothing changed, nothing written

        bodies["chat-a"] = pod_metrics({"sql": 1, "legal": 1})
        fixed = await watcher.tick(subject)
        assert [e.get("lastError") for e in fixed] == [None, None] and len(kube.patches) == 2

        # No ready replica: nothing to read (no API call), every adapter on 0 of 0.
        lists = kube.lists
        idle = AdapterSubject(**{**subject.__dict__, "ready_replicas": 0})
        assert await watcher.tick(idle) == [
            {"name": "sql", "readyReplicas": 0, "replicas": 0},
            {"name": "legal", "readyReplicas": 0, "replicas": 0},
        ]
        assert kube.lists == lists
    finally:
        await watcher.close()
        for runner, _ in servers:
            await runner.cleanup()
