"""Batches on a real nats-server with a stand-in for the engine (the real engines run in
tests/gateway/test_batches.py): the store (records, the object store), the driver, the batch
lane and the worker's rules for it -- everything but vLLM.

- a batch runs to ``completed``: every request answered once, in the output or the error file;
- the batch lane is the lowest: a worker takes a batch request only with batch slots free and
  no normal or low-priority job waiting;
- a driver that stops mid-batch (its host gone) is replaced by another that finishes it, with
  every request answered once;
- files and batches belong to their owner; bounds per key answer 429, reserved before any byte
  is stored (20 uploads at once against a bound of 5 store 5);
- listings read the bucket without making a consumer: a thousand leave none behind.
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest
import pytest_asyncio
from llmendpoints_common.batch.api import BatchAPI, BatchCall
from llmendpoints_common.batch.driver import BatchDrivers
from llmendpoints_common.batch.files import FileEnd, FileStart, FormField, Upload
from llmendpoints_common.batch.limits import BatchLimits
from llmendpoints_common.errors import BadRequestError
from llmendpoints_common.jobs.models import parse_job_request
from llmendpoints_common.queue.batch_lines import QueueLines
from llmendpoints_common.queue.batch_store import NatsBatchStore
from llmendpoints_common.queue.client import QueueConnection, QueueJobService
from llmendpoints_common.queue.topology import QueueLayout
from llmendpoints_common.queue.worker import QueueWorker, WorkerSettings

pytestmark = pytest.mark.asyncio(loop_scope="module")

ENDPOINT = "team-a/chat"
LAYOUT = QueueLayout(heartbeat_timeout_seconds=1.0)
LIMITS = BatchLimits(min_window_seconds=1, window_lines=8, max_errors=10)


class Engine:
    """Answers a chat request like vLLM would (a fixed reply, its usage); a body with
    ``"fail": true`` is refused as the engine refuses a bad request."""

    def __init__(self, delay: float = 0.0) -> None:
        self.delay = delay
        self.ran: list[str] = []
        self.batch_running = 0
        self.max_batch_running = 0
        self.order: list[str] = []

    async def execute(self, record, publish):
        self.ran.append(record.id)
        self.order.append("batch" if record.batch else "job")
        body = record.request["input"].get("openai_input") or {}
        self.batch_running += record.batch is not None
        self.max_batch_running = max(self.max_batch_running, self.batch_running)
        try:
            await asyncio.sleep(self.delay)
            if body.get("fail"):
                raise BadRequestError("fail: refused by the engine", param="fail")
            return {
                "object": "chat.completion",
                "choices": [{"message": {"content": f"re: {body['messages'][0]['content']}"}}],
                "usage": {"prompt_tokens": 3, "completion_tokens": 2},
            }
        finally:
            self.batch_running -= record.batch is not None

    async def abort(self, record):
        pass


def upload(lines: list[dict | str], *, pause: float = 0.0) -> Upload:
    """The upload as the gateway's multipart reader gives it: the purpose, the file in two
    pieces (``pause`` seconds apart)."""
    data = b"".join(
        (line if isinstance(line, str) else json.dumps(line)).encode() + b"\n" for line in lines
    )

    async def events():
        yield FormField("purpose", "batch")
        yield FileStart("file", "in.jsonl")
        yield data[: len(data) // 2]
        await asyncio.sleep(pause)
        yield data[len(data) // 2 :]
        yield FileEnd()

    return Upload(events(), declared=len(data) + 300)


def chat_line(i: int, **extra) -> dict:
    body = {"model": "chat", "messages": [{"role": "user", "content": f"q{i}"}], **extra}
    return {"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}


def batch_body(file_id: str, **extra) -> bytes:
    """``POST /v1/batches``'s body: chat completions in the 24 h window."""
    return json.dumps(
        {
            "input_file_id": file_id,
            "endpoint": "/v1/chat/completions",
            "completion_window": "24h",
            **extra,
        }
    ).encode()


async def start_batch(api: BatchAPI, owner: str, lines: list[dict | str]):
    """An input file of ``lines`` and a batch on it (its record)."""
    file = await api.create_file(upload(lines), owner)
    return await api.create_batch(batch_body(file["id"]), owner)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def connection(nats_server):
    connection = await QueueConnection.connect(nats_server.url, name="batch", layout=LAYOUT)
    yield connection
    await connection.close()


def make_drivers(connection, holder: str, **kwargs) -> tuple[BatchDrivers, BatchAPI]:
    store = NatsBatchStore(connection)
    lines = QueueLines(connection)

    async def resolve(owner: str, model: str) -> str:
        if model != "chat":
            raise LookupError(f"the model {model!r} does not exist")
        return ENDPOINT

    drivers = BatchDrivers(
        store, lines, holder=holder, limits=LIMITS, resolve=resolve, tick_seconds=0.1, **kwargs
    )
    api = BatchAPI(store, lines, LIMITS, wake=drivers.wake)
    return drivers, api


def make_worker(connection, engine: Engine, *, slots: int, batch_slots: int) -> QueueWorker:
    service = QueueJobService(connection, ENDPOINT)
    return QueueWorker(
        service,
        name="w",
        execute=engine.execute,
        abort=engine.abort,
        free_slots=lambda: slots,
        batch_slots=lambda: batch_slots,
        settings=WorkerSettings(heartbeat_interval_seconds=0.3, poll_seconds=0.5),
        layout=LAYOUT,
    )


async def wait_batch(api: BatchAPI, owner: str, batch_id: str, statuses, timeout=60.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        reply = await api.openai(BatchCall("GET", f"batches/{batch_id}", owner))
        if reply.body["status"] in statuses:
            return reply.body
        await asyncio.sleep(0.1)
    raise AssertionError(f"batch {batch_id} never reached {statuses}: {reply.body}")


async def content(api: BatchAPI, owner: str, file_id: str) -> list[dict]:
    reply = await api.openai(BatchCall("GET", f"files/{file_id}/content", owner))
    assert reply.status == 200, reply.body
    data = b"".join([chunk async for chunk in reply.content.chunks()])
    assert len(data) == reply.content.size
    return [json.loads(line) for line in data.splitlines()]


async def test_a_batch_completes_with_every_request_answered_once(connection):
    drivers, api = make_drivers(connection, "g1")
    engine = Engine()
    worker = make_worker(connection, engine, slots=4, batch_slots=4)
    await drivers.start()
    await worker.start()
    try:
        lines = [chat_line(i) for i in range(30)] + [chat_line(30, fail=True)]
        file = await api.create_file(upload(lines), "alice")
        created = await api.openai(
            BatchCall(
                "POST",
                "batches",
                "alice",
                body=batch_body(file["id"], metadata={"run": "one"}),
            )
        )
        assert created.status == 200, created.body
        assert created.body["status"] == "validating"
        done = await wait_batch(api, "alice", created.body["id"], {"completed", "failed"})
        assert done["status"] == "completed", done
        assert done["request_counts"] == {"total": 31, "completed": 30, "failed": 1}
        assert done["usage"]["input_tokens"] == 90 and done["usage"]["output_tokens"] == 60
        outputs = await content(api, "alice", done["output_file_id"])
        errors = await content(api, "alice", done["error_file_id"])
        assert sorted(o["custom_id"] for o in outputs) == sorted(f"c{i}" for i in range(30))
        assert [e["custom_id"] for e in errors] == ["c30"]
        assert errors[0]["response"]["status_code"] == 400
        assert errors[0]["response"]["body"]["error"]["param"] == "fail"
        first = next(o for o in outputs if o["custom_id"] == "c7")
        assert first["response"]["body"]["choices"][0]["message"]["content"] == "re: q7"
        assert engine.max_batch_running <= 4
        # Another owner sees none of it.
        other = await api.openai(BatchCall("GET", f"batches/{created.body['id']}", "bob"))
        assert other.status == 404
        other = await api.openai(BatchCall("GET", f"files/{done['output_file_id']}/content", "bob"))
        assert other.status == 404
        listed = await api.openai(BatchCall("GET", "batches", "bob"))
        assert listed.body["data"] == []
    finally:
        await worker.stop(5)
        await drivers.stop()


async def test_a_bad_file_fails_the_batch_naming_its_lines(connection):
    drivers, api = make_drivers(connection, "g1")
    await drivers.start()
    try:
        lines = [chat_line(0), "not json", chat_line(0), chat_line(2, model="other")]
        created = await start_batch(api, "alice", lines)
        failed = await wait_batch(api, "alice", created.id, {"failed"})
        codes = [(e["code"], e["line"]) for e in failed["errors"]["data"]]
        assert codes == [
            ("invalid_json_line", 2),
            ("duplicate_custom_id", 3),
            ("mismatched_model", 4),
        ]
    finally:
        await drivers.stop()


async def test_the_batch_lane_waits_for_every_job(connection):
    """Jobs queued in the normal and low lanes all run before any request of a batch."""
    drivers, api = make_drivers(connection, "g1")
    engine = Engine(delay=0.05)
    service = QueueJobService(connection, ENDPOINT)
    await drivers.start()
    try:
        created = await start_batch(api, "alice", [chat_line(i) for i in range(6)])
        # The batch's first window is queued before any worker runs...
        await wait_batch(api, "alice", created.id, {"in_progress"})
        for _ in range(3):
            await service.submit(
                parse_job_request(json.dumps({"input": {"prompt": "hi"}}).encode()),
                sync=False,
                owner="alice",
            )
            await service.submit(
                parse_job_request(
                    json.dumps(
                        {"input": {"prompt": "hi"}, "policy": {"lowPriority": True}}
                    ).encode()
                ),
                sync=False,
                owner="alice",
            )
        worker = make_worker(connection, engine, slots=1, batch_slots=1)
        await worker.start()
        try:
            await wait_batch(api, "alice", created.id, {"completed"})
        finally:
            await worker.stop(5)
        # ...and yet every job ran first.
        assert engine.order[:6] == ["job"] * 6
        assert engine.order[6:] == ["batch"] * 6
    finally:
        await drivers.stop()


async def test_no_batch_request_runs_without_batch_slots(connection):
    drivers, api = make_drivers(connection, "g1")
    engine = Engine()
    await drivers.start()
    worker = make_worker(connection, engine, slots=4, batch_slots=0)
    await worker.start()
    try:
        created = await start_batch(api, "alice", [chat_line(0)])
        await wait_batch(api, "alice", created.id, {"in_progress"})
        await asyncio.sleep(1.5)  # several of the worker's polls
        assert engine.ran == []
        cancelled = await api.openai(BatchCall("POST", f"batches/{created.id}/cancel", "alice"))
        assert cancelled.body["status"] == "cancelling"
        done = await wait_batch(api, "alice", created.id, {"cancelled"})
        errors = await content(api, "alice", done["error_file_id"])
        assert [(e["custom_id"], e["error"]["code"]) for e in errors] == [("c0", "batch_cancelled")]
        assert done["output_file_id"] is None
    finally:
        await worker.stop(5)
        await drivers.stop()


async def test_another_driver_takes_over_and_answers_each_request_once(connection):
    """The first host drives part of a batch and stops (its lease left to run out); a second
    host takes over from the job records and finishes it."""
    first, api = make_drivers(connection, "g1", lease_seconds=1.0)
    engine = Engine(delay=0.02)
    worker = make_worker(connection, engine, slots=2, batch_slots=2)
    await first.start()
    await worker.start()
    second = None
    try:
        created = await start_batch(api, "alice", [chat_line(i) for i in range(40)])
        deadline = time.monotonic() + 30
        while len(engine.ran) < 10 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await first.stop()  # as if its gateway was killed: the lease is left to expire
        second, _ = make_drivers(connection, "g2", lease_seconds=1.0)
        await second.start()
        done = await wait_batch(api, "alice", created.id, {"completed"})
        assert done["request_counts"] == {"total": 40, "completed": 40, "failed": 0}
        outputs = await content(api, "alice", done["output_file_id"])
        assert sorted(o["custom_id"] for o in outputs) == sorted(f"c{i}" for i in range(40))
        assert len(set(engine.ran)) == 40
    finally:
        await worker.stop(5)
        if second is not None:
            await second.stop()


async def test_keys_are_bounded(connection):
    _, api = make_drivers(connection, "g1")
    tight = BatchAPI(api.store, api.runner, BatchLimits(max_files_per_key=1, min_window_seconds=1))
    await tight.create_file(upload([chat_line(0)]), "carol")
    refused = await tight.openai(BatchCall("POST", "files", "carol", upload=upload([chat_line(0)])))
    assert refused.status == 429
    assert "LLMEP_BATCH_MAX_FILES_PER_KEY" in refused.body["error"]["message"]
    few_tokens = BatchAPI(
        api.store, api.runner, BatchLimits(max_enqueued_tokens_per_key=10, min_window_seconds=1)
    )
    file = await api.create_file(upload([chat_line(i) for i in range(5)]), "dave")
    refused = await few_tokens.openai(
        BatchCall(
            "POST",
            "batches",
            "dave",
            body=batch_body(file["id"]),
        )
    )
    assert refused.status == 429
    assert refused.body["error"]["code"] == "enqueued_token_limit_exceeded"


async def test_20_uploads_at_once_against_a_bound_of_5_store_5(connection):
    """The key's room is reserved by compare-and-set before any byte is stored."""
    _, api = make_drivers(connection, "g1")
    tight = BatchAPI(api.store, api.runner, BatchLimits(max_files_per_key=5, min_window_seconds=1))
    replies = await asyncio.gather(
        *(
            tight.openai(
                BatchCall("POST", "files", "ivy", upload=upload([chat_line(i)], pause=0.2))
            )
            for i in range(20)
        )
    )
    assert sorted(r.status for r in replies) == [200] * 5 + [429] * 15
    assert {r.body["error"]["code"] for r in replies if r.status == 429} == {"file_limit_exceeded"}
    assert len(await api.store.files("ivy")) == 5
    listed = await tight.openai(BatchCall("GET", "files", "ivy"))
    assert sorted(f["id"] for f in listed.body["data"]) == sorted(
        r.body["id"] for r in replies if r.status == 200
    )


async def test_a_thousand_listings_leave_no_consumer(connection):
    """Listings are batched direct gets: no consumer is made (a watcher's stayed 5 minutes
    each, and a thousand of them filled what the account allows)."""
    _, api = make_drivers(connection, "g1")
    for i in range(3):
        await api.create_file(upload([chat_line(i)]), "jay")
    stream = "KV_LLMEP_BATCHES"
    before = (await connection.js.stream_info(stream)).state.consumer_count
    for _ in range(1000):
        listed = await api.openai(BatchCall("GET", "files", "jay"))
        assert len(listed.body["data"]) == 3
    await api.openai(BatchCall("GET", "batches", "jay"))
    await api.store.active()
    assert (await connection.js.stream_info(stream)).state.consumer_count == before == 0


async def test_a_batch_beyond_the_per_owner_cap_waits_for_room_and_completes(tmp_path):
    """The queue holds at most 3 requests of one key per lane (the jobs stream's per-subject
    limit); the batch's windows are 8. It still completes, every request answered once, and
    the key's own jobs are not crowded out by its batch."""
    from integration.nats_kit import running_nats

    with running_nats(tmp_path) as server:
        connection = await QueueConnection.connect(
            server.url,
            name="capped",
            layout=QueueLayout(heartbeat_timeout_seconds=1.0, max_queued_per_owner=3),
        )
        drivers, api = make_drivers(connection, "g1")
        engine = Engine(delay=0.05)
        worker = make_worker(connection, engine, slots=1, batch_slots=1)
        await drivers.start()
        try:
            created = await start_batch(api, "erin", [chat_line(i) for i in range(20)])
            await wait_batch(api, "erin", created.id, {"in_progress"})
            service = QueueJobService(connection, ENDPOINT)
            job = await service.submit(
                parse_job_request(b'{"input": {"prompt": "hi"}}'), sync=False, owner="erin"
            )
            await worker.start()
            done = await wait_batch(api, "erin", created.id, {"completed"})
            assert done["request_counts"] == {"total": 20, "completed": 20, "failed": 0}
            outputs = await content(api, "erin", done["output_file_id"])
            assert sorted(o["custom_id"] for o in outputs) == sorted(f"c{i}" for i in range(20))
            assert len(engine.ran) == len(set(engine.ran)) == 21
            assert job.id in engine.ran
        finally:
            await worker.stop(5)
            await drivers.stop()
            await connection.close()
