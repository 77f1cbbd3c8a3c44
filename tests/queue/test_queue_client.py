"""The queue's job verbs with no engine and no worker: what the gateway relies on."""

from __future__ import annotations

import asyncio

import pytest
import pytest_asyncio
from llmendpoints_common.errors import (
    ConflictError,
    NotFoundError,
    RateLimitError,
    ServiceUnavailableError,
)
from llmendpoints_common.jobs.models import JobStatus, parse_job_request
from llmendpoints_common.queue.client import QueueConnection, QueueJobService
from llmendpoints_common.queue.connect import settle
from llmendpoints_common.queue.depth import endpoint_depth
from llmendpoints_common.queue.topology import QueueLayout, ensure_endpoint_queue

pytestmark = pytest.mark.asyncio(loop_scope="module")

ENDPOINT = "client-test"


def request(body: str):
    return parse_job_request(body.encode())


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def connection(nats_server):
    connection = await QueueConnection.connect(
        nats_server.url, name="test", layout=QueueLayout(max_queue_length=5)
    )
    yield connection
    await connection.close()


@pytest.fixture
def service(connection, request):
    # One endpoint per test: each starts with an empty queue.
    name = f"{ENDPOINT}-{request.node.name.replace('_', '-')}"[:60].lower()
    return QueueJobService(connection, f"tests/{name}")


async def test_depth_with_no_consumer_counts_stream_messages(service):
    depth = await endpoint_depth(service.js, service.endpoint)
    assert (depth.queued, depth.queued_low_priority, depth.running) == (0, 0, 0)
    await service.submit(request('{"input": {"prompt": "a"}}'), sync=False, owner="alice")
    await service.submit(
        request('{"input": {"prompt": "b"}, "policy": {"lowPriority": true}}'),
        sync=False,
        owner="alice",
    )
    depth = await endpoint_depth(service.js, service.endpoint)
    assert (depth.queued, depth.queued_low_priority, depth.running) == (2, 1, 0)
    assert depth.for_scaling == 1


async def test_depth_counts_taken_messages_as_running(service, connection):
    await ensure_endpoint_queue(connection.js, service.endpoint, QueueLayout())
    await service.submit(request('{"input": {"prompt": "a"}}'), sync=False, owner="")
    await service.submit(request('{"input": {"prompt": "b"}}'), sync=False, owner="")
    from llmendpoints_common.queue import names

    sub = await connection.js.pull_subscribe_bind(
        names.jobs_consumer(service.endpoint), stream=names.queue_stream(service.endpoint)
    )
    [msg] = await sub.fetch(1, timeout=2)
    depth = await endpoint_depth(service.js, service.endpoint)
    assert (depth.queued, depth.running) == (1, 1)
    await msg.ack()


async def test_submitted_job_is_readable_by_its_owner_only(service):
    job = await service.submit(request('{"input": {"prompt": "a"}}'), sync=False, owner="alice")
    assert (await service.get(job.id, owner="alice")).status is JobStatus.IN_QUEUE
    assert (await service.get(job.id, owner=None)).owner == "alice"  # an admin sees it
    with pytest.raises(NotFoundError):
        await service.get(job.id, owner="bob")
    with pytest.raises(NotFoundError):
        await service.cancel(job.id, owner="bob")
    with pytest.raises(NotFoundError):
        await service.take_stream(job.id, owner="bob")


async def test_unknown_and_malformed_ids_are_404(service):
    for job_id in ("no-such-job", "not a job id", "a.b", "x" * 300):
        with pytest.raises(NotFoundError) as caught:
            await service.get(job_id, owner=None)
        assert caught.value.param == "id"


async def test_cancel_queued_job_removes_it_from_the_queue(service):
    job = await service.submit(request('{"input": {"prompt": "a"}}'), sync=False, owner="")
    assert (await endpoint_depth(service.js, service.endpoint)).queued == 1
    cancelled = await service.cancel(job.id, owner="")
    assert cancelled.status is JobStatus.CANCELLED
    assert (await endpoint_depth(service.js, service.endpoint)).queued == 0
    with pytest.raises(ConflictError):
        await service.cancel(job.id, owner="")
    with pytest.raises(ConflictError):
        await service.retry(job.id, owner="")


async def test_purge_takes_only_the_callers_queued_jobs(service):
    mine = [
        await service.submit(request('{"input": {"prompt": "a"}}'), sync=False, owner="alice")
        for _ in range(2)
    ]
    theirs = await service.submit(request('{"input": {"prompt": "a"}}'), sync=False, owner="bob")
    assert await service.purge_queue(owner="alice") == 2
    assert [(await service.get(j.id, owner="alice")).status for j in mine] == [
        JobStatus.CANCELLED
    ] * 2
    assert (await service.get(theirs.id, owner="bob")).status is JobStatus.IN_QUEUE
    assert await service.purge_queue(owner=None) == 1  # admin: everyone's
    assert (await endpoint_depth(service.js, service.endpoint)).queued == 0


async def test_idempotency_key_returns_the_first_job(service):
    body = request('{"input": {"prompt": "a"}}')
    first = await service.submit(body, sync=False, owner="alice", idempotency_key="k1")
    again = await service.submit(body, sync=False, owner="alice", idempotency_key="k1")
    other_owner = await service.submit(body, sync=False, owner="bob", idempotency_key="k1")
    other_key = await service.submit(body, sync=False, owner="alice", idempotency_key="k2")
    assert again.id == first.id
    assert len({first.id, other_owner.id, other_key.id}) == 3
    assert (await endpoint_depth(service.js, service.endpoint)).queued == 3


async def test_full_queue_is_429_and_stores_nothing(service):
    for _ in range(5):
        await service.submit(request('{"input": {"prompt": "a"}}'), sync=False, owner="")
    with pytest.raises(RateLimitError) as caught:
        await service.submit(request('{"input": {"prompt": "a"}}'), sync=False, owner="")
    assert caught.value.headers["Retry-After"]
    assert (await endpoint_depth(service.js, service.endpoint)).queued == 5


async def test_a_full_endpoint_is_503_naming_its_bound_and_stops_no_other(nats_server):
    """Each endpoint's records have a bound of their own: past it, that endpoint's new jobs get
    503 naming the setting (nothing half-stored); another endpoint's jobs go on."""
    small = QueueLayout(endpoint_max_bytes=256 * 1024)
    connection = await QueueConnection.connect(nats_server.url, name="small", layout=small)
    full, other = QueueJobService(connection, "tests/full"), QueueJobService(connection, "tests/ok")
    prompt = "x" * 30_000
    try:
        with pytest.raises(ServiceUnavailableError) as caught:
            for _ in range(20):
                await full.submit(
                    request(f'{{"input": {{"prompt": "{prompt}"}}}}'), sync=False, owner="a"
                )
        assert caught.value.code == "queue_full"
        assert "LLMEP_OPERATOR_JOBS_QUEUE_ENDPOINT_MAX_BYTES" in caught.value.message
        assert caught.value.headers["Retry-After"]
        queued = (await endpoint_depth(full.js, full.endpoint)).queued
        assert 0 < queued < 20  # what was accepted is queued, the refused one is not
        job = await other.submit(
            request(f'{{"input": {{"prompt": "{prompt}"}}}}'), sync=False, owner="a"
        )
        assert (await other.get(job.id, owner="a")).status is JobStatus.IN_QUEUE
    finally:
        await connection.close()


async def test_wait_returns_current_state_when_time_runs_out(service):
    job = await service.submit(request('{"input": {"prompt": "a"}}'), sync=True, owner="")
    waited = await service.wait(job.id, 0.2, owner="")
    assert waited.status is JobStatus.IN_QUEUE


async def test_a_wait_learns_of_an_end_its_subscription_never_saw(service, connection):
    """A job that existed before its waiter subscribed can end unseen by the subscription: the
    end's write routed just before the SUB reached the server, stored only after the waiter's
    first read (nats-server queues a stream's writes, answers a direct get at once; seen in
    test_queue_tenancy.py, bench/RESULTS.md). The waiter reads the record again meanwhile, so
    it returns with the end, not when its own time runs out. The lost notification is made on
    cue here: the waiter's subscription is taken off the server under it."""
    job = await service.submit(request('{"input": {"prompt": "a"}}'), sync=False, owner="alice")
    waiting = asyncio.create_task(service.wait(job.id, 60, owner="alice"))
    nc = connection.nc
    subject = service.states.subject(job.id)
    while not (sids := [sid for sid, sub in nc._subs.items() if sub.subject == subject]):
        await asyncio.sleep(0.01)
    await nc._send_unsubscribe(sids[0])  # the server forgets it; the client still waits on it
    await settle(nc)
    assert (await service.cancel(job.id, owner="alice")).status is JobStatus.CANCELLED
    waited = await asyncio.wait_for(waiting, 30)  # well inside the wait's own 60 s
    assert waited.status is JobStatus.CANCELLED


async def test_unreachable_queue_is_503_with_retry_after(tmp_path):
    from integration.nats_kit import NatsServer

    server = NatsServer(store_dir=tmp_path, log_path=tmp_path / "log")
    server.start()
    connection = await QueueConnection.connect(server.url, name="t", request_timeout=1.0)
    service = QueueJobService(connection, "tests/gone")
    server.stop()
    try:
        with pytest.raises(ServiceUnavailableError) as caught:
            await service.submit(request('{"input": {"prompt": "a"}}'), sync=False, owner="")
        assert caught.value.headers["Retry-After"] == "5"
    finally:
        await connection.nc.close()
