"""The registry: discovery's view, replicas routed around after a failure, holds released."""

from __future__ import annotations

import asyncio

import pytest
from llmendpoints_common.errors import ServiceUnavailableError
from llmendpoints_gateway import registry as registry_module
from llmendpoints_gateway.metrics import GatewayMetrics
from llmendpoints_gateway.prefix_index import block_hashes, render_prompt
from llmendpoints_gateway.registry import Registry, RouteKey
from llmendpoints_gateway.routing import Strategy, hash64, home_key


def _two_replicas(monkeypatch: pytest.MonkeyPatch):
    """A prefix-aware endpoint on replicas a and b; a failed replica is suspended for 50 ms."""
    monkeypatch.setattr(registry_module, "SUSPEND_SECONDS", 0.05)
    reg = Registry(GatewayMetrics(), hold_queue_length=10, load_factor=1.25)
    ep = reg.upsert("e", ["m"], Strategy.PREFIX_AWARE)
    reg.set_ready("default/e", ["http://a", "http://b"])
    return reg, ep


async def test_a_failed_replica_is_routed_around_then_trusted_again(
    monkeypatch: pytest.MonkeyPatch,
):
    reg, ep = _two_replicas(monkeypatch)
    reg.mark_failed("default/e", "http://a")
    assert ep.ready == ("http://b",)
    reg.set_ready(
        "default/e", ["http://a", "http://b"]
    )  # discovery still lists it: still suspended
    assert ep.ready == ("http://b",)
    await asyncio.sleep(0.1)
    assert ep.ready == ("http://a", "http://b")


async def test_held_requests_go_out_when_a_replica_is_ready():
    reg = Registry(GatewayMetrics(), hold_queue_length=10, load_factor=1.25)
    ep = reg.upsert("e", ["m"], Strategy.PREFIX_AWARE)
    never = asyncio.get_running_loop().create_future()
    waiting = asyncio.ensure_future(ep.hold.wait(5, never))
    await asyncio.sleep(0)
    assert len(ep.hold) == 1 and reg.held() == 1
    reg.set_ready("default/e", ["http://a"])
    await asyncio.wait_for(waiting, 1)
    assert len(ep.hold) == 0
    assert reg.by_model("m") is ep and reg.by_model("x") is None


def _series(metrics: GatewayMetrics) -> str:
    return metrics.render().decode()


async def test_a_departed_replicas_in_flight_series_goes_with_it_named_by_pod():
    metrics = GatewayMetrics()
    reg = Registry(metrics, hold_queue_length=10, load_factor=1.25)
    ep = reg.upsert("e", ["m"], Strategy.PREFIX_AWARE, namespace="ns")
    reg.set_ready("ns/e", ["http://10.0.0.1:8000", "http://10.0.0.2:8000"],
                  names={"http://10.0.0.1:8000": "e-abc", "http://10.0.0.2:8000": "e-def"})  # fmt: skip
    reg.acquire(ep, "http://10.0.0.1:8000")
    reg.acquire(ep, "http://10.0.0.2:8000")
    reg.release(ep, "http://10.0.0.2:8000")
    text = _series(metrics)
    assert 'llmendpoints_gateway_in_flight_requests{endpoint="ns/e",replica="e-abc"} 1.0' in text
    assert 'llmendpoints_gateway_in_flight_requests{endpoint="ns/e",replica="e-def"} 0.0' in text
    assert "10.0.0" not in text  # pod names, not addresses
    # Both pods leave; e-abc still has a request outstanding (it drains), e-def has none.
    reg.set_ready("ns/e", [])
    text = _series(metrics)
    assert 'replica="e-def"' not in text
    assert 'llmendpoints_gateway_in_flight_requests{endpoint="ns/e",replica="e-abc"} 1.0' in text
    reg.release(ep, "http://10.0.0.1:8000")  # its last request ends: the series goes
    assert "llmendpoints_gateway_in_flight_requests{" not in _series(metrics)
    # The endpoint at zero stays visible (dashboards list it), until it is deleted.
    assert 'llmendpoints_gateway_ready_replicas{endpoint="ns/e"} 0.0' in _series(metrics)
    reg.remove("ns/e")
    assert 'endpoint="ns/e"' not in _series(metrics)


async def test_a_suspended_replica_keeps_its_series():
    metrics = GatewayMetrics()
    reg = Registry(metrics, hold_queue_length=10, load_factor=1.25)
    ep = reg.upsert("e", ["m"], Strategy.PREFIX_AWARE)
    reg.set_ready("default/e", ["http://127.0.0.1:9001", "http://127.0.0.1:9002"])
    reg.acquire(ep, "http://127.0.0.1:9001")
    reg.release(ep, "http://127.0.0.1:9001")
    reg.mark_failed("default/e", "http://127.0.0.1:9001")  # routed around, not gone
    text = _series(metrics)
    # A static backend has no pod: its label is host:port.
    assert (
        'llmendpoints_gateway_in_flight_requests{endpoint="default/e",replica="127.0.0.1:9001"} 0.0'
        in text
    )


async def test_hold_time_is_observed_by_outcome():
    metrics = GatewayMetrics()
    reg = Registry(metrics, hold_queue_length=10, load_factor=1.25)
    ep = reg.upsert("e", ["m"], Strategy.PREFIX_AWARE)
    never = asyncio.get_running_loop().create_future()
    waiting = asyncio.ensure_future(ep.hold.wait(5, never))
    await asyncio.sleep(0)
    reg.set_ready("default/e", ["http://a"])
    await asyncio.wait_for(waiting, 1)
    reg.set_ready("default/e", [])
    with pytest.raises(ServiceUnavailableError):
        await ep.hold.wait(0.01, asyncio.get_running_loop().create_future())
    text = _series(metrics)
    count = "llmendpoints_gateway_hold_duration_seconds_count"
    assert f'{count}{{endpoint="default/e",outcome="released"}} 1.0' in text
    assert f'{count}{{endpoint="default/e",outcome="timeout"}} 1.0' in text
    # Buckets reach the longest hold (an hour: a cold start of a large model).
    assert (
        'llmendpoints_gateway_hold_duration_seconds_bucket{endpoint="default/e",le="3600.0",outcome="released"}'
        in text
    )


def test_per_key_series_only_when_asked_for_and_no_created_series():
    plain, keyed = GatewayMetrics(), GatewayMetrics(key_labels=True)
    for metrics in (plain, keyed):
        metrics.answered("ns/e", 200, "team-a")
        metrics.tokens_used("ns/e", "completion", 7, "team-a")
    text = _series(plain)
    assert 'llmendpoints_gateway_requests_total{code="200",endpoint="ns/e"} 1.0' in text
    assert 'llmendpoints_gateway_tokens_total{endpoint="ns/e",kind="completion"} 7.0' in text
    assert "team-a" not in text and "key=" not in text
    assert "_created" not in text
    text = _series(keyed)
    assert 'llmendpoints_gateway_requests_total{code="200",endpoint="ns/e"} 1.0' in text
    assert (
        'llmendpoints_gateway_key_requests_total{code="200",endpoint="ns/e",key="team-a"} 1.0'
        in text
    )
    assert (
        'llmendpoints_gateway_key_tokens_total{endpoint="ns/e",key="team-a",kind="completion"} 7.0'
        in text
    )


def test_an_endpoint_is_found_by_id_qualified_name_or_unique_name():
    reg = Registry(GatewayMetrics(), hold_queue_length=10, load_factor=1.25)
    a = reg.upsert("chat", ["a"], Strategy.PREFIX_AWARE, namespace="team-a")
    b = reg.upsert("chat", ["b"], Strategy.PREFIX_AWARE, namespace="team-b")
    c = reg.upsert("v1.2", ["c"], Strategy.PREFIX_AWARE, namespace="team-b")
    assert reg.get("team-a/chat") is a and reg.get("chat.team-b") is b
    assert reg.get("chat") is None  # two namespaces serve it: qualify it
    assert reg.get("v1.2") is c and reg.get("v1.2.team-b") is c


def test_a_discovered_endpoint_is_held_for_at_least_its_own_start_up():
    """GATEWAY_HOLD_TIMEOUT_SECONDS (600) is shorter than the CRD's startupTimeoutSeconds (3,600):
    a cold start of a large model must not be answered 503 while its pod may still come up."""
    from llmendpoints_gateway.discovery.kube import endpoint_view
    from llmendpoints_gateway.holding import SCHEDULING_MARGIN_SECONDS, hold_timeout

    assert hold_timeout(600, None) == 600  # static endpoints: the setting
    assert hold_timeout(600, 3600) == 3600 + SCHEDULING_MARGIN_SECONDS
    assert hold_timeout(7200, 60) == 7200  # the setting is the floor
    reg = Registry(GatewayMetrics(), hold_queue_length=10, load_factor=1.25)
    big = endpoint_view(
        {"metadata": {"namespace": "ns", "name": "big"},
         "spec": {"engine": {"startupTimeoutSeconds": 5400}}}
    )  # fmt: skip
    plain = endpoint_view({"metadata": {"namespace": "ns", "name": "plain"}, "spec": {}})
    for view in (big, plain):
        reg.upsert(
            view.name,
            view.models,
            view.routing,
            namespace=view.namespace,
            startup_timeout=view.startup_timeout,
        )
    assert reg.get("ns/big").hold_seconds(600) == 5400 + SCHEDULING_MARGIN_SECONDS
    assert reg.get("ns/plain").hold_seconds(600) == 3600 + SCHEDULING_MARGIN_SECONDS  # CRD default
    assert reg.upsert("static", ["m"], Strategy.PREFIX_AWARE).hold_seconds(600) == 600


# ------------------------------------------------------------------ prefix-aware routing state


def _route(reg: Registry, ep, text: str):
    body = {"model": "m", "messages": [{"role": "system", "content": text}]}
    return RouteKey.of("/v1/chat/completions", body, ep.index.chunk_chars)


def test_a_route_key_is_the_rendered_prompts_whole_blocks_and_its_home():
    chat = "/v1/chat/completions"
    body = {"model": "m", "messages": [{"role": "system", "content": "s" * 100}]}
    route = RouteKey.of(chat, body, 16)
    text = render_prompt(chat, body)
    assert route.blocks == tuple(block_hashes("m", text, 16)) and len(route.blocks) > 1
    assert route.chars == len(text)
    assert route.ring == hash64(home_key(chat, body))
    no_prompt = RouteKey.of("/v1/embeddings", {"model": "m", "input": "x"}, 16)
    assert (no_prompt.blocks, no_prompt.ring) == ((), None)


async def test_the_index_keeps_only_discovered_replicas_and_a_suspended_one_keeps_its_blocks(
    monkeypatch: pytest.MonkeyPatch,
):
    reg, ep = _two_replicas(monkeypatch)
    route = _route(reg, ep, "policy " * 200)
    replica, _ = reg.choose(ep, route)
    assert ep.index.size(replica) == len(route.blocks) > 0
    reg.mark_failed("default/e", replica)  # routed around for a moment: still holds its cache
    assert ep.index.size(replica) == len(route.blocks)
    reg.set_ready("default/e", sorted({"http://a", "http://b"} - {replica}))  # gone for good
    assert ep.index.replicas() == []
    await asyncio.sleep(0.1)


def test_an_engine_sample_resets_what_was_sent_since_and_sizes_the_index():
    from llmendpoints_gateway.engine_load import EngineLoad

    metrics = GatewayMetrics()
    reg = Registry(metrics, hold_queue_length=10, load_factor=1.25)
    ep = reg.upsert("e", ["m"], Strategy.PREFIX_AWARE)
    reg.set_ready("default/e", ["http://a"])
    assert reg.engine_targets() == ["http://a"]
    ep.sent_since["http://a"] = 3
    first = EngineLoad(1, 0, 0.2, prefix_queries=1000, prefix_hits=400, block_size=16,
                       num_gpu_blocks=64)  # fmt: skip
    reg.engine_sampled("http://a", None, first)
    assert "http://a" not in ep.sent_since
    assert ep.index.capacity("http://a") == 64 * 16 * 4 // 256  # kv tokens x chars/token / chunk
    text = _series(metrics)
    # The first sample is the baseline: an engine's history before this gateway is not counted.
    assert "engine_prefix_cache_queries_total{" not in text
    second = EngineLoad(1, 0, 0.2, prefix_queries=1500, prefix_hits=700)
    reg.engine_sampled("http://a", first, second)
    text = _series(metrics)
    assert (
        'llmendpoints_gateway_engine_prefix_cache_queries_total{endpoint="default/e"} 500.0' in text
    )
    assert 'llmendpoints_gateway_engine_prefix_cache_hits_total{endpoint="default/e"} 300.0' in text
    quiet = Registry(GatewayMetrics(), 10, 1.25, count_engine_hits=False)  # another worker
    quiet.upsert("e", ["m"], Strategy.PREFIX_AWARE)
    quiet.set_ready("default/e", ["http://a"])
    quiet.engine_sampled("http://a", first, second)
    assert "engine_prefix_cache_queries_total{" not in _series(quiet.metrics)
    reg.set_ready("default/e", [])
    assert reg.engine_targets() == []  # a departed replica is no longer read


async def test_lease_counts_what_was_sent_since_the_engine_sample():
    reg = Registry(GatewayMetrics(), hold_queue_length=10, load_factor=1.25)
    ep = reg.upsert("e", ["m"], Strategy.PREFIX_AWARE)
    reg.set_ready("default/e", ["http://a"])
    never = asyncio.get_running_loop().create_future
    for _ in range(2):
        async with reg.lease(ep, _route(reg, ep, "x" * 600), hold_timeout=1, gone=never) as lease:
            assert lease.replica == "http://a"
    assert ep.sent_since == {"http://a": 2}
    assert ep.loads == {}


def test_a_model_name_stays_with_the_endpoint_that_claimed_it_first():
    """An endpoint author elsewhere cannot take another team's traffic by serving a model of the
    same name: `model` routes to the oldest claimant, whatever order the gateway sees them in,
    and to the next one only once it is gone."""
    reg = Registry(GatewayMetrics(), hold_queue_length=10, load_factor=1.25)
    newer = reg.upsert("chat", ["llama"], Strategy.PREFIX_AWARE, namespace="b", created=200.0)
    older = reg.upsert("chat", ["llama"], Strategy.PREFIX_AWARE, namespace="a", created=100.0)
    assert reg.by_model("llama") is older
    assert reg.model_claims["llama"] == ("a/chat", ("b/chat",))
    # Re-listing (a resync, an edit of the newer one) changes nothing.
    reg.upsert("chat", ["llama", "other"], Strategy.PREFIX_AWARE, namespace="b", created=200.0)
    assert reg.by_model("llama") is older and reg.by_model("other") is newer
    reg.remove("a/chat")
    assert reg.by_model("llama") is newer
