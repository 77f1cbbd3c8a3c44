"""The fit checker and the hub client: a stand-in hub over HTTP on loopback, a fake cluster.

What a reconcile relies on: one hub read per model and revision however often it asks, a bound on
how long it waits (then Unknown, and the read finishes for the next reconcile), a failed read
retried later, the token Secret read only when allowed, and never an exception.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
from collections.abc import Iterator
from typing import Any

import model_shapes
import pytest
from fake_hub import HeaderHub, VirtualRepo
from llmendpoints_operator import kube
from llmendpoints_operator.config import OperatorSettings
from llmendpoints_operator.fit.checker import FitChecker
from llmendpoints_operator.hub import HubClient, HubError
from llmendpoints_operator.spec import parse

MODEL = "meta-llama/Llama-3.1-8B"
H100 = {
    "metadata": {
        "name": "h100",
        "labels": {
            "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3",
            "nvidia.com/gpu.memory": "81559",
        },
    },
    "status": {"allocatable": {"nvidia.com/gpu": "8"}},
}


def _repo(**kwargs: Any) -> VirtualRepo:
    sharded = model_shapes.shards(model_shapes.llama_tensors(model_shapes.LLAMA_31_8B), 4)
    headers = {f: model_shapes.header(ts) for f, ts in sharded.items()}
    return VirtualRepo(model_shapes.LLAMA_31_8B, headers, model_shapes.index(sharded), **kwargs)


@pytest.fixture
def hub() -> Iterator[HeaderHub]:
    stand_in = HeaderHub()
    stand_in.repos[MODEL] = _repo()
    stand_in.repos["acme/private"] = _repo(token="hf_secret")
    stand_in.repos["acme/slow"] = _repo(delay=1.5)
    with stand_in:
        yield stand_in


class FakeCluster:
    def __init__(self, nodes: list[dict[str, Any]], secrets: dict[tuple[str, str], str]):
        self.nodes, self.secrets = nodes, secrets
        self.node_lists = 0
        self.secret_reads: list[tuple[str, str]] = []

    async def list_nodes(self) -> list[dict[str, Any]]:
        self.node_lists += 1
        return self.nodes

    async def secret_value(self, namespace: str, name: str, key: str) -> str:
        self.secret_reads.append((namespace, name))
        if (namespace, name) not in self.secrets:
            raise kube.ApiError(403, "Forbidden", f'secrets "{name}" is forbidden')
        return self.secrets[(namespace, name)]


def _checker(hub: HeaderHub, cluster: FakeCluster, clock=None, **settings: Any) -> FitChecker:
    plain = {"hf_endpoint": hub.url, "fit_timeout_seconds": 5.0}
    return FitChecker(
        cluster=lambda: cluster,
        hub=HubClient(timeout=5),
        settings=OperatorSettings(**{**plain, **settings}),
        **({"clock": clock} if clock else {}),
    )


def _ep(model: str = MODEL, **spec: Any):
    return parse("e", "ns", {"model": {"name": model}, **spec})


async def test_the_hub_is_read_once_per_model_and_revision(hub: HeaderHub) -> None:
    cluster = FakeCluster([H100], {})
    checker = _checker(hub, cluster)
    first = await checker.check(_ep(engine={"maxModelLen": 8192}))
    again = await checker.check(_ep(engine={"maxModelLen": 16384}))  # a spec change: re-checked
    assert first.status == again.status == "True"
    assert first.numbers["maxModelLen"] == 8192 and again.numbers["maxModelLen"] == 16384
    assert len(hub.shard_requests(MODEL)) == 2 * 4  # 4 shards, two ranges each, once
    assert cluster.node_lists == 1
    pinned = {"model": {"name": MODEL, "revision": hub.repos[MODEL].commit}}
    other = await checker.check(parse("e", "ns", pinned))
    assert other.status == "True"
    assert len(hub.shard_requests(MODEL)) == 2 * 2 * 4  # another revision: read again
    assert hub.violations == []
    await checker.close()


async def test_a_slow_hub_is_unknown_in_time_and_the_next_check_has_the_answer(
    hub: HeaderHub,
) -> None:
    checker = _checker(hub, FakeCluster([H100], {}), fit_timeout_seconds=0.3)
    first = await checker.check(_ep("acme/slow"))
    assert (first.status, first.reason) == ("Unknown", "HubTimeout")
    assert "within 0.3 s" in first.message
    await asyncio.sleep(2.0)  # the read went on in the background
    assert (await checker.check(_ep("acme/slow"))).status == "True"
    await checker.close()


async def test_a_private_model_is_read_with_the_token_only_when_allowed(hub: HeaderHub) -> None:
    spec = {"model": {"name": "acme/private", "hfTokenSecretRef": {"name": "hf", "key": "t"}}}
    ep = parse("e", "ns", spec)
    cluster = FakeCluster([H100], {("ns", "hf"): "hf_secret"})
    not_allowed = await _checker(hub, cluster).check(ep)
    assert (not_allowed.status, not_allowed.reason) == ("Unknown", "PrivateModel")
    assert "LLMEP_OPERATOR_FIT_READ_TOKEN_SECRETS" in not_allowed.message
    assert cluster.secret_reads == []
    allowed = await _checker(hub, cluster, fit_read_token_secrets=True).check(ep)
    assert allowed.status == "True"
    assert cluster.secret_reads == [("ns", "hf")]
    forbidden = FakeCluster([H100], {})
    refused = await _checker(hub, forbidden, fit_read_token_secrets=True).check(ep)
    assert refused.reason == "PrivateModel"
    assert "may not read Secret hf: 403" in refused.message


async def test_what_the_check_cannot_know_is_unknown_and_never_an_exception(
    hub: HeaderHub,
) -> None:
    checker = _checker(hub, FakeCluster([], {}))
    no_nodes = await checker.check(_ep())
    assert (no_nodes.status, no_nodes.reason) == ("Unknown", "GPUMemoryUnknown")
    assert "spec.resources.gpuMemory" in no_nodes.message
    local = await checker.check(_ep("/models/llama", resources={"gpuMemory": "80Gi"}))
    assert (local.status, local.reason) == ("Unknown", "NotOnHub")
    cpu = await checker.check(_ep(resources={"gpus": 0}))
    assert cpu.reason == "NoGPU"
    elsewhere = _ep(
        resources={"gpuMemory": "80Gi"},
        engine={"env": [{"name": "HF_ENDPOINT", "value": "http://169.254.169.254"}]},
    )
    assert (await checker.check(elsewhere)).reason == "HubNotAllowed"  # never contacted
    missing = await checker.check(_ep("acme/nothing", resources={"gpuMemory": "80Gi"}))
    assert (missing.status, missing.reason) == ("Unknown", "ModelNotFound")

    class Broken(FakeCluster):
        async def list_nodes(self) -> list[dict[str, Any]]:
            raise RuntimeError("boom")

    broken = await _checker(hub, Broken([], {})).check(_ep())
    assert (broken.status, broken.reason) == ("Unknown", "CheckFailed")
    assert "boom" in broken.message
    assert await _checker(hub, FakeCluster([], {}), fit_check=False).check(_ep()) is None


async def test_a_hub_the_admin_allows_is_read_for_the_endpoints_that_name_it(
    hub: HeaderHub,
) -> None:
    mirror = HeaderHub()
    mirror.repos[MODEL] = _repo()
    with mirror:
        ep = _ep(engine={"env": [{"name": "HF_ENDPOINT", "value": mirror.url + "/"}]})
        checker = _checker(hub, FakeCluster([H100], {}), fit_allowed_hubs=mirror.url)
        assert (await checker.check(ep)).status == "True"
        await checker.close()
    assert mirror.shard_requests(MODEL) and not hub.shard_requests(MODEL)


async def test_a_failed_read_is_retried_after_a_minute(hub: HeaderHub) -> None:
    now = [0.0]
    checker = _checker(hub, FakeCluster([H100], {}), clock=lambda: now[0])
    assert (await checker.check(_ep("acme/later"))).reason == "ModelNotFound"
    hub.repos["acme/later"] = _repo()
    assert (await checker.check(_ep("acme/later"))).reason == "ModelNotFound"  # cached
    now[0] = 61.0
    assert (await checker.check(_ep("acme/later"))).status == "True"
    await checker.close()


# --- the hub client ---------------------------------------------------------------------------


async def test_the_client_reads_headers_and_pins_the_commit(hub: HeaderHub) -> None:
    client = HubClient()
    files = await client.model(hub.url, MODEL, None, None)
    await client.close()
    assert sum(t.nbytes for t in files.tensors) == model_shapes.LLAMA_31_8B_TOTAL
    assert files.commit == hub.repos[MODEL].commit
    # every request after config.json names the commit, not the branch
    assert all(f"/resolve/{files.commit}/" in s.path for s in hub.seen[1:] if "/resolve/" in s.path)


async def test_a_model_without_an_index_is_one_file(hub: HeaderHub) -> None:
    single = _repo()
    header = model_shapes.header(model_shapes.llama_tensors(model_shapes.LLAMA_31_8B))
    hub.repos["acme/one"] = VirtualRepo(single.config, {"model.safetensors": header})
    client = HubClient()
    files = await client.model(hub.url, "acme/one", None, None)
    await client.close()
    assert sum(t.nbytes for t in files.tensors) == model_shapes.LLAMA_31_8B_TOTAL


async def test_hub_errors_say_what_is_wrong(hub: HeaderHub) -> None:
    client = HubClient()
    with pytest.raises(HubError, match="no model acme/none") as missing:
        await client.model(hub.url, "acme/none", None, None)
    assert missing.value.kind == "not_found"
    with pytest.raises(HubError, match="has no revision v9") as revision:
        await client.model(hub.url, MODEL, "v9", None)
    assert revision.value.kind == "not_found"
    with pytest.raises(HubError) as private:
        await client.model(hub.url, "acme/private", None, "wrong")
    assert private.value.kind == "unauthorized"
    with pytest.raises(HubError) as down:
        await client.model("http://127.0.0.1:1", MODEL, None, None)
    assert down.value.kind == "unavailable"
    await client.close()


def _ignores_range(header: bytes, weights: int) -> tuple[str, dict[str, int]]:
    """A hub whose server answers a Range request for the weights with the whole file (200)."""
    listener = socket.create_server(("127.0.0.1", 0))
    sent = {"bytes": 0}
    config = json.dumps(model_shapes.LLAMA_31_8B).encode()

    def answer(conn: socket.socket) -> None:
        path = conn.recv(65536).split(b" ", 2)[1].decode()
        if path.endswith("/config.json"):
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(config), config))
        elif path.endswith("/model.safetensors"):
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % (len(header) + weights))
            conn.sendall(header)
            chunk = b"\0" * (1 << 20)
            while sent["bytes"] < weights:
                conn.sendall(chunk)
                sent["bytes"] += len(chunk)
        else:
            conn.sendall(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn, contextlib.suppress(OSError):  # the client hangs up: what we want
                answer(conn)

    threading.Thread(target=serve, daemon=True).start()
    return f"http://127.0.0.1:{listener.getsockname()[1]}", sent


async def test_a_server_that_ignores_range_is_cut_off_after_the_header() -> None:
    header = model_shapes.header([("w", "BF16", [1024, 1024])])
    url, sent = _ignores_range(header, weights=1 << 30)
    client = HubClient(timeout=10)
    files = await client.model(url, "acme/cdn", None, None)
    await client.close()
    assert [t.nbytes for t in files.tensors] == [2 << 20]
    await asyncio.sleep(0.5)
    assert sent["bytes"] < 64 << 20, "the client kept reading weight bytes"
