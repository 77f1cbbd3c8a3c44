"""The operator's page reads take the whole body when the pod sends it in pieces (aiohttp's
``read(n)`` answers with what has arrived: a page cut at its first piece lost the queue gauges
sent after it). A real aiohttp server on loopback sends /metrics in two writes, 0.3 s apart."""

from __future__ import annotations

import asyncio

from aiohttp import web
from llmendpoints_operator.autoscaling.scrape import MetricsScraper, ScrapeTarget

FIRST = "# HELP padding a long first piece\n" + "".join(f"# pad {i}\n" for i in range(4000))
SECOND = "llmendpoints_queue_depth 7.0\nllmendpoints_requests_in_flight 3.0\n"


async def test_a_page_sent_in_two_pieces_is_read_whole() -> None:
    async def metrics(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"content-type": "text/plain"})
        await response.prepare(request)
        await response.write(FIRST.encode())
        await asyncio.sleep(0.3)
        await response.write(SECOND.encode())
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    scraper = MetricsScraper(timeout=10)
    try:
        url = f"http://127.0.0.1:{port}/metrics"
        text = await scraper.fetch(url)
        assert text.endswith(SECOND)
        result = await scraper.scrape([ScrapeTarget("pod-a", url)])
        assert result.errors == {}
    finally:
        await scraper.close()
        await runner.cleanup()
