"""A subscription is on the server when our code says it is (a real nats-server).

The nudge the tenancy test lost (issue 29) was published by one connection after another had
subscribed and called ``flush()``: nats-py writes flush's PING ahead of the SUB still in its
own buffer, so the PONG can come back before the server has the subscription, and a message
routed meanwhile reaches no one. ``settle`` sends the buffer first; ``subscribe_nudges``
returns after it. The evidence, with the losses counted: bench/RESULTS.md, "A nudge lost
between two connections".
"""

from __future__ import annotations

import json
import os
import signal
import urllib.request

import pytest
from integration.nats_kit import record_wire, running_nats
from llmendpoints_common.queue import signals
from llmendpoints_common.queue.connect import connect, settle
from ports import free_port
from proc_kit import stopped, wait_until


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_nats(tmp_path_factory.mktemp("start"), monitor_port=free_port()) as running:
        yield running


def held_by_server(server, name: str) -> list[str]:
    """The subjects the server has subscribed for connection ``name`` (its monitoring API).
    A blocking call on purpose: the event loop gets no turn meanwhile, so the client cannot
    send anything it had not sent before."""
    url = f"http://127.0.0.1:{server.monitor_port}/connz?subs=1"
    with urllib.request.urlopen(url, timeout=10) as answer:
        connections = json.load(answer)["connections"]
    return [
        s for c in connections if c.get("name") == name for s in c.get("subscriptions_list", [])
    ]


async def test_subscribe_nudges_returns_once_the_server_holds_the_subscription(server):
    nc, _ = await connect(server.url, name="autoscaler", reconnect=False)
    try:
        await signals.subscribe_nudges(nc, lambda endpoint: None)
        assert held_by_server(server, "autoscaler") == ["llmep.nudge.*.*"]
    finally:
        await nc.close()


async def test_settle_sends_what_the_client_buffered_before_its_ping(server):
    nc, _ = await connect(server.url, name="settled", reconnect=False)
    written = record_wire(nc)
    try:
        await nc.subscribe("llmep.nudge.*.*")
        await nc.publish("llmep.nudge.ns.chat", b"")
        await settle(nc)
        verbs = [line.split(b" ")[0] for line in written]
        assert verbs == [b"SUB", b"PUB", b"PING"]
        assert held_by_server(server, "settled") == ["llmep.nudge.*.*"]
    finally:
        await nc.close()


async def test_settle_gives_up_with_an_error_when_the_server_does_not_answer(tmp_path):
    with running_nats(tmp_path) as frozen:
        nc, _ = await connect(frozen.url, name="frozen", reconnect=False)
        os.kill(frozen.process.pid, signal.SIGSTOP)
        try:
            wait_until(lambda: stopped(frozen.process.pid), 10, "nats-server stopped", 0.01)
            with pytest.raises(TimeoutError):
                await settle(nc, timeout=0.5)
        finally:
            os.kill(frozen.process.pid, signal.SIGCONT)
            await nc.close()
