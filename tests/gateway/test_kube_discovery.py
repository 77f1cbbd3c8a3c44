"""Kubernetes discovery: the real gateway process against kmock's in-memory Kubernetes API.

LLMEndpoints give endpoint names, served models, routing and key Secrets; EndpointSlices give
ready pods (stand-in backends here: discovery is what is under test). Every change is made
through the API, so the gateway sees it the way it would in a cluster: on its watch streams.
"""

from __future__ import annotations

import asyncio
import base64
import re
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import kmock
import pytest
import pytest_asyncio
from integration.kube_emulator import LLMEP, Cluster, endpoint

from .harness import Process, launch_gateway, launch_standin

pytestmark = [pytest.mark.kube, pytest.mark.asyncio(loop_scope="module")]

NS = "models"
SLICES = "discovery.k8s.io/v1/endpointslices"
SECRETS = "v1/secrets"
KEYS_NS = "gateway-keys"  # where labelled key Secrets live (the gateway's own namespace)


@pytest.fixture(scope="module")
def logs(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("kube-gateway")


@pytest.fixture(scope="module")
def standins(logs):
    procs = {name: launch_standin(logs, name) for name in ("a1", "a2", "b1")}
    for proc in procs.values():
        proc.wait_http("/ready")
    yield procs
    for proc in procs.values():
        proc.stop()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def cluster() -> AsyncIterator[Cluster]:
    async with Cluster() as cluster:
        cluster.kmock.resources[SECRETS] = kmock.ResourceInfo(
            kind="Secret",
            namespaced=True,
            verbs={"get", "list", "watch", "create", "patch", "delete"},
        )
        yield cluster


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def gateway(cluster: Cluster, logs: Path) -> AsyncIterator[Process]:
    gw = launch_gateway(
        logs,
        KUBECONFIG=str(cluster.write_kubeconfig(logs / "kubeconfig")),
        GATEWAY_KEYS_NAMESPACE=KEYS_NS,
        GATEWAY_REQUIRE_KEYS="false",  # endpoints without keys stay open in this module
        GATEWAY_ENDPOINT_KEYS="true",  # and an endpoint's own keys (apiKeysSecretRef) count
    )
    try:
        await _until(lambda: _status(gw, "/health") == 200, "the gateway listens")
        yield gw
    finally:
        gw.stop()


def _status(gw: Process, path: str) -> int:
    try:
        return httpx.get(gw.url + path, timeout=2).status_code
    except httpx.TransportError:
        return 0


async def _until(predicate, what: str, timeout: float = 20.0):
    deadline = time.monotonic() + timeout
    while True:
        result = await asyncio.to_thread(predicate)
        if result:
            return result
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


def _secret(name: str, *keys: str) -> dict:
    data = base64.b64encode("\n".join(keys).encode()).decode()
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": name, "namespace": NS},
        "data": {"keys": data},
    }


def _slice(
    name: str, service: str, backend: Process, ready: bool = True, operator: bool = True
) -> dict:
    """An EndpointSlice as the EndpointSlice controller writes it for the operator's Service:
    the Service's labels copied (managed-by, endpoint), the pod in targetRef."""
    labels = {"kubernetes.io/service-name": service}
    if operator:
        labels |= {"app.kubernetes.io/managed-by": "llmendpoints-operator",
                   "llmendpoints.dev/endpoint": service}  # fmt: skip
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {"name": name, "namespace": NS, "labels": labels},
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": backend.port, "protocol": "TCP"}],
        "endpoints": [
            {
                "addresses": ["127.0.0.1"],
                "conditions": {"ready": ready},
                "targetRef": {"kind": "Pod", "namespace": NS, "name": f"{name}-pod"},
            }
        ],
    }


def _models(gw: Process, key: str) -> dict[str, int]:
    response = httpx.get(
        gw.url + "/v1/models", headers={"authorization": f"Bearer {key}"}, timeout=5
    )
    return {m["id"]: m["ready_replicas"] for m in response.json().get("data", [])}


def _chat(gw: Process, key: str, model: str, timeout: float = 10) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
    return httpx.post(
        gw.url + "/v1/chat/completions",
        json=body,
        timeout=timeout,
        headers={"authorization": f"Bearer {key}"},
    )


async def test_endpoints_pods_and_keys_come_from_the_cluster(cluster, gateway, standins):
    await cluster.create(SECRETS, NS, _secret("alpha-keys", "ka"))
    await cluster.create(SECRETS, NS, _secret("beta-keys", "kb"))
    api = {"apiKeysSecretRef": {"name": "alpha-keys", "key": "keys"}}
    await cluster.create(
        LLMEP,
        NS,
        endpoint(
            "alpha", NS, {"model": {"name": "m", "servedModelName": "alpha-model"}, "api": api}
        ),
    )
    api = {"apiKeysSecretRef": {"name": "beta-keys", "key": "keys"}}
    await cluster.create(
        LLMEP,
        NS,
        endpoint("beta", NS, {"model": {"name": "m"}, "api": api, "routing": "round-robin"}),
    )
    await cluster.create(SLICES, NS, _slice("alpha-1", "alpha", standins["a1"]))
    await cluster.create(SLICES, NS, _slice("alpha-2", "alpha", standins["a2"]))
    await cluster.create(SLICES, NS, _slice("beta-1", "beta", standins["b1"]))

    # A slice of some other Service of the same name (not the operator's) is never routed to.
    await cluster.create(SLICES, NS, _slice("alpha-x", "alpha", standins["b1"], operator=False))

    await _until(lambda: _models(gateway, "ka") == {"alpha-model": 2}, "alpha with 2 ready pods")
    await _until(lambda: _models(gateway, "kb") == {"beta": 1}, "beta (its name is its model)")
    for _ in range(6):
        answer = await asyncio.to_thread(_chat, gateway, "ka", "alpha-model")
        assert answer.json()["replica"] in ("a1", "a2")
    # The endpoint is "<namespace>/<name>" in metrics, and replicas are named by their pods.
    text = httpx.get(gateway.metrics_url).text
    assert f'llmendpoints_gateway_ready_replicas{{endpoint="{NS}/alpha"}} 2.0' in text
    assert re.search(
        r'in_flight_requests\{endpoint="models/alpha",replica="alpha-[12]-pod"\}', text
    )
    assert "127.0.0.1" not in text
    assert (await asyncio.to_thread(_chat, gateway, "ka", "alpha-model")).status_code == 200
    assert (await asyncio.to_thread(_chat, gateway, "kb", "beta")).json()["replica"] == "b1"
    # A key of alpha is refused on beta and the other way round; no key at all is a 401.
    # a key of another endpoint: answered as if the model did not exist
    assert (await asyncio.to_thread(_chat, gateway, "ka", "beta")).status_code == 404
    assert (await asyncio.to_thread(_chat, gateway, "kb", "alpha-model")).status_code == 404
    assert (await asyncio.to_thread(_chat, gateway, "nope", "beta")).status_code == 401


async def test_pods_leaving_and_becoming_ready_reach_routing(cluster, gateway, standins):
    for name in ("alpha-1", "alpha-2"):
        await cluster.patch(
            SLICES,
            NS,
            name,
            {"endpoints": [{"addresses": ["127.0.0.1"], "conditions": {"ready": False}}]},
        )
    await _until(lambda: _models(gateway, "ka") == {"alpha-model": 0}, "alpha with no ready pod")
    held = asyncio.create_task(asyncio.to_thread(_chat, gateway, "ka", "alpha-model", 30))
    await _until(
        lambda: (
            f'llmendpoints_gateway_held_requests{{endpoint="{NS}/alpha"}} 1.0'
            in httpx.get(gateway.metrics_url).text
        ),
        "the request is held",
    )
    before = httpx.get(standins["a2"].url + "/stats").json()["requests"]
    await cluster.patch(
        SLICES,
        NS,
        "alpha-2",
        {"endpoints": [{"addresses": ["127.0.0.1"], "conditions": {"ready": True}}]},
    )
    response = await asyncio.wait_for(held, 10)
    assert response.status_code == 200 and response.json()["replica"] == "a2"
    assert httpx.get(standins["a2"].url + "/stats").json()["requests"] == before + 1


async def test_a_deleted_endpoint_is_gone(cluster, gateway):
    await cluster.delete(LLMEP, NS, "beta")
    await _until(lambda: _models(gateway, "kb") == {}, "beta gone")
    assert (await asyncio.to_thread(_chat, gateway, "kb", "beta")).status_code == 404


def _key_secret(name: str, **data: str) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {
            "name": name,
            "namespace": KEYS_NS,
            "labels": {"llmendpoints.dev/api-key": "true"},
        },
        "data": {k: base64.b64encode(v.encode()).decode() for k, v in data.items()},
    }


async def test_labelled_key_secrets_give_keys_with_limits_and_revocation_is_immediate(
    cluster, gateway, standins
):
    """Runs last: once a labelled key Secret exists every request needs a key."""
    await _until(lambda: _chat(gateway, "ka", "alpha-model").status_code == 200, "alpha serves")
    await cluster.create(
        SECRETS,
        KEYS_NS,
        _key_secret("team-a", key="sk-team-a", endpoints="alpha", requestsPerMinute="1000"),
    )
    # A Secret that is not a valid key is refused with a reason in the log, and is no key.
    await cluster.create(SECRETS, KEYS_NS, _key_secret("broken", key="sk-b", maxConcurrent="0"))
    await _until(
        lambda: _chat(gateway, "sk-team-a", "alpha-model").status_code == 200, "the new key works"
    )
    answer = await asyncio.to_thread(_chat, gateway, "sk-team-a", "alpha-model")
    assert answer.headers["x-ratelimit-limit-requests"] == "1000"
    assert (await asyncio.to_thread(_chat, gateway, "sk-b", "alpha-model")).status_code == 401
    assert "Secret gateway-keys/broken" in gateway.log() and "maxConcurrent" in gateway.log()
    # With gateway keys declared, a request without a key is a 401; an endpoint key still works.
    assert (
        httpx.post(gateway.url + "/v1/chat/completions", json={"model": "alpha-model"}).status_code
        == 401
    )
    # Revoked: deleting the Secret stops the key at once (the watch delivers it).
    await cluster.delete(SECRETS, KEYS_NS, "team-a")
    await _until(
        lambda: _chat(gateway, "sk-team-a", "alpha-model").status_code == 401,
        "the deleted key refused",
        timeout=5.0,
    )


async def test_a_rotated_token_is_read_again_on_401(cluster, logs, standins):
    """Bound ServiceAccount tokens expire and kubeconfig tokens rotate: on a 401 the gateway
    re-reads its credentials and carries on, without a restart."""
    accepted: dict[str, str | None] = {"token": "first"}

    def unauthorized(request: kmock.Request) -> bool:
        """The gateway's requests (kubernetes-asyncio's) without the current token; the test's
        own writes pass."""
        token = accepted["token"]
        if token is None or "OpenAPI-Generator" not in request.headers.get("User-Agent", ""):
            return False
        return request.headers.get("Authorization") != f"Bearer {token}"

    def kubeconfig(token: str) -> Path:
        path = cluster.write_kubeconfig(logs / "kubeconfig-token")
        text = path.read_text().replace("user: {}", f"user: {{token: {token}}}")
        path.write_text(text)
        return path

    cluster.kmock[unauthorized] << kmock.KubernetesError(
        status=401, reason="Unauthorized", message="Unauthorized"
    )
    try:
        gw = launch_gateway(
            logs,
            KUBECONFIG=str(kubeconfig("first")),
            GATEWAY_KEYS_NAMESPACE="token-keys",
            GATEWAY_REQUIRE_KEYS="false",
            GATEWAY_ENDPOINT_KEYS="true",  # the endpoints' own keys, as the module's gateway
        )
        try:
            await _until(lambda: _status(gw, "/health") == 200, "the gateway listens")
            await _until(lambda: "alpha-model" in _models(gw, "ka"), "alpha discovered")
            # The token rotates: the old one is refused from now on.
            accepted["token"] = "second"
            kubeconfig("second")
            await cluster.create(SECRETS, NS, _secret("gamma-keys", "kg"))
            api = {"apiKeysSecretRef": {"name": "gamma-keys", "key": "keys"}}
            await cluster.create(
                LLMEP, NS, endpoint("gamma", NS, {"model": {"name": "m"}, "api": api})
            )
            await cluster.create(SLICES, NS, _slice("gamma-1", "gamma", standins["b1"]))
            # Reading gamma's key Secret got a 401, re-read the kubeconfig, and succeeded.
            await _until(lambda: _chat(gw, "kg", "gamma").status_code == 200, "gamma's key works")
            assert "401 Unauthorized; re-reading credentials" in gw.log()
        finally:
            gw.stop()
    finally:
        accepted["token"] = None  # the API is open again for the other tests
        await cluster.delete(LLMEP, NS, "gamma")
