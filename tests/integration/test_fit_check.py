"""Will it fit? The real operator, an emulated API server with GPU nodes labelled as NVIDIA's GPU
feature discovery labels them, and a stand-in hub over HTTP on loopback serving config.json, the
safetensors index and the shard headers of Llama-3-70B and Llama-3.1-8B -- and no weight bytes.

In the order a user meets it: a 70B bf16 model on one H100 80GB is refused (ModelFits False, what
to change, no Deployment, no pods); on four H100s with tensor parallel 4 it fits, with the
headers' exact sum and 327,680 KV cache bytes per token in status.fit; an 8B model with
maxModelLen 131072 on one L4 is refused naming maxModelLen; a GPU without a memory label is
Unknown and rolls out, and spec.resources.gpuMemory then checks it; a private model is read
with the endpoint's token; a slow hub is Unknown within the operator's timeout and rolls out;
fixing a refused spec rolls it out. Throughout, the hub never sees a request for a weight byte.

One emulator, hub and operator for the module; the tests run in file order and build on each
other.
"""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator, Iterator
from typing import Any

import model_shapes
import pytest
import pytest_asyncio
from fake_hub import HeaderHub, VirtualRepo
from ports import free_port

from .kube_emulator import LLMEP, Cluster, Operator, endpoint, until

pytestmark = [pytest.mark.kube, pytest.mark.asyncio(loop_scope="module")]

NS = "fit"
HUB_PORT = free_port()
TOKEN = "hf_private_token"
OPERATOR_ENV = {
    "LLMEP_OPERATOR_HF_ENDPOINT": f"http://127.0.0.1:{HUB_PORT}",
    "LLMEP_OPERATOR_FIT_TIMEOUT_SECONDS": "3",
    "LLMEP_OPERATOR_FIT_READ_TOKEN_SECRETS": "true",
}
LLAMA_70B = "meta-llama/Meta-Llama-3-70B"
LLAMA_8B = "meta-llama/Llama-3.1-8B"
PRIVATE = "acme/private-8b"
SLOW = "acme/slow-8b"
GPU_TAINT = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}
TOLERATE_GPUS = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]


def _repo(config: dict[str, Any], shards: int, **kwargs: Any) -> VirtualRepo:
    sharded = model_shapes.shards(model_shapes.llama_tensors(config), shards)
    headers = {file: model_shapes.header(tensors) for file, tensors in sharded.items()}
    return VirtualRepo(config=config, headers=headers, index=model_shapes.index(sharded), **kwargs)


@pytest.fixture(scope="module", autouse=True)
def hub() -> Iterator[HeaderHub]:
    stand_in = HeaderHub(port=HUB_PORT)
    stand_in.repos[LLAMA_70B] = _repo(model_shapes.LLAMA_3_70B, model_shapes.LLAMA_3_70B_SHARDS)
    stand_in.repos[LLAMA_8B] = _repo(model_shapes.LLAMA_31_8B, model_shapes.LLAMA_31_8B_SHARDS)
    stand_in.repos[PRIVATE] = _repo(model_shapes.LLAMA_31_8B, 4, token=TOKEN)
    stand_in.repos[SLOW] = _repo(model_shapes.LLAMA_31_8B, 4, delay=8.0)
    with stand_in:
        yield stand_in


def _node(name: str, pool: str, labels: dict[str, str], gpus: int) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": {"pool": pool, **labels}},
        "spec": {"taints": [GPU_TAINT]},
        "status": {"allocatable": {"cpu": "96", "nvidia.com/gpu": str(gpus)}},
    }


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def cluster() -> AsyncIterator[Cluster]:
    async with Cluster() as cluster:
        h100 = {
            "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3",
            "nvidia.com/gpu.memory": "81559",
            "nvidia.com/gpu.count": "8",
        }
        l4 = {
            "nvidia.com/gpu.product": "NVIDIA-L4",
            "nvidia.com/gpu.memory": "23034",
            "nvidia.com/gpu.count": "1",
        }
        # A GPU node whose product GPU feature discovery does not (yet) describe: no memory.
        future = {"nvidia.com/gpu.product": "NVIDIA-Future-GPU", "nvidia.com/gpu.count": "4"}
        for node in (
            _node("h100-a", "h100", h100, 8),
            _node("h100-b", "h100", h100, 8),
            _node("l4-a", "l4", l4, 1),
            _node("future-a", "future", future, 4),
        ):
            await cluster.create("v1/nodes", None, node)
        yield cluster


def _spec(model: str, pool: str, gpus: int = 1, **engine: Any) -> dict[str, Any]:
    return {
        "model": {"name": model},
        "engine": engine,
        "resources": {"gpus": gpus, "nodeSelector": {"pool": pool}, "tolerations": TOLERATE_GPUS},
    }


def _fits(cluster: Cluster, name: str) -> dict[str, Any] | None:
    obj = cluster.get(LLMEP, NS, name) or {}
    conditions = (obj.get("status") or {}).get("conditions") or []
    return next((c for c in conditions if c["type"] == "ModelFits"), None)


async def _checked(operator: Operator, cluster: Cluster, name: str, status: str) -> dict[str, Any]:
    condition = await until(
        operator,
        lambda: (c := _fits(cluster, name)) is not None and c["status"] == status and c,
        f"ModelFits {status} on {name}",
    )
    return condition


def _deployment(cluster: Cluster, name: str) -> dict[str, Any] | None:
    return cluster.get("apps/v1/deployments", NS, name)


def _event(cluster: Cluster, name: str, reason: str) -> bool:
    return any(e["reason"] == reason for e in cluster.events(NS, name))


def _headers_sum(hub: HeaderHub, repo: str) -> int:
    return sum(t.nbytes for header in hub.repos[repo].headers.values() for t in _parse(header))


def _parse(header: bytes):
    from llmendpoints_operator.fit.safetensors import header_length, parse_header

    length = header_length(header[:8], "shard")
    return parse_header(header[8 : 8 + length], "shard")


async def test_70b_on_one_h100_is_refused_with_what_to_change_and_no_pods(
    cluster: Cluster, operator: Operator, hub: HeaderHub
) -> None:
    await cluster.create("llmendpoints.dev/v1alpha1/llmendpoints", NS, endpoint(
        "llama-70b", NS, _spec(LLAMA_70B, "h100")
    ))  # fmt: skip
    condition = await _checked(operator, cluster, "llama-70b", "False")
    assert condition["reason"] == "WeightsDoNotFit"
    assert "the weights need 131.4 GiB per GPU" in condition["message"]
    assert "NVIDIA-H100-80GB-HBM3" in condition["message"]
    assert "spec.engine.tensorParallelSize" in condition["message"]
    status = cluster.get(LLMEP, NS, "llama-70b")["status"]
    ready = next(c for c in status["conditions"] if c["type"] == "Ready")
    assert (ready["status"], ready["reason"], status["phase"]) == (
        "False",
        "ModelDoesNotFit",
        "Failed",
    )
    assert status["fit"]["weightsBytes"] == model_shapes.LLAMA_3_70B_TOTAL
    # No pods are asked for: no Deployment at all (the Service, the admin key are there).
    assert _deployment(cluster, "llama-70b") is None
    assert "llama-70b" in cluster.names("v1/services", NS)
    await until(operator, lambda: _event(cluster, "llama-70b", "ModelDoesNotFit"), "the Event")


async def test_70b_on_four_h100s_with_tensor_parallel_fits_with_the_headers_numbers(
    cluster: Cluster, operator: Operator, hub: HeaderHub
) -> None:
    await cluster.create("llmendpoints.dev/v1alpha1/llmendpoints", NS, endpoint(
        "llama-70b-tp4", NS, _spec(LLAMA_70B, "h100", gpus=4, tensorParallelSize=4)
    ))  # fmt: skip
    condition = await _checked(operator, cluster, "llama-70b-tp4", "True")
    assert condition["reason"] == "Fits"
    fit = cluster.get(LLMEP, NS, "llama-70b-tp4")["status"]["fit"]
    assert fit["weightsBytes"] == _headers_sum(hub, LLAMA_70B) == model_shapes.LLAMA_3_70B_TOTAL
    assert fit["kvCacheBytesPerToken"] == 327_680
    assert fit["gpuMemoryBytes"] == 81559 * 2**20
    assert fit["gpuProduct"] == "NVIDIA-H100-80GB-HBM3"
    assert fit["gpus"] == 4
    # Every rank holds a quarter of each matrix and every norm whole.
    norms = sum(t.nbytes for h in hub.repos[LLAMA_70B].headers.values() for t in _parse(h)
                if len(t.shape) == 1)  # fmt: skip
    assert fit["weightsBytesPerGpu"] == (model_shapes.LLAMA_3_70B_TOTAL - norms) // 4 + norms
    assert fit["maxModelLen"] == 8192
    assert fit["kvCacheTokens"] >= 8192 and fit["maxConcurrentSequences"] >= 1
    assert fit["revision"] == hub.repos[LLAMA_70B].commit
    await until(operator, lambda: _deployment(cluster, "llama-70b-tp4"), "its Deployment")


async def test_8b_with_a_131072_context_on_one_l4_is_refused_naming_max_model_len(
    cluster: Cluster, operator: Operator
) -> None:
    await cluster.create("llmendpoints.dev/v1alpha1/llmendpoints", NS, endpoint(
        "llama-8b-long", NS, _spec(LLAMA_8B, "l4", maxModelLen=131072)
    ))  # fmt: skip
    condition = await _checked(operator, cluster, "llama-8b-long", "False")
    assert condition["reason"] == "ContextDoesNotFit"
    assert "maxModelLen 131,072" in condition["message"]
    assert "spec.engine.maxModelLen: " in condition["message"]
    assert "NVIDIA-L4" in condition["message"]
    fit = cluster.get(LLMEP, NS, "llama-8b-long")["status"]["fit"]
    assert fit["weightsBytes"] == model_shapes.LLAMA_31_8B_TOTAL
    assert fit["kvCacheBytesPerToken"] == 131_072
    assert fit["maxConcurrentSequences"] == 0
    assert _deployment(cluster, "llama-8b-long") is None


async def test_an_unknown_gpu_is_unknown_and_rolls_out_then_gpu_memory_checks_it(
    cluster: Cluster, operator: Operator
) -> None:
    await cluster.create("llmendpoints.dev/v1alpha1/llmendpoints", NS, endpoint(
        "on-future", NS, _spec(LLAMA_8B, "future", maxModelLen=8192)
    ))  # fmt: skip
    condition = await _checked(operator, cluster, "on-future", "Unknown")
    assert condition["reason"] == "GPUMemoryUnknown"
    assert "nvidia.com/gpu.memory" in condition["message"]
    assert "spec.resources.gpuMemory" in condition["message"]
    await until(operator, lambda: _deployment(cluster, "on-future"), "the rollout going on")
    await cluster.patch(
        "llmendpoints.dev/v1alpha1/llmendpoints", NS, "on-future",
        {"spec": {"resources": {"gpuMemory": "48Gi"}}},
    )  # fmt: skip
    condition = await _checked(operator, cluster, "on-future", "True")
    assert "spec.resources.gpuMemory" in condition["message"]
    assert cluster.get(LLMEP, NS, "on-future")["status"]["fit"]["gpuMemoryBytes"] == 48 * 2**30


async def test_a_private_model_is_read_with_the_endpoints_token(
    cluster: Cluster, operator: Operator, hub: HeaderHub
) -> None:
    secret = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": "hf-token", "namespace": NS},
        "data": {"token": base64.b64encode(TOKEN.encode()).decode()},
    }
    await cluster.create("v1/secrets", NS, secret)
    spec = _spec(PRIVATE, "h100")
    spec["model"]["hfTokenSecretRef"] = {"name": "hf-token", "key": "token"}
    await cluster.create(
        "llmendpoints.dev/v1alpha1/llmendpoints", NS, endpoint("private", NS, spec)
    )
    await _checked(operator, cluster, "private", "True")
    private = [s for s in hub.seen if s.path.startswith(f"/{PRIVATE}/")]
    assert private and all(s.authorization == f"Bearer {TOKEN}" for s in private)
    spec = _spec(PRIVATE, "h100")
    spec["model"]["hfTokenSecretRef"] = {"name": "no-such-secret", "key": "token"}
    await cluster.create("llmendpoints.dev/v1alpha1/llmendpoints", NS, endpoint(
        "private-no-token", NS, spec
    ))  # fmt: skip
    condition = await _checked(operator, cluster, "private-no-token", "Unknown")
    assert condition["reason"] == "PrivateModel"
    assert "no-such-secret" in condition["message"]
    await until(operator, lambda: _deployment(cluster, "private-no-token"), "the rollout")


async def test_a_slow_hub_is_unknown_within_the_timeout_and_rolls_out(
    cluster: Cluster, operator: Operator
) -> None:
    await cluster.create("llmendpoints.dev/v1alpha1/llmendpoints", NS, endpoint(
        "slow", NS, _spec(SLOW, "h100")
    ))  # fmt: skip
    condition = await _checked(operator, cluster, "slow", "Unknown")
    assert condition["reason"] == "HubTimeout"
    assert "within 3 s" in condition["message"]
    await until(operator, lambda: _deployment(cluster, "slow"), "the rollout going on")


async def test_fixing_a_refused_spec_rolls_it_out(cluster: Cluster, operator: Operator) -> None:
    await cluster.patch(
        "llmendpoints.dev/v1alpha1/llmendpoints", NS, "llama-8b-long",
        {"spec": {"engine": {"maxModelLen": 16384}}},
    )  # fmt: skip
    condition = await _checked(operator, cluster, "llama-8b-long", "True")
    assert "16,384" in condition["message"]
    await until(operator, lambda: _deployment(cluster, "llama-8b-long"), "its Deployment")
    await until(operator, lambda: _event(cluster, "llama-8b-long", "ModelFits"), "the Event")


async def test_no_weight_bytes_were_requested(hub: HeaderHub) -> None:
    """Only ranges inside each shard's header: bytes 0-7, then 8 to the header's end."""
    assert hub.violations == []
    for repo in (LLAMA_70B, LLAMA_8B):
        asked = hub.shard_requests(repo)
        shards = hub.repos[repo].headers
        assert {s.path.rsplit("/", 1)[1] for s in asked} == set(shards)
        for seen in asked:
            header = shards[seen.path.rsplit("/", 1)[1]]
            first, last = (int(x) for x in seen.range.removeprefix("bytes=").split("-"))
            assert 0 <= first <= last < len(header), seen
        # Read once per model and revision, however many endpoints and reconciles ask.
        assert len(asked) == 2 * len(shards)
