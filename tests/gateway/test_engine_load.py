"""The pod reader's engine-load reads against stand-in replicas that report load on /metrics (real
HTTP on loopback, the runtime's exposition format), and the scorer choosing on what it read: a
load-aware choice that follows the replicas' reports, failures that age, departed replicas
dropped, idle replicas not read."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
from aiohttp import web
from contract.vllm_series import vllm_registry
from llmendpoints_gateway.engine_load import EngineLoad
from llmendpoints_gateway.pod_board import Activity
from llmendpoints_gateway.pod_reader import PodReader
from llmendpoints_gateway.scoring import Candidate, Reason, choose
from llmendpoints_runtime.metrics import RuntimeMetrics

pytestmark = pytest.mark.asyncio(loop_scope="module")


class StandIn:
    """A replica's /metrics: the runtime's series and vLLM's, with the load a test sets."""

    def __init__(self) -> None:
        self.load = {"running": 0, "waiting": 0, "kv_usage": 0.1}
        self.status = 200
        self.delay = 0.0
        self.url = ""
        self.scrapes = 0

    async def metrics(self, _: web.Request) -> web.Response:
        self.scrapes += 1
        await asyncio.sleep(self.delay)
        body = RuntimeMetrics().render(vllm_registry(**self.load))
        return web.Response(body=body, status=self.status, content_type="text/plain")


async def wait_until(predicate, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def replicas() -> AsyncIterator[dict[str, StandIn]]:
    stand_ins, runners = {}, []
    for name in ("a", "b", "c"):
        stand_in = StandIn()
        app = web.Application()
        app.router.add_get("/metrics", stand_in.metrics)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        stand_in.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        stand_ins[name] = stand_in
        runners.append(runner)
    yield stand_ins
    for runner in runners:
        await runner.cleanup()


class Source:
    """What the reader asks the registry, set by the test."""

    def __init__(self, targets: list[str], active: set[str] | None = None) -> None:
        self.targets = targets
        self.active = active  # None: every target is active
        self.controls: dict[str, str] = {}
        self.samples: list[tuple[str, EngineLoad | None, EngineLoad]] = []

    def engine_targets(self) -> list[str]:
        return list(self.targets)

    def control_url(self, replica: str) -> str | None:
        return self.controls.get(replica)

    def active_replicas(self, now: float) -> set[str]:
        return set(self.targets) if self.active is None else self.active & set(self.targets)

    def engine_sampled(self, replica: str, previous: EngineLoad | None, new: EngineLoad) -> None:
        self.samples.append((replica, previous, new))


def reader_for(source: Source, **kwargs) -> PodReader:
    settings = {"load_interval": 0.05, "probe_interval": 0.05, "idle_interval": 1.0, **kwargs}
    return PodReader(source, Activity.private(grace=1.0), **settings)


def decide(feed: PodReader, urls: list[str], matched: dict[str, int] | None = None):
    now = time.monotonic()
    candidates = [Candidate(u, 0, feed.get(u).state(now) if feed.get(u) else None) for u in urls]
    return choose(candidates, 4, matched or {}, typical_blocks=2)


async def test_the_choice_follows_the_load_the_replicas_report(replicas) -> None:
    a, b = replicas["a"], replicas["b"]
    a.load = {"running": 4, "waiting": 6, "kv_usage": 0.8}
    b.load = {"running": 1, "waiting": 0, "kv_usage": 0.2}
    source = Source([a.url, b.url])
    feed = reader_for(source)
    await feed.lead_once()
    assert (feed.get(a.url).waiting, feed.get(b.url).waiting) == (6, 0)
    # "a" holds the request's whole prefix, but 6 requests wait there: "b" starts it sooner.
    choice = decide(feed, [a.url, b.url], {a.url: 4})
    assert (choice.replica, choice.reason) == (b.url, Reason.LOAD)

    await feed.start()
    try:
        a.load = {"running": 1, "waiting": 0, "kv_usage": 0.2}
        b.load = {"running": 8, "waiting": 9, "kv_usage": 0.95}
        await wait_until(lambda: feed.get(b.url).waiting == 9, "the reader to see b's new load")
        choice = decide(feed, [a.url, b.url], {a.url: 4})
        assert (choice.replica, choice.reason) == (a.url, Reason.AFFINITY)
        # Every sample after the first came with the one it replaced.
        assert all(old is not None for r, old, _ in source.samples[2:])
    finally:
        await feed.stop()


async def test_a_failing_replica_keeps_its_last_sample_which_ages(replicas) -> None:
    c = replicas["c"]
    c.load, c.status, c.delay = {"running": 0, "waiting": 0, "kv_usage": 0.1}, 200, 0.0
    clock = [100.0]
    feed = reader_for(Source([c.url]), timeout=0.3, clock=lambda: clock[0])
    await feed.lead_once()
    first = feed.get(c.url)
    assert first is not None and first.taken_at == 100.0

    c.status = 500
    clock[0] = 103.0
    await feed.lead_once()
    assert feed.get(c.url) is first and feed.errors() == {c.url: "HTTP 500"}
    assert first.state(clock[0]).age_s == 3.0  # the scorer stops trusting it at 5 s

    c.status, c.delay = 200, 1.0  # answers, but after the timeout
    clock[0] = 104.0
    await feed.lead_once()
    assert feed.get(c.url) is first and c.url in feed.errors()
    c.delay = 0.0
    clock[0] = 105.0
    await feed.lead_once()
    assert feed.get(c.url).taken_at == 105.0 and feed.errors() == {}
    await feed.stop()


async def test_departed_replicas_are_dropped_and_no_longer_read(replicas) -> None:
    a, b = replicas["a"], replicas["b"]
    clock = [0.0]
    source = Source([a.url, b.url])
    feed = reader_for(source, clock=lambda: clock[0])
    await feed.lead_once()
    assert set(feed.loads()) == {a.url, b.url}
    source.targets.remove(a.url)
    scraped = a.scrapes
    clock[0] += 1
    await feed.lead_once()
    assert set(feed.loads()) == {b.url} and feed.get(a.url) is None
    assert a.scrapes == scraped
    source.targets.clear()
    clock[0] += 1
    await feed.lead_once()
    assert feed.loads() == {}
    await feed.stop()


async def test_idle_replicas_are_not_read_and_the_first_request_wakes_the_reader(replicas):
    """Only replicas of endpoints with work are read: an idle one costs nothing; when work
    arrives (Activity.busy) the reader wakes at once instead of at its slow tick."""
    a = replicas["a"]
    a.load = {"running": 0, "waiting": 0, "kv_usage": 0.1}
    source = Source([a.url], active=set())
    activity = Activity.private(grace=60.0)
    feed = PodReader(
        source, activity, load_interval=0.05, probe_interval=0.05, idle_interval=3600.0
    )
    scraped = a.scrapes
    await feed.start()
    try:
        await asyncio.sleep(0.3)
        assert a.scrapes == scraped and feed.get(a.url) is None
        source.active = {a.url}
        activity.busy(7)  # some endpoint's slot: the reader is woken, not after an hour
        await wait_until(lambda: feed.get(a.url) is not None, "a read once the replica is busy")
        assert a.scrapes > scraped
    finally:
        await feed.stop()


async def test_nothing_listening_is_an_error_not_a_crash() -> None:
    feed = reader_for(Source(["http://127.0.0.1:9"]), timeout=0.5)
    await feed.lead_once()
    assert feed.get("http://127.0.0.1:9") is None
    assert "http://127.0.0.1:9" in feed.errors()
    await feed.stop()
