"""The gateway publishes scale-from-zero signals on a real nats-server: held requests per
endpoint in LLMEP_SIGNALS (read back with the autoscaler's own read_held) and a nudge on
llmep.nudge.<ns>.<name> when a request waits for an endpoint with no ready replica."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import nats
import pytest
from integration.nats_kit import nats_server
from llmendpoints_common.identity import EndpointRef
from llmendpoints_common.queue.signals import read_held, subscribe_nudges

from .harness import free_port, running_gateway, write_endpoints

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest.mark.parametrize("workers", ["1", "2"])  # with 2 workers, their counts add up
async def test_held_requests_and_nudges_reach_the_autoscaler(tmp_path: Path, workers: str):
    endpoints = write_endpoints(
        tmp_path / "endpoints.yaml",
        [
            {
                "name": "cold.one",
                "models": ["cold"],
                "backends": [f"http://127.0.0.1:{free_port()}"],
            },
        ],
    )
    with (
        nats_server() as url,
        running_gateway(
            tmp_path,
            GATEWAY_ENDPOINTS_FILE=str(endpoints),
            JOBS_QUEUE_URL=url,
            GATEWAY_ID="gw-a.1",
            GATEWAY_REQUIRE_KEYS="false",
            GATEWAY_WORKERS=workers,
        ) as gw,
    ):
        nc = await nats.connect(url)
        js = nc.jetstream()
        nudged: list[EndpointRef] = []
        await subscribe_nudges(nc, nudged.append)
        await asyncio.sleep(1.0)  # the gateway connects in the background
        async with httpx.AsyncClient(base_url=gw.url, timeout=60) as client:
            body = {"model": "cold", "prompt": "hi"}
            held = [
                asyncio.create_task(client.post("/v1/completions", json=body)) for _ in range(3)
            ]
            deadline = time.monotonic() + 10
            while await read_held(js, "default/cold.one") != 3:
                assert time.monotonic() < deadline, "held count not published"
                await asyncio.sleep(0.1)
            assert nudged and set(nudged) == {EndpointRef("default", "cold.one")}
            for task in held:
                task.cancel()
            await asyncio.gather(*held, return_exceptions=True)
        deadline = time.monotonic() + 10
        while await read_held(js, "default/cold.one") != 0:
            assert time.monotonic() < deadline, "the count did not go back to 0"
            await asyncio.sleep(0.1)
        await nc.close()
