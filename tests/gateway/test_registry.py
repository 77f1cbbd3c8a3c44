"""The registry: discovery's view, replicas routed around after a failure, holds released."""

from __future__ import annotations

import asyncio

import pytest
from llmendpoints_gateway import registry as registry_module
from llmendpoints_gateway.metrics import GatewayMetrics
from llmendpoints_gateway.registry import Registry
from llmendpoints_gateway.routing import Strategy


async def test_a_failed_replica_is_routed_around_then_trusted_again(
    monkeypatch: pytest.MonkeyPatch,
):
    monkeypatch.setattr(registry_module, "SUSPEND_SECONDS", 0.05)
    reg = Registry(GatewayMetrics(), hold_queue_length=10, load_factor=1.25)
    ep = reg.upsert("e", ["m"], Strategy.PREFIX_AWARE)
    reg.set_ready("e", ["http://a", "http://b"])
    reg.mark_failed("e", "http://a")
    assert ep.ready == ("http://b",)
    reg.set_ready("e", ["http://a", "http://b"])  # discovery still lists it: still suspended
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
    reg.set_ready("e", ["http://a"])
    await asyncio.wait_for(waiting, 1)
    assert len(ep.hold) == 0
    assert reg.by_model("m") is ep and reg.by_model("x") is None
