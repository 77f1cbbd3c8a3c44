"""The gateway's Kubernetes client policy, without a cluster: which slices are routed to, backoff,
resuming a watch from the last resourceVersion, re-listing on 410, re-reading credentials on 401.

The API calls are stand-ins answering as the API server does (a list, then a stream of JSON
lines); kubernetes-asyncio's own Watch reads them. tests/gateway/test_kube_discovery.py runs the
real gateway process against an in-memory API server.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from kubernetes_asyncio.client.exceptions import ApiException
from llmendpoints_gateway.discovery import kube
from llmendpoints_gateway.discovery.kube import (
    Backoff,
    KubeAuth,
    KubeDiscovery,
    Watched,
    is_operator_slice,
    slice_backends,
    slice_pods,
)
from llmendpoints_gateway.keys import KeyRing
from llmendpoints_gateway.metrics import GatewayMetrics
from llmendpoints_gateway.registry import Registry

OPERATOR_LABELS = {
    "kubernetes.io/service-name": "chat",
    "app.kubernetes.io/managed-by": "llmendpoints-operator",
    "llmendpoints.dev/endpoint": "chat",
}


def _slice(labels: dict[str, str], *endpoints: dict[str, Any], ipv6: bool = False) -> dict:
    return {
        "metadata": {"namespace": "ns", "name": "chat-abc", "labels": labels},
        "addressType": "IPv6" if ipv6 else "IPv4",
        "ports": [{"name": "http", "port": 8000}],
        "endpoints": list(endpoints),
    }


def test_only_the_operators_slices_are_routed_to_and_replicas_are_named_by_pod():
    ready = {"addresses": ["10.0.0.7"], "conditions": {"ready": True},
             "targetRef": {"kind": "Pod", "name": "chat-7d9f-x2"}}  # fmt: skip
    gone = {"addresses": ["10.0.0.8"], "conditions": {"ready": False}}
    unnamed = {"addresses": ["10.0.0.9"]}  # no condition: ready; no targetRef: its address
    assert slice_backends(_slice(OPERATOR_LABELS, ready, gone, unnamed)) == (
        "chat",
        {"http://10.0.0.7:8000": "chat-7d9f-x2", "http://10.0.0.9:8000": "10.0.0.9"},
    )
    assert slice_backends(_slice(OPERATOR_LABELS, {"addresses": ["fd00::1"]}, ipv6=True)) == (
        "chat",
        {"http://[fd00::1]:8000": "fd00::1"},
    )
    # Another Service's slice (same name, not the operator's), or one the operator did not
    # label as an endpoint's, is not an endpoint's replica.
    other = {"kubernetes.io/service-name": "chat"}
    assert not is_operator_slice(_slice(other, ready))
    assert slice_backends(_slice(other, ready)) == (None, {})
    half = {**OPERATOR_LABELS, "llmendpoints.dev/endpoint": ""}
    assert not is_operator_slice(_slice(half, ready))


def test_engine_load_is_read_on_each_pods_control_port_from_the_slice():
    """The slice's `control` port (the operator's Service names it so) is where the gateway
    reads a pod's engine load: never the port that serves requests."""
    ready = {"addresses": ["10.0.0.7"], "targetRef": {"kind": "Pod", "name": "chat-7d9f-x2"}}
    with_control = {
        **_slice(OPERATOR_LABELS, ready),
        "ports": [{"name": "http", "port": 8000}, {"name": "control", "port": 8001}],
    }
    assert slice_pods(with_control) == (
        "chat",
        {"http://10.0.0.7:8000": ("chat-7d9f-x2", "http://10.0.0.7:8001")},
    )
    assert slice_pods(_slice(OPERATOR_LABELS, ready)) == (
        "chat",
        {"http://10.0.0.7:8000": ("chat-7d9f-x2", None)},  # no control port: the main one
    )
    ipv6 = {**with_control, "addressType": "IPv6", "endpoints": [{"addresses": ["fd00::1"]}]}
    assert slice_pods(ipv6)[1] == {"http://[fd00::1]:8000": ("fd00::1", "http://[fd00::1]:8001")}

    from llmendpoints_operator import manifests, spec

    service = manifests.build_service(spec.parse("chat", "ns", {"model": {"name": "m"}}))
    ports = {p["name"]: p["port"] for p in service["spec"]["ports"]}
    assert kube.CONTROL_PORT_NAME in ports and kube.PORT_NAME in ports


def test_the_selector_is_the_operators_labels():
    from llmendpoints_operator import manifests

    assert kube.LABEL_MANAGED_BY == manifests.LABEL_MANAGED_BY
    assert kube.MANAGED_BY == manifests.MANAGED_BY
    assert kube.LABEL_ENDPOINT == manifests.LABEL_ENDPOINT
    # Every Service the operator builds carries them (and so do its EndpointSlices).
    from llmendpoints_operator import spec

    service = manifests.build_service(spec.parse("chat", "ns", {"model": {"name": "m"}}))
    labels = service["metadata"]["labels"]
    assert labels[kube.LABEL_MANAGED_BY] == kube.MANAGED_BY and labels[kube.LABEL_ENDPOINT]


def test_backoff_grows_to_its_cap_with_jitter_and_resets():
    low, high = Backoff(rand=lambda: 0.0), Backoff(rand=lambda: 1.0)
    lows = [low.next() for _ in range(10)]
    highs = [high.next() for _ in range(10)]
    assert highs[:4] == [0.5, 1.0, 2.0, 4.0] and highs[-1] == 30.0  # capped
    assert lows[:4] == [0.25, 0.5, 1.0, 2.0] and lows[-1] == 15.0  # never below half
    high.reset()
    assert high.next() == 0.5


# ------------------------------------------------------------------ the watch loop


class _Lines:
    def __init__(self, lines: list[bytes]):
        self._lines = lines

    async def readline(self) -> bytes:
        await asyncio.sleep(0)
        return self._lines.pop(0) if self._lines else b""


class _Response:
    """What kubernetes-asyncio returns for `_preload_content=False`: an aiohttp response."""

    def __init__(self, status: int = 200, body: Any = None, lines: list[bytes] = ()):
        self.status, self.reason, self._body = status, "OK" if status == 200 else "Error", body
        self.content = _Lines(list(lines))

    async def json(self) -> Any:
        return self._body

    def release(self) -> None:
        pass

    def close(self) -> None:
        pass


def _event(kind: str, name: str, version: str) -> bytes:
    obj = {"metadata": {"namespace": "ns", "name": name, "resourceVersion": version}}
    return json.dumps({"type": kind, "object": obj}).encode() + b"\n"


class _Api:
    """A list call: answers lists and watches from a script, records what was asked."""

    def __init__(self, script: list[Any]):
        self.script = script
        self.calls: list[dict[str, Any]] = []

    async def __call__(self, **kwargs: Any) -> _Response:
        self.calls.append({k: v for k, v in kwargs.items() if not k.startswith("_")})
        step = self.script.pop(0) if self.script else asyncio.Event().wait()
        if isinstance(step, BaseException):
            raise step
        if asyncio.iscoroutine(step):
            await step  # blocks: the test is over
        return step


def _discovery(monkeypatch: pytest.MonkeyPatch) -> tuple[KubeDiscovery, list[float]]:
    slept: list[float] = []

    async def sleep(seconds: float) -> None:
        slept.append(seconds)
        await asyncio.sleep(0)

    monkeypatch.setattr(kube, "_sleep", sleep)
    registry = Registry(GatewayMetrics(), 10, 1.25)
    return KubeDiscovery(
        registry, KeyRing.from_settings(None, None, None), keys_namespace="k"
    ), slept


async def _run(discovery: KubeDiscovery, watched: Watched, until) -> None:
    task = asyncio.create_task(discovery._watch(watched))
    try:
        for _ in range(200):
            if until():
                return
            await asyncio.sleep(0.001)
        raise AssertionError("the watch loop did not get there")
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_a_watch_resumes_from_the_last_version_it_saw(monkeypatch):
    discovery, slept = _discovery(monkeypatch)
    seen: list[tuple[str, str]] = []

    async def handler(kind: str, obj: dict) -> None:
        seen.append((kind, obj["metadata"]["name"]))

    listing = {"metadata": {"resourceVersion": "10"}, "items": []}
    api = _Api([
        _Response(body=listing),
        _Response(lines=[_event("ADDED", "a", "11"), _event("MODIFIED", "a", "12")]),  # ends
        ConnectionResetError("the connection dropped"),
        _Response(lines=[_event("DELETED", "a", "13")]),
    ])  # fmt: skip
    watched = Watched("things", api, handler, list)
    await _run(discovery, watched, lambda: len(api.calls) >= 5)
    assert seen == [("ADDED", "a"), ("MODIFIED", "a"), ("DELETED", "a")]
    versions = [c.get("resource_version") for c in api.calls]
    # list, watch from the list's version, resume from 12 after the stream ended, again from 12
    # after the connection dropped, from 13 after the next stream ended: never a re-list.
    assert versions == [None, "10", "12", "12", "13"]
    assert [c.get("watch") for c in api.calls] == [None, True, True, True, True]
    assert len(slept) == 1 and 0.25 <= slept[0] <= 0.5  # only the failure waited


async def test_410_gone_lists_again_and_deletes_what_vanished(monkeypatch):
    discovery, slept = _discovery(monkeypatch)
    known = {("ns", "old"): True}
    seen: list[tuple[str, str]] = []

    async def handler(kind: str, obj: dict) -> None:
        key = (obj["metadata"]["namespace"], obj["metadata"]["name"])
        seen.append((kind, key[1]))
        if kind == "DELETED":
            known.pop(key, None)
        else:
            known[key] = True

    expired = json.dumps({"type": "ERROR", "object": {"kind": "Status", "code": 410,
                          "reason": "Expired", "message": "too old resource version"}})  # fmt: skip
    api = _Api([
        _Response(body={"metadata": {"resourceVersion": "5"}, "items": [_item("old", "5")]}),
        _Response(lines=[expired.encode() + b"\n"]),
        _Response(body={"metadata": {"resourceVersion": "90"}, "items": [_item("new", "90")]}),
    ])  # fmt: skip
    watched = Watched("things", api, handler, lambda: list(known))
    await _run(discovery, watched, lambda: len(api.calls) >= 4)
    assert [c.get("resource_version") for c in api.calls] == [None, "5", None, "90"]
    assert seen == [("ADDED", "old"), ("DELETED", "old"), ("ADDED", "new")]
    assert slept == []  # a re-list is not a failure


def _item(name: str, version: str) -> dict:
    return {"metadata": {"namespace": "ns", "name": name, "resourceVersion": version}}


async def test_401_reads_the_credentials_again_then_backs_off(monkeypatch):
    discovery, slept = _discovery(monkeypatch)
    reloads: list[int] = []

    async def reload() -> None:
        reloads.append(1)

    monkeypatch.setattr(discovery.auth, "reload", reload)

    async def handler(kind: str, obj: dict) -> None:
        pass

    api = _Api([
        ApiException(status=401, reason="Unauthorized"),
        ApiException(status=401, reason="Unauthorized"),
        ApiException(status=500, reason="Internal Server Error"),
        _Response(body={"metadata": {"resourceVersion": "1"}, "items": []}),
    ])  # fmt: skip
    watched = Watched("things", api, handler, list)
    await _run(discovery, watched, lambda: len(api.calls) >= 5)
    # The list's 401 re-read the credentials and retried at once; its second 401 re-read
    # them again and waited; the 500 waited longer; then the list and the watch went through.
    assert len(reloads) == 2
    assert len(slept) == 2 and 0.25 <= slept[0] <= 0.5 <= slept[1] <= 1.0


async def test_an_error_answer_to_a_read_is_an_error_not_an_object(monkeypatch):
    discovery, _ = _discovery(monkeypatch)
    forbidden = _Response(status=403, body={"kind": "Status", "message": "secrets is forbidden"})
    with pytest.raises(ApiException) as raised:
        await discovery._call(_Api([forbidden]))
    assert raised.value.status == 403 and "forbidden" in raised.value.reason


# ------------------------------------------------------------------ credentials


def _service_account(root: Path, token: str) -> Path:
    root.mkdir(exist_ok=True)
    (root / "token").write_text(token)
    (root / "ca.crt").write_text("-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n")
    (root / "namespace").write_text("llm-system")
    return root


async def test_in_a_pod_the_rotated_token_is_read_again(tmp_path):
    sa = _service_account(tmp_path / "sa", "first")
    env = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"}
    auth = KubeAuth(env, sa_dir=sa)
    assert auth.in_cluster
    await auth.load()
    assert auth.configuration.host == "https://10.96.0.1:443"
    assert auth.configuration.api_key["BearerToken"] == "Bearer first"
    (sa / "token").write_text("second")  # the kubelet rotated the projected token
    await auth.reload()  # on a 401
    assert await auth.configuration.get_api_key_with_prefix("BearerToken") == "Bearer second"


async def test_an_explicit_kubeconfig_wins_over_the_service_account(tmp_path):
    sa = _service_account(tmp_path / "sa", "pod-token")
    config = tmp_path / "kubeconfig"
    config.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: c\n"
        "clusters: [{name: k, cluster: {server: 'http://127.0.0.1:1'}}]\n"
        "users: [{name: u, user: {token: file-token}}]\n"
        "contexts: [{name: c, context: {cluster: k, user: u}}]\n"
    )
    env = {"KUBECONFIG": str(config), "KUBERNETES_SERVICE_HOST": "10.96.0.1",
           "KUBERNETES_SERVICE_PORT": "443"}  # fmt: skip
    auth = KubeAuth(env, sa_dir=sa)
    assert not auth.in_cluster
    await auth.load()
    assert auth.configuration.host == "http://127.0.0.1:1"
    assert await auth.configuration.get_api_key_with_prefix("BearerToken") == "Bearer file-token"
