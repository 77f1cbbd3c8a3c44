"""The queue worker's guarantees on a real nats-server, with a stand-in for the engine (the real
engine is exercised in test_queue_runtime.py): capacity, order, priority, cancel from another
connection, stream chunks in order, redelivery and the attempt bound, executionTimeout."""

from __future__ import annotations

import asyncio
import time

import pytest
import pytest_asyncio
from llmendpoints_common.errors import BadRequestError, ContentTooLargeError
from llmendpoints_common.jobs.models import JobRequest, JobStatus, parse_job_request
from llmendpoints_common.queue.client import QueueConnection, QueueJobService
from llmendpoints_common.queue.topology import QueueLayout
from llmendpoints_common.queue.worker import QueueWorker, WorkerSettings

pytestmark = pytest.mark.asyncio(loop_scope="module")


def request(**input_fields):
    import json

    policy = input_fields.pop("policy", None)
    body = {"input": {"prompt": "p", **input_fields}}
    if policy:
        body["policy"] = policy
    return parse_job_request(json.dumps(body).encode())


def unchecked(**input_fields):
    """A job request as a test needs it, past the API's limits (policy minima)."""
    policy = input_fields.pop("policy", None)
    return JobRequest.model_validate({"input": {"prompt": "p", **input_fields}, "policy": policy})


class StandIn:
    """Runs a job as ``steps`` chunks ``delay`` s apart; records what ran and what was aborted.
    The prompt ``fail`` raises a client error; ``sampling_params.steps/delay`` shape the job."""

    def __init__(self) -> None:
        self.started: list[str] = []
        self.aborted: list[str] = []
        self.concurrent = 0
        self.max_concurrent = 0

    async def execute(self, record, publish):
        self.started.append(record.id)
        self.concurrent += 1
        self.max_concurrent = max(self.max_concurrent, self.concurrent)
        try:
            params = record.request["input"].get("sampling_params", {})
            if record.request["input"]["prompt"] == "fail":
                raise BadRequestError("input.prompt: refused by the engine", param="input.prompt")
            chunks = []
            for i in range(params.get("steps", 3)):
                await asyncio.sleep(params.get("delay", 0.0))
                chunk = {"n": i, "attempt": record.attempt}
                publish(chunk)
                chunks.append(chunk)
            return chunks
        finally:
            self.concurrent -= 1

    async def abort(self, record):
        self.aborted.append(record.id)


LAYOUT = QueueLayout(heartbeat_timeout_seconds=1.0)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def connections(nats_server):
    made = [
        await QueueConnection.connect(nats_server.url, name=f"c{i}", layout=LAYOUT)
        for i in range(2)
    ]
    yield made
    for connection in made:
        await connection.close()


class Pair:
    """A worker on one connection; a client (another pod, the gateway) on another."""

    def __init__(self, connections, endpoint, *, slots=2, settings=None):
        self.engine = StandIn()
        # Who reported each job end (where the runtime sends its webhook): one per end, total.
        self.ended: list[tuple[str, str, str]] = []
        self.client = QueueJobService(
            connections[1],
            endpoint,
            on_final=lambda r: self.ended.append(("client", r.id, r.status)),
        )
        self.worker_side = QueueJobService(
            connections[0],
            endpoint,
            on_final=lambda r: self.ended.append(("worker", r.id, r.status)),
        )
        self.slots = slots
        self.worker = QueueWorker(
            self.worker_side,
            name="w1",
            execute=self.engine.execute,
            abort=self.engine.abort,
            free_slots=lambda: self.slots,
            settings=settings or WorkerSettings(heartbeat_interval_seconds=0.3, poll_seconds=0.3),
            layout=LAYOUT,
        )


@pytest_asyncio.fixture(loop_scope="module")
async def pair(connections, request):
    endpoint = "tests/" + request.node.name.replace("_", "-")[:50].strip("-")
    made = Pair(connections, endpoint)
    yield made
    await made.worker.stop(0)


async def test_runs_jobs_fifo_within_capacity(pair):
    jobs = [
        await pair.client.submit(request(sampling_params={"delay": 0.05}), sync=False, owner="")
        for _ in range(6)
    ]
    await pair.worker.start()
    done = [await pair.client.wait(j.id, 10, owner="") for j in jobs]
    assert [d.status for d in done] == [JobStatus.COMPLETED] * 6
    assert pair.engine.started == [j.id for j in jobs]
    assert pair.engine.max_concurrent == 2
    assert done[0].output == [
        {"n": 0, "attempt": 1},
        {"n": 1, "attempt": 1},
        {"n": 2, "attempt": 1},
    ]


async def test_low_priority_waits_for_normal_jobs(pair):
    pair.slots = 1
    low = await pair.client.submit(request(policy={"lowPriority": True}), sync=False, owner="")
    normal = [await pair.client.submit(request(), sync=False, owner="") for _ in range(2)]
    await pair.worker.start()
    await pair.client.wait(low.id, 10, owner="")
    assert pair.engine.started == [normal[0].id, normal[1].id, low.id]


async def test_stream_from_another_connection_in_order_nothing_twice(pair):
    await pair.worker.start()
    job = await pair.client.submit(
        request(sampling_params={"steps": 12, "delay": 0.03}), sync=False, owner="a"
    )
    seen = []
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        record, chunks = await pair.client.take_stream(job.id, owner="a")
        seen += chunks
        if record.status.is_final:
            break
        await asyncio.sleep(0.02)
    assert record.status is JobStatus.COMPLETED
    assert [c["n"] for c in seen] == list(range(12))
    assert (await pair.client.take_stream(job.id, owner="a"))[1] == []


async def test_cancel_through_another_connection_aborts_within_a_second(pair):
    await pair.worker.start()
    job = await pair.client.submit(
        request(sampling_params={"steps": 100, "delay": 0.1}), sync=False, owner=""
    )
    async with asyncio.timeout(5):
        while job.id not in pair.engine.started:
            await asyncio.sleep(0.01)
    cancelled_at = time.monotonic()
    assert (await pair.client.cancel(job.id, owner="")).status is JobStatus.CANCELLED
    async with asyncio.timeout(1):
        while job.id not in pair.engine.aborted:
            await asyncio.sleep(0.01)
    assert time.monotonic() - cancelled_at < 1
    await asyncio.sleep(0.3)
    assert (await pair.client.get(job.id, owner="")).status is JobStatus.CANCELLED
    assert pair.worker.running == 0


async def test_engine_error_fails_the_job_with_its_message(pair):
    await pair.worker.start()
    job = await pair.client.submit(request(prompt="fail"), sync=True, owner="")
    done = await pair.client.wait(job.id, 10, owner="")
    assert done.status is JobStatus.FAILED
    assert done.error["type"] == "BadRequestError"
    assert done.error["param"] == "input.prompt"


async def test_execution_timeout_is_timed_out(pair):
    await pair.worker.start()
    # Built without the API's checks: a client's executionTimeout is 5 s at least.
    job = await pair.client.submit(
        unchecked(sampling_params={"steps": 50, "delay": 0.1}, policy={"executionTimeout": 300}),
        sync=True,
        owner="",
    )
    done = await pair.client.wait(job.id, 10, owner="")
    assert done.status is JobStatus.TIMED_OUT
    assert "executionTimeout" in done.error["message"]
    assert job.id in pair.engine.aborted


async def test_silent_worker_loses_its_job_and_attempts_are_bounded(connections):
    # A worker that never reports progress looks dead after the heartbeat timeout (1 s): the
    # job is delivered again; after 3 attempts it ends FAILED saying so.
    endpoint = "tests/silent-worker"
    pair = Pair(
        connections,
        endpoint,
        settings=WorkerSettings(heartbeat_interval_seconds=60, poll_seconds=0.3, max_attempts=3),
    )
    pair.slots = 5  # the silent attempts keep their slots (a dead worker's would be gone)
    job = await pair.client.submit(
        request(sampling_params={"steps": 1, "delay": 30}), sync=False, owner=""
    )
    await pair.worker.start()
    try:
        done = await pair.client.wait(job.id, 15, owner="")
    finally:
        await pair.worker.stop(0)
    assert done.status is JobStatus.FAILED
    assert done.error["code"] == "attempts_exhausted"
    assert "attempted 3 times" in done.error["message"]
    assert pair.engine.started == [job.id] * 3


async def test_retry_runs_a_failed_job_again(pair):
    await pair.worker.start()
    job = await pair.client.submit(request(prompt="fail"), sync=False, owner="")
    await pair.client.wait(job.id, 10, owner="")
    again = await pair.client.retry(job.id, owner="")
    assert again.status is JobStatus.IN_QUEUE
    done = await pair.client.wait(job.id, 10, owner="")
    assert done.status is JobStatus.FAILED
    assert pair.engine.started == [job.id, job.id]


async def test_each_job_end_is_reported_once_by_the_process_that_stored_it(pair):
    await pair.worker.start()
    done = await pair.client.submit(request(), sync=True, owner="")
    await pair.client.wait(done.id, 10, owner="")
    slow = await pair.client.submit(
        request(sampling_params={"steps": 100, "delay": 0.05}), sync=False, owner=""
    )
    async with asyncio.timeout(5):
        while slow.id not in pair.engine.started:
            await asyncio.sleep(0.01)
    await pair.client.cancel(slow.id, owner="")
    async with asyncio.timeout(2):
        while pair.worker.running:
            await asyncio.sleep(0.01)
    await asyncio.sleep(0.2)  # a second report would come now
    assert pair.ended == [
        ("worker", done.id, JobStatus.COMPLETED),
        ("client", slow.id, JobStatus.CANCELLED),
    ]


# ---- job policy on the shared queue (issue 16) ----------------------------------------------


async def until_gone(service, job_id: str, timeout: float = 15.0) -> None:
    async with asyncio.timeout(timeout):
        while await service.states.read(job_id) is not None:
            await asyncio.sleep(0.2)


async def test_a_finished_jobs_record_keeps_its_output_not_its_input(pair):
    await pair.worker.start()
    job = await pair.client.submit(request(), sync=True, owner="")
    done = await pair.client.wait(job.id, 10, owner="")
    assert done.status is JobStatus.COMPLETED and done.output
    stored, _ = await pair.client.states.read(job.id)
    assert "input" not in stored.request and stored.output == done.output
    assert stored.retention_seconds == 60.0 and stored.ttl_seconds == 24 * 3600.0


async def test_a_job_never_runs_past_its_ttl_and_its_record_then_goes(pair):
    await pair.worker.start()
    job = await pair.client.submit(
        # The TTL leaves the started worker time to take the job on a busy machine (else it
        # is a job queued past its TTL, never run: the next test); the job would run 20 s.
        unchecked(sampling_params={"steps": 200, "delay": 0.1}, policy={"ttl": 5000}),
        sync=False,
        owner="",
    )
    done = await pair.client.wait(job.id, 30, owner="")
    assert done.status is JobStatus.TIMED_OUT and done.error["param"] == "policy.ttl"
    assert job.id in pair.engine.aborted
    await until_gone(pair.client, job.id)


async def test_a_job_queued_past_its_ttl_is_never_run(pair):
    job = await pair.client.submit(unchecked(policy={"ttl": 1000}), sync=False, owner="")
    await until_gone(pair.client, job.id)
    await pair.worker.start()
    later = await pair.client.submit(request(), sync=True, owner="")
    assert (await pair.client.wait(later.id, 10, owner="")).status is JobStatus.COMPLETED
    assert pair.engine.started == [later.id]


async def test_a_job_larger_than_the_queues_message_limit_is_a_413(pair):
    limit = pair.client.connection.nc.max_payload
    with pytest.raises(ContentTooLargeError) as info:
        await pair.client.submit(request(prompt="x" * limit), sync=False, owner="")
    assert f"at most {limit} bytes" in info.value.message


async def test_a_job_whose_output_outgrows_its_endpoints_queue_fails_saying_so(nats_server):
    """The endpoint's records are full: the worker keeps what stream output fits and drops the
    rest (never retrying forever), and a result that cannot be stored ends the job FAILED with
    ``queue_full`` -- rather than the job running again to the same end."""
    small = QueueLayout(heartbeat_timeout_seconds=1.0, endpoint_max_bytes=512 * 1024)
    connection = await QueueConnection.connect(nats_server.url, name="small", layout=small)
    service = QueueJobService(connection, "tests/outgrown")

    async def execute(record, publish):
        chunks = [{"n": i, "text": "x" * 60_000} for i in range(12)]  # ~720 KB of output
        for chunk in chunks:
            publish(chunk)
        return chunks

    async def abort(record):
        return None

    worker = QueueWorker(service, name="w", execute=execute, abort=abort, free_slots=lambda: 1,
                         settings=WorkerSettings(poll_seconds=0.2), layout=small)  # fmt: skip
    try:
        job = await service.submit(request(), sync=False, owner="a")
        await worker.start()
        ended = await service.wait(job.id, 30, owner="a")
        assert ended.status is JobStatus.FAILED
        assert ended.error["code"] == "queue_full"
        assert "LLMEP_OPERATOR_JOBS_QUEUE_ENDPOINT_MAX_BYTES" in ended.error["message"]
        _, chunks = await service.take_stream(job.id, owner="a")
        assert 0 < len(chunks) < 12  # what fitted was kept
    finally:
        await worker.stop(0)
        await connection.close()
