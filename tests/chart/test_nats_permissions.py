"""The NATS user the chart configures may do what the gateway's limiter and metering do.

The chart's nats.conf restricts the one user to the queue's subjects. This test runs a real
nats-server with the `authorization` block the chart renders, and the gateway's limiter (a
compare-and-set write, the ordered consumer that follows the bucket), usage records, the job
usage consumer (acks) and the usage export against it: a permission the chart forgot shows as a
"Publish Violation" in the server's log and as nothing counted here.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
from pathlib import Path

import pytest
from integration.nats_kit import _free_port, nats_server_binary

from .helm_kit import render


def _authorization(helm: Path, tmp_path: Path) -> str:
    docs = render(helm, tmp_path, {"queue": {"enabled": True}, "gateway": {"enabled": True}})
    (conf,) = [
        d["data"]["nats.conf"]
        for d in docs
        if d["kind"] == "ConfigMap" and "nats.conf" in (d.get("data") or {})
    ]
    return conf[conf.index("authorization") :]


@pytest.fixture
def server(helm: Path, tmp_path: Path):
    port = _free_port()
    conf = tmp_path / "nats.conf"
    conf.write_text(_authorization(helm, tmp_path))
    log = tmp_path / "nats.log"
    with log.open("wb") as handle:
        proc = subprocess.Popen(
            [nats_server_binary(), "-c", str(conf), "-js", "-sd", str(tmp_path / "js"),
             "-a", "127.0.0.1", "-p", str(port)],
            env={**os.environ, "NATS_PASSWORD": "test-password"},
            stdout=handle, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 15
        while "Server is ready" not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        yield f"nats://llmendpoints:test-password@127.0.0.1:{port}", log
    finally:
        proc.terminate()
        proc.wait(10)


def test_the_chart_lets_the_gateway_limit_and_meter(server):
    from llmendpoints_common.jobs.models import JobStatus, parse_job_request
    from llmendpoints_common.jobs.record import claim, finish
    from llmendpoints_common.queue.client import QueueConnection, QueueJobService
    from llmendpoints_common.queue.state import JobStates
    from llmendpoints_gateway.keys import Key
    from llmendpoints_gateway.limiter import Limiter
    from llmendpoints_gateway.metering import UsageRecord
    from llmendpoints_gateway.queue import SharedQueue
    from llmendpoints_gateway.quotas import Limits
    from llmendpoints_gateway.usage import JobUsageMeter, UsagePublisher, read_usage

    url, log = server

    async def scenario() -> None:
        queue = SharedQueue(url, "g")  # the gateway's one connection, as it runs
        await queue.start()
        limiter = Limiter("g", queue)
        await limiter.start()
        counted: list[str] = []
        meter = JobUsageMeter(
            queue,
            lambda r, u: (
                UsageRecord(f"job-{r.id}-usage", time.time(), r.owner, r.endpoint, "m", 200,
                            u.prompt_tokens, u.completion_tokens, requests=0),
                lambda: counted.append(r.id),
            ),
        )  # fmt: skip
        usage = UsagePublisher(queue)
        await meter.start()
        await usage.start()
        connection = await QueueConnection.connect(url, name="test")
        try:
            deadline = time.monotonic() + 20
            while not limiter.shared:
                assert time.monotonic() < deadline, "the limiter did not connect"
                await asyncio.sleep(0.05)
            key = Key("team", limits=Limits(requests_per_minute=100, max_concurrent=2))
            ticket = await limiter.admit(key)
            limiter.finish(ticket, 3)
            await asyncio.wait(limiter._background)
            # A first read (nothing cached yet), the admission, the release: all on NATS.
            assert limiter.round_trips == 3 and not limiter._fallback_logged
            # The ordered consumer that follows the bucket delivered the writes.
            while not limiter._cache:
                assert time.monotonic() < deadline, "the bucket's changes never arrived"
                await asyncio.sleep(0.05)

            usage.record(UsageRecord("r1", time.time(), "team", "demo", "m", 200, 1, 2))
            jobs = QueueJobService(connection, "demo")
            job = await jobs.submit(
                parse_job_request(b'{"input": {"prompt": "x"}}'), sync=False, owner="team"
            )
            states = JobStates(connection.js, "demo")
            now = time.time()
            await states.update(job.id, lambda r: claim(r, now=now, worker="w"))
            output = [{"usage": {"input": 1, "output": 1}}]
            await states.update(
                job.id, lambda r: finish(r, JobStatus.COMPLETED, now=now, output=output)
            )
            while not counted or usage.pending:
                assert time.monotonic() < deadline, "the job's usage was not counted"
                await asyncio.sleep(0.05)
            ids = {r.id for r in await read_usage(url, now - 60, None)}
            assert ids == {"r1", f"job-{job.id}-usage"}
        finally:
            await connection.close()
            await meter.stop()
            await usage.stop()
            await limiter.stop()
            await queue.stop()

    asyncio.run(scenario())
    assert "Violation" not in log.read_text(), log.read_text()[-3000:]
