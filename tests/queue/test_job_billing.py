"""Jobs stopped before their end bill what they used, once per run (issue 21), on a real
nats-server with the real queue worker and the gateway's real JobUsageMeter:

- a job cancelled while it runs: the worker adds its attempt's usage to the CANCELLED record
  whoever cancelled wrote; billed once (status 499), however often the record is written again;
- a job that runs past policy.executionTimeout: TIMED_OUT with its usage; billed once (408);
  /retry starts a second run, billed on its own record;
- a job cancelled while queued: nothing ran, nothing is billed.

The engine is a stand-in that publishes one chunk per token and reports what it generated (the
real counting is jobs/tally.py's, unit-tested; the real engine in test_queue_runtime.py).
"""

from __future__ import annotations

import asyncio
import time

import pytest
import pytest_asyncio
from llmendpoints_common.identity import EndpointRef
from llmendpoints_common.jobs import admission
from llmendpoints_common.jobs.models import JobRequest, JobStatus
from llmendpoints_common.jobs.record import JobUsage
from llmendpoints_common.jobs.service import status_body
from llmendpoints_common.queue.client import QueueConnection, QueueJobService
from llmendpoints_common.queue.worker import QueueWorker, WorkerSettings
from llmendpoints_gateway.metering import JOB_USAGE_STATUS, UsageRecord, job_usage_id
from llmendpoints_gateway.queue import SharedQueue
from llmendpoints_gateway.usage import JobUsageMeter, read_usage

pytestmark = pytest.mark.asyncio(loop_scope="module")

EP = EndpointRef("team-a", "billing")
PROMPT_TOKENS = 7


def job(prompt: str = "p", execution_timeout_ms: int | None = None) -> JobRequest:
    policy = {"executionTimeout": execution_timeout_ms} if execution_timeout_ms else {}
    return JobRequest.model_validate({"input": {"prompt": prompt}, "policy": policy})


class TokenEngine:
    """One chunk per generated token, 20 ms apart; ``quick`` jobs end after 2 tokens. What each
    attempt generated is its usage (as jobs/tally.py counts the real engine's steps)."""

    def __init__(self) -> None:
        self.generated: dict[str, int] = {}

    async def execute(self, record, publish):
        self.generated[record.engine_request_id] = 0
        tokens = 2 if record.request["input"]["prompt"] == "quick" else 10_000
        for i in range(tokens):
            await asyncio.sleep(0.02)
            self.generated[record.engine_request_id] += 1
            publish({"token": i})
        return [{"usage": {"input": PROMPT_TOKENS, "output": tokens}}]

    async def abort(self, record) -> None:
        return None

    def usage(self, record) -> JobUsage | None:
        made = self.generated.pop(record.engine_request_id, None)
        return (
            None if made is None else JobUsage(prompt_tokens=PROMPT_TOKENS, completion_tokens=made)
        )


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def billing(nats_server):
    gateway = SharedQueue(nats_server.url, "g1")
    await gateway.start()
    counted: list[str] = []

    def on_usage(record, verdict, usage, written_at):
        entry = UsageRecord(
            job_usage_id(record.id, record.runs), written_at,
            verdict.key, record.endpoint, "m", JOB_USAGE_STATUS[record.status],
            usage.prompt_tokens, usage.completion_tokens, gateway="g1", kind="job", requests=0,
        )  # fmt: skip
        return entry, lambda: counted.append(entry.id)

    meter = JobUsageMeter(gateway, on_usage)
    await meter.start()
    pod = await QueueConnection.connect(nats_server.url, name="pod")
    client = await QueueConnection.connect(nats_server.url, name="client")
    engine = TokenEngine()
    worker = QueueWorker(
        QueueJobService(pod, EP),
        name="pod",
        execute=engine.execute,
        abort=engine.abort,
        usage=engine.usage,
        free_slots=lambda: 4,
        settings=WorkerSettings(poll_seconds=0.2, heartbeat_interval_seconds=0.5),
    )
    # The gateway's job API: its admissions (owner, runs) are what the meter bills by.
    jobs = QueueJobService(client, EP, admitted_by=admission.GATEWAY)
    yield jobs, worker, counted, nats_server.url
    await worker.stop(0)
    await meter.stop()
    await gateway.stop()
    await pod.close()
    await client.close()


async def until(check, what: str, seconds: float = 20.0):
    deadline = time.monotonic() + seconds
    while not (value := await check()):
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.05)
    return value


async def streamed(jobs, job_id: str, at_least: int) -> int:
    """Read the job's stream until at least ``at_least`` tokens were produced."""
    seen = 0

    async def enough():
        nonlocal seen
        _, chunks = await jobs.take_stream(job_id, owner="alice")
        seen += len(chunks)
        return seen >= at_least

    await until(enough, f"job {job_id} never streamed {at_least} tokens")
    return seen


async def billed(url: str, since: float) -> dict[str, list[UsageRecord]]:
    by_id: dict[str, list[UsageRecord]] = {}
    for record in await read_usage(url, since, None):
        by_id.setdefault(record.id, []).append(record)
    return by_id


async def test_stopped_jobs_bill_their_partial_tokens_once_per_run(billing):
    jobs, worker, counted, url = billing
    since = time.time()
    # Queued, then cancelled before any worker runs: never billed.
    never = await jobs.submit(job(), sync=False, owner="alice")
    assert (await jobs.cancel(never.id, owner="alice")).status is JobStatus.CANCELLED
    await worker.start()

    # Cancelled while it runs: the worker adds what it generated to the CANCELLED record.
    cancelled = await jobs.submit(job(), sync=False, owner="alice")
    await streamed(jobs, cancelled.id, 3)
    await jobs.cancel(cancelled.id, owner="alice")
    done = await until(
        lambda: _with_usage(jobs, cancelled.id), "the cancelled job's usage never landed"
    )
    assert done.status is JobStatus.CANCELLED and done.usage.prompt_tokens == PROMPT_TOKENS
    assert done.usage.completion_tokens >= 3
    # /status says what it is billed.
    assert status_body(done)["usage"] == {
        "input": PROMPT_TOKENS,
        "output": done.usage.completion_tokens,
    }

    # Past its executionTimeout: TIMED_OUT with its usage; /retry is a second run.
    slow = await jobs.submit(job(execution_timeout_ms=400), sync=False, owner="alice")
    timed_out = await jobs.wait(slow.id, 20, owner="alice")
    assert timed_out.status is JobStatus.TIMED_OUT and timed_out.usage.completion_tokens > 0
    await jobs.retry(slow.id, owner="alice")
    second = await jobs.wait(slow.id, 20, owner="alice")
    assert second.status is JobStatus.TIMED_OUT and second.runs == 2

    # A completed job, last: once it is counted, every change before it was handled (one
    # consumer, in order).
    last = await jobs.submit(job("quick"), sync=True, owner="alice")
    assert (await jobs.wait(last.id, 20, owner="alice")).status is JobStatus.COMPLETED
    await until(
        lambda: _true(job_usage_id(last.id, 1) in counted), "the completed job was not metered"
    )
    # A /stream read writes the cancelled record again (when chunks were left): no second bill.
    await jobs.take_stream(cancelled.id, owner="alice")

    records = await billed(url, since)
    assert job_usage_id(never.id, 1) not in records
    (on_cancel,) = records[job_usage_id(cancelled.id, 1)]
    assert (on_cancel.status, on_cancel.prompt_tokens, on_cancel.completion_tokens) == (
        499,
        PROMPT_TOKENS,
        done.usage.completion_tokens,
    )
    (run1,) = records[job_usage_id(slow.id, 1)]
    (run2,) = records[job_usage_id(slow.id, 2)]
    # Billed to the owner the gateway admitted each job for.
    assert {r.key for rs in records.values() for r in rs} == {"alice"}
    assert (run1.status, run1.completion_tokens) == (408, timed_out.usage.completion_tokens)
    assert (run2.status, run2.completion_tokens) == (408, second.usage.completion_tokens)
    assert sorted(counted) == sorted(
        [
            job_usage_id(cancelled.id, 1),
            job_usage_id(slow.id, 1),
            job_usage_id(slow.id, 2),
            job_usage_id(last.id, 1),
        ]
    )


async def _with_usage(jobs, job_id: str):
    record = await jobs.get(job_id, owner="alice")
    return record if record.usage is not None else None


async def _true(value: bool) -> bool:
    return value
