"""Signal collection: EndpointSlices -> pod URLs, /metrics parsing, and the scraper against real
metrics servers on 127.0.0.1."""

from __future__ import annotations

import asyncio
import socket

import pytest
from aiohttp import web
from llmendpoints_operator.autoscaling.scrape import (
    MetricsError,
    MetricsScraper,
    ScrapeTarget,
    endpointslice_selector,
    observe,
    parse_pod_metrics,
    targets_from_endpointslices,
)
from prometheus_client import CollectorRegistry, Gauge, Histogram, generate_latest


def exposition(queue_depth: float | None, in_flight: float | None) -> str:
    """A pod's /metrics as prometheus_client writes it, with a vLLM-like histogram around."""
    registry = CollectorRegistry()
    if queue_depth is not None:
        Gauge("llmendpoints_queue_depth", "queued", registry=registry).set(queue_depth)
    if in_flight is not None:
        Gauge("llmendpoints_requests_in_flight", "running", registry=registry).set(in_flight)
    Histogram("vllm:e2e_request_latency_seconds", "latency", ["model_name"], registry=registry)
    Gauge("llmendpoints_queue_depth_peak", "a longer name", registry=registry).set(99)
    return generate_latest(registry).decode()


def slice_(*endpoints, port_name="http", port=8000, address_type="IPv4"):
    return {
        "addressType": address_type,
        "metadata": {"labels": {"kubernetes.io/service-name": "chat"}},
        "ports": [{"name": port_name, "port": port, "protocol": "TCP"}],
        "endpoints": list(endpoints),
    }


def endpoint(address, pod, ready=True):
    conditions = {} if ready is None else {"ready": ready}
    return {
        "addresses": [address],
        "conditions": conditions,
        "targetRef": {"kind": "Pod", "name": pod},
    }


def test_ready_endpoints_become_targets_on_the_port_named_http():
    view = targets_from_endpointslices(
        [
            slice_(
                endpoint("10.0.0.1", "chat-a"),
                endpoint("10.0.0.2", "chat-b", ready=False),  # starting or terminating
                endpoint("10.0.0.3", "chat-c", ready=None),  # unknown counts as ready
            ),
            # Dual stack: the same pod again in an IPv6 slice counts once.
            slice_(endpoint("fd00::1", "chat-a"), address_type="IPv6"),
            slice_(endpoint("fd00::4", "chat-d"), address_type="IPv6"),
        ]
    )
    assert view.ready == (
        ScrapeTarget("chat-a", "http://10.0.0.1:8000/metrics"),
        ScrapeTarget("chat-c", "http://10.0.0.3:8000/metrics"),
        ScrapeTarget("chat-d", "http://[fd00::4]:8000/metrics"),
    )
    assert endpointslice_selector("chat") == "kubernetes.io/service-name=chat"


def test_a_slice_without_the_http_port_gives_no_target():
    view = targets_from_endpointslices([slice_(endpoint("10.0.0.1", "a"), port_name="metrics")])
    assert view.ready == ()


def test_parse_reads_the_two_gauges_and_ignores_everything_else():
    assert parse_pod_metrics(exposition(3, 7)) == (3.0, 7.0)


@pytest.mark.parametrize(
    ("text", "words"),
    [
        (exposition(None, 1), "missing llmendpoints_queue_depth"),
        (exposition(1, None), "missing llmendpoints_requests_in_flight"),
        ("<html>not metrics</html>", "missing"),
        (exposition(float("nan"), 1), "llmendpoints_queue_depth is nan"),
        (exposition(-1, 1), "llmendpoints_queue_depth is -1.0"),
    ],
)
def test_parse_refuses_what_is_not_the_contract(text, words):
    with pytest.raises(MetricsError, match=words):
        parse_pod_metrics(text)


async def _serve(handler) -> tuple[web.AppRunner, str]:
    app = web.Application()
    app.router.add_get("/metrics", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    return runner, f"http://127.0.0.1:{port}/metrics"


def _text(body: str):
    async def handler(request):
        return web.Response(text=body, content_type="text/plain")

    return handler


def _stalled(release: asyncio.Event):
    async def handler(request):
        await release.wait()  # answers only after the scrape has given up
        return web.Response(text=exposition(50, 50))

    return handler


async def _broken(request):
    return web.Response(status=500, text="boom")


def _closed_port_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}/metrics"


async def test_scrape_sums_the_pods_that_answer_and_counts_the_others_as_failed():
    release = asyncio.Event()
    handlers = {
        "pod-a": _text(exposition(3, 2)),
        "pod-b": _text(exposition(1.5, 4)),
        "pod-slow": _stalled(release),
        "pod-500": _broken,
        "pod-no-gauges": _text(exposition(None, None)),
    }
    runners, targets = [], []
    for pod, handler in handlers.items():
        runner, url = await _serve(handler)
        runners.append(runner)
        targets.append(ScrapeTarget(pod, url))
    targets.append(ScrapeTarget("pod-gone", _closed_port_url()))
    scraper = MetricsScraper(timeout=0.5)
    try:
        result = await scraper.scrape(targets)
        again = await scraper.scrape(targets[:2])  # the session is reused between ticks
    finally:
        release.set()
        await scraper.close()
        for runner in runners:
            await runner.cleanup()

    obs = result.observation
    assert (obs.queue_depth, obs.in_flight) == (4.5, 6.0)
    assert (obs.answered, obs.failed, obs.ready) == (2, 4, 6)
    assert obs.saturated_in_flight == 3.0  # both answering pods have a queue: (2 + 4) / 2
    assert set(result.errors) == {"pod-slow", "pod-500", "pod-no-gauges", "pod-gone"}
    assert result.errors["pod-slow"] == "no answer within 0.5 s"
    assert result.errors["pod-500"] == "HTTP 500"
    assert "missing llmendpoints_queue_depth" in result.errors["pod-no-gauges"]
    assert "ClientConnectorError" in result.errors["pod-gone"]
    assert again.observation.answered == 2 and again.errors == {}


def test_capacity_is_read_from_the_pods_that_have_a_queue_only():
    obs = observe([(3, 8), (0, 5), (1, 6)], failed=1)
    assert (obs.queue_depth, obs.in_flight, obs.answered, obs.failed) == (4, 19, 3, 1)
    assert obs.saturated_in_flight == 7.0
    assert observe([(0, 5)]).saturated_in_flight is None


async def test_scrape_of_no_pods_is_an_empty_observation():
    scraper = MetricsScraper()
    result = await scraper.scrape([])
    await scraper.close()
    assert (result.observation.answered, result.observation.failed) == (0, 0)
