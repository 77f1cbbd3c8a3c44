"""The held-request signal and nudges (llmendpoints_common.queue.signals) on a real nats-server."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import nats
import pytest
import pytest_asyncio
from llmendpoints_common.identity import EndpointRef
from llmendpoints_common.queue import signals
from llmendpoints_common.queue.names import SIGNALS_BUCKET, held_key
from nats.js.api import KeyValueConfig, StorageType

from .nats_kit import nats_server

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest.fixture(scope="module")
def nats_url() -> AsyncIterator[str]:
    with nats_server() as url:
        yield url


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def nc(nats_url):
    client = await nats.connect(nats_url)
    yield client
    await client.drain()


async def test_held_is_the_sum_over_gateways_for_that_endpoint_only(nc):
    js = nc.jetstream()
    assert await signals.read_held(js, "ns/sum-a") == 0  # no bucket entry yet
    await signals.publish_held(js, "ns/sum-a", "gw-1", 3)
    await signals.publish_held(js, "ns/sum-a", "gw-2", 4)
    await signals.publish_held(js, "ns/sum-b", "gw-1", 100)
    # "sum-a.x" maps to the token "sum-a_x": it must not be read as "sum-a".
    await signals.publish_held(js, "ns/sum-a.x", "gw-1", 50)
    # The same name in another namespace is another endpoint.
    await signals.publish_held(js, "other-ns/sum-a", "gw-1", 1000)
    assert await signals.read_held(js, "ns/sum-a") == 7
    assert await signals.read_held(js, "ns/sum-b") == 100
    assert await signals.read_held(js, "ns/sum-a.x") == 50
    # A gateway's newer count replaces its older one.
    await signals.publish_held(js, "ns/sum-a", "gw-2", 0)
    assert await signals.read_held(js, "ns/sum-a") == 3


async def test_bucket_is_created_with_expiring_entries(nc):
    js = nc.jetstream()
    await signals.publish_held(js, "ns/ttl-a", "gw-1", 1)
    status = await (await js.key_value(SIGNALS_BUCKET)).status()
    assert status.ttl == signals.HELD_TTL_SECONDS
    assert signals.HELD_REFRESH_SECONDS * 2 < signals.HELD_TTL_SECONDS


async def test_a_dead_gateways_count_expires(nats_url):
    """Entries expire by the bucket's max age; a short-lived bucket on its own server shows it
    without waiting 30 s (the reader code path is the same)."""
    with nats_server() as url:
        client = await nats.connect(url)
        try:
            js = client.jetstream()
            await js.create_key_value(
                KeyValueConfig(bucket=SIGNALS_BUCKET, ttl=1.0, storage=StorageType.MEMORY)
            )
            await signals.publish_held(js, "ns/gone", "gw-dead", 5)
            assert await signals.read_held(js, "ns/gone") == 5
            await asyncio.sleep(2.0)
            assert await signals.read_held(js, "ns/gone") == 0
        finally:
            await client.drain()


async def test_malformed_entry_counts_zero(nc):
    js = nc.jetstream()
    kv = await signals.signals_bucket(js)
    await kv.put(held_key("ns/bad", "gw-x"), b"lots")
    await signals.publish_held(js, "ns/bad", "gw-y", 2)
    assert await signals.read_held(js, "ns/bad") == 2


async def test_bad_inputs_are_refused_with_the_field_named(nc):
    js = nc.jetstream()
    with pytest.raises(ValueError, match="held count"):
        await signals.publish_held(js, "ns/ok", "gw", -1)
    with pytest.raises(ValueError, match="gateway id"):
        await signals.publish_held(js, "ns/ok", "gw.1", 1)
    with pytest.raises(ValueError, match="endpoint id"):
        await signals.publish_held(js, "Not_A_Name", "gw", 1)
    with pytest.raises(ValueError, match="endpoint name"):
        await signals.publish_held(js, "ns/Not_A_Name", "gw", 1)
    with pytest.raises(ValueError, match="endpoint namespace"):
        await signals.publish_held(js, "a.b/ok", "gw", 1)


async def test_nudges_reach_subscribers_with_the_endpoint_id(nc, nats_url):
    got: asyncio.Queue[EndpointRef] = asyncio.Queue()
    sub = await signals.subscribe_nudges(nc, got.put)
    publisher = await nats.connect(nats_url)
    try:
        await signals.nudge(publisher, "ns/chat.v2")
        await signals.nudge(publisher, "ns/other")
        await publisher.flush()
        assert await asyncio.wait_for(got.get(), 5) == EndpointRef("ns", "chat.v2")
        assert await asyncio.wait_for(got.get(), 5) == EndpointRef("ns", "other")
    finally:
        await sub.unsubscribe()
        await publisher.drain()


async def test_endpoint_of_nudge_refuses_other_subjects():
    assert signals.endpoint_of_nudge("llmep.nudge.ns.a_b") == EndpointRef("ns", "a.b")
    with pytest.raises(ValueError):
        signals.endpoint_of_nudge("llmep.jobs.ns.a.normal")
    with pytest.raises(ValueError):
        signals.endpoint_of_nudge("llmep.nudge.ns.a.b")
