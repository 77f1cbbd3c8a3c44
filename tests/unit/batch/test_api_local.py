"""The batch verbs over the local store (a pod without the queue), with a stand-in runner:
routes, owners, bounds, errors -- the same code the gateway runs over NATS
(tests/queue/test_batch_queue.py)."""

from __future__ import annotations

import json

import pytest
from llmendpoints_common.batch.api import BatchAPI, BatchCall
from llmendpoints_common.batch.driver import BatchDrivers
from llmendpoints_common.batch.files import FileEnd, FileStart, FormField, Upload
from llmendpoints_common.batch.limits import BatchLimits
from llmendpoints_common.batch.output import NOT_QUEUED, LineOutcome
from llmendpoints_common.batch.record import line_job_id
from llmendpoints_common.batch.store import StaleRevision, StoreFull
from llmendpoints_common.jobs.models import JobStatus
from llmendpoints_runtime.batches.store import LocalBatchStore

LIMITS = BatchLimits(min_window_seconds=1, window_lines=3)


class Runner:
    """Every request answered at once (its body echoed), unless told to hold them."""

    def __init__(self) -> None:
        self.submitted: list[tuple[str, int]] = []
        self.cancelled: list[tuple[int, bool]] = []
        self.hold = False
        self.states: dict[str, LineOutcome] = {}

    async def submit(self, batch, index, request):
        job = line_job_id(batch.id, index)
        if job in self.states:
            return
        self.submitted.append((batch.id, index))
        if self.hold:
            self.states[job] = LineOutcome(JobStatus.IN_QUEUE)
        else:
            self.states[job] = LineOutcome(JobStatus.COMPLETED, output={"echo": request})

    async def outcome(self, batch, index):
        return self.states.get(line_job_id(batch.id, index), NOT_QUEUED)

    async def cancel(self, batch, index, *, running):
        self.cancelled.append((index, running))
        job = line_job_id(batch.id, index)
        if self.states.get(job, NOT_QUEUED).status is JobStatus.IN_QUEUE:
            self.states[job] = LineOutcome(JobStatus.CANCELLED)


def form(data: bytes, *, fields=(("purpose", "batch"),), after=(), pieces: int = 3) -> Upload:
    """An upload as a front door's multipart reader gives it: ``fields``, the file in
    ``pieces``, then the fields ``after`` it."""

    async def events():
        for name, value in fields:
            yield FormField(name, value)
        yield FileStart("file", "f.jsonl")
        step = max(1, len(data) // pieces)
        for i in range(0, len(data), step):
            yield data[i : i + step]
        yield FileEnd()
        for name, value in after:
            yield FormField(name, value)

    return Upload(events(), declared=len(data) + 200)


def upload(lines) -> Upload:
    return form(b"".join(json.dumps(x).encode() + b"\n" for x in lines))


async def read(reply) -> bytes:
    assert reply.status == 200, reply.body
    return b"".join([chunk async for chunk in reply.content.chunks()])


def chat(i, model="m"):
    return {"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": model, "messages": [{"role": "user", "content": str(i)}]}}  # fmt: skip


@pytest.fixture
def setup(tmp_path):
    store = LocalBatchStore(tmp_path, max_bytes=10_000_000)
    runner = Runner()

    async def resolve(owner, model):
        if model != "m":
            raise LookupError(f"model {model!r} is not served here")
        return "default/local"

    drivers = BatchDrivers(store, runner, holder="pod", limits=LIMITS, resolve=resolve)
    api = BatchAPI(store, runner, LIMITS)
    return api, drivers, runner, store


def create_body(file_id, **extra) -> bytes:
    return json.dumps({"input_file_id": file_id, "endpoint": "/v1/chat/completions",
                       "completion_window": "24h", **extra}).encode()  # fmt: skip


async def drive(drivers, owner, batch_id, times=10):
    for _ in range(times):
        await drivers.step(owner, batch_id)


async def test_a_batch_runs_a_window_at_a_time_and_completes(setup):
    api, drivers, runner, _ = setup
    file = await api.create_file(upload([chat(i) for i in range(7)]), "alice")
    assert file["purpose"] == "batch" and file["bytes"] > 0
    created = await api.openai(BatchCall("POST", "batches", "alice", body=create_body(file["id"])))
    batch_id = created.body["id"]
    runner.hold = True
    await drivers.step("alice", batch_id)  # validates
    await drivers.step("alice", batch_id)  # hands over the first window
    assert [index for _, index in runner.submitted] == [0, 1, 2]
    shown = (await api.openai(BatchCall("GET", f"batches/{batch_id}", "alice"))).body
    assert shown["status"] == "in_progress" and shown["request_counts"]["total"] == 7
    runner.hold = False
    for job in list(runner.states):
        runner.states[job] = LineOutcome(JobStatus.COMPLETED, output={"ok": job})
    await drive(drivers, "alice", batch_id)
    done = (await api.openai(BatchCall("GET", f"batches/{batch_id}", "alice"))).body
    assert done["status"] == "completed" and done["request_counts"]["completed"] == 7
    reply = await api.openai(BatchCall("GET", f"files/{done['output_file_id']}/content", "alice"))
    lines = [json.loads(x) for x in (await read(reply)).splitlines()]
    assert [x["custom_id"] for x in lines] == [f"c{i}" for i in range(7)]
    assert done["error_file_id"] is None


async def test_cancel_takes_back_queued_requests_and_answers_them_cancelled(setup):
    api, drivers, runner, _ = setup
    runner.hold = True
    file = await api.create_file(upload([chat(i) for i in range(5)]), "alice")
    created = await api.create_batch(create_body(file["id"]), "alice")
    await drive(drivers, "alice", created.id, 2)
    cancelled = await api.openai(BatchCall("POST", f"batches/{created.id}/cancel", "alice"))
    assert cancelled.body["status"] == "cancelling"
    await drive(drivers, "alice", created.id)
    assert runner.cancelled == [(0, False), (1, False), (2, False)]  # queued only: running finish
    done = (await api.openai(BatchCall("GET", f"batches/{created.id}", "alice"))).body
    assert done["status"] == "cancelled" and done["request_counts"]["failed"] == 5
    again = await api.openai(BatchCall("POST", f"batches/{created.id}/cancel", "alice"))
    assert again.status == 409 and again.body["error"]["type"] == "ConflictError"


async def test_an_expired_batch_stops_everything_and_answers_expired(setup):
    api, drivers, runner, _store = setup
    runner.hold = True
    file = await api.create_file(upload([chat(i) for i in range(4)]), "alice")
    created = await api.create_batch(create_body(file["id"], completion_window="2s"), "alice")
    await drive(drivers, "alice", created.id, 2)
    drivers.clock = lambda: created.expires_at + 1
    await drive(drivers, "alice", created.id)
    assert {running for _, running in runner.cancelled} == {True}
    done = (await api.openai(BatchCall("GET", f"batches/{created.id}", "alice"))).body
    assert done["status"] == "expired"
    reply = await api.openai(BatchCall("GET", f"files/{done['error_file_id']}/content", "alice"))
    codes = [json.loads(x)["error"]["code"] for x in (await read(reply)).splitlines()]
    assert codes == ["batch_expired"] * 4


async def test_a_model_not_served_fails_validation_naming_the_line(setup):
    api, drivers, _, _ = setup
    file = await api.create_file(upload([chat(0, model="other")]), "alice")
    created = await api.create_batch(create_body(file["id"]), "alice")
    await drivers.step("alice", created.id)
    shown = (await api.openai(BatchCall("GET", f"batches/{created.id}", "alice"))).body
    assert shown["status"] == "failed"
    assert shown["errors"]["data"][0]["code"] == "model_not_found"
    assert shown["errors"]["data"][0]["line"] == 1


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({}, "input_file_id"),
        (
            {"input_file_id": "f", "endpoint": "/v1/responses", "completion_window": "24h"},
            "endpoint",
        ),
        (
            {"input_file_id": "f", "endpoint": "/v1/completions", "completion_window": "1y"},
            "completion_window",
        ),
        (
            {
                "input_file_id": "f",
                "endpoint": "/v1/completions",
                "completion_window": "24h",
                "x": 1,
            },
            "x",
        ),
        (
            {
                "input_file_id": "f",
                "endpoint": "/v1/completions",
                "completion_window": "24h",
                "metadata": {"llmep_x": "1"},
            },
            "metadata.llmep_x",
        ),
        (
            {
                "input_file_id": "f",
                "endpoint": "/v1/completions",
                "completion_window": "24h",
                "metadata": {str(i): "v" for i in range(17)},
            },
            "metadata",
        ),
        (
            {
                "input_file_id": "f",
                "endpoint": "/v1/completions",
                "completion_window": "24h",
                "metadata": {"k": 1},
            },
            "metadata.k",
        ),
        (
            {
                "input_file_id": "f",
                "endpoint": "/v1/completions",
                "completion_window": "24h",
                "output_expires_after": {"anchor": "created_at", "seconds": 5},
            },
            "output_expires_after.seconds",
        ),
    ],
)
async def test_bad_batch_requests_are_400_naming_the_field(setup, body, param):
    api, *_ = setup
    reply = await api.openai(BatchCall("POST", "batches", "alice", body=json.dumps(body).encode()))
    assert reply.status == 400 and reply.body["error"]["param"] == param


async def test_unknown_ids_routes_and_methods(setup):
    api, *_ = setup
    for path in (
        "files/file-nope",
        "files/../../etc",
        "batches/batch_nope",
        "files/file-x/content",
    ):
        reply = await api.openai(BatchCall("GET", path, "alice"))
        assert reply.status == 404, path
    assert (await api.openai(BatchCall("PUT", "batches", "alice"))).status == 405
    assert (await api.openai(BatchCall("GET", "other", "alice"))).status == 404
    missing = await api.openai(BatchCall("POST", "batches", "alice", body=create_body("file-" + "0" * 32)))  # fmt: skip
    assert missing.status == 404 and missing.body["error"]["param"] == "input_file_id"


async def test_listing_pages_and_owners(setup):
    api, *_ = setup
    ids = [(await api.create_file(upload([chat(i)]), "alice"))["id"] for i in range(3)]
    await api.create_file(upload([chat(9)]), "bob")
    listed = (await api.openai(BatchCall("GET", "files", "alice", query={"order": "asc", "limit": "2"}))).body  # fmt: skip
    assert [f["id"] for f in listed["data"]] == ids[:2] and listed["has_more"]
    rest = (await api.openai(BatchCall("GET", "files", "alice", query={"order": "asc", "after": ids[1]}))).body  # fmt: skip
    assert [f["id"] for f in rest["data"]] == ids[2:] and not rest["has_more"]
    newest = (await api.openai(BatchCall("GET", "files", "alice"))).body["data"][0]["id"]
    assert newest == ids[2]
    assert (await api.openai(BatchCall("GET", f"files/{ids[0]}", "bob"))).status == 404
    assert (await api.openai(BatchCall("DELETE", f"files/{ids[0]}", "bob"))).status == 404
    deleted = await api.openai(BatchCall("DELETE", f"files/{ids[0]}", "alice"))
    assert deleted.body == {"id": ids[0], "object": "file", "deleted": True}
    bad = await api.openai(BatchCall("GET", "files", "alice", query={"limit": "0"}))
    assert bad.status == 400 and bad.body["error"]["param"] == "limit"


async def test_per_key_bounds(setup):
    _api, _, runner, store = setup
    tight = BatchAPI(store, runner, BatchLimits(max_bytes_per_key=500, max_active_batches_per_key=1, min_window_seconds=1))  # fmt: skip
    first = await tight.create_file(upload([chat(0)]), "erin")
    refused = await tight.openai(BatchCall("POST", "files", "erin", upload=upload([chat(i) for i in range(5)])))  # fmt: skip
    assert refused.status == 429 and refused.body["error"]["code"] == "storage_limit_exceeded"
    await tight.create_batch(create_body(first["id"]), "erin")
    refused = await tight.openai(
        BatchCall("POST", "batches", "erin", body=create_body(first["id"]))
    )
    assert (
        refused.status == 429
        and "LLMEP_BATCH_MAX_ACTIVE_PER_KEY" in refused.body["error"]["message"]
    )


async def test_runpod_routes_on_the_local_store(setup):
    api, drivers, runner, _ = setup
    endpoint, name = "default/local", "local"

    async def call(method, path, body=None, query=None):
        raw = b"" if body is None else json.dumps(body).encode()
        return await api.runpod(BatchCall(method, path, "alice", query=query or {}, body=raw), endpoint, name)  # fmt: skip

    created = await call("POST", "", [{"input": {"prompt": "a"}}, {"input": {"prompt": "b"}}])
    batch_id = created.body["id"]
    assert created.body == {"id": batch_id, "status": "DRAFT"}
    assert (await call("POST", f"/{batch_id}/requests", {"requests": [{"input": {"prompt": "c"}}]})).body["requestTotal"] == 3  # fmt: skip
    page = (await call("GET", f"/{batch_id}/requests", query={"limit": "2"})).body
    assert (page["total"], page["hasMore"], len(page["requests"])) == (3, True, 2)
    assert (await call("DELETE", f"/{batch_id}/requests/{page['requests'][0]['id']}")).body["requestTotal"] == 2  # fmt: skip
    assert (await call("DELETE", f"/{batch_id}/requests/nope")).status == 404
    # A request id whose number is not in ASCII digits ("²".isdigit() is true): a 400 naming
    # the field, not a 500.
    for odd in ("\u00b2", "\u0661", "1.5", ""):  # superscript two, Arabic-Indic one
        bad = await call("DELETE", f"/{batch_id}/requests/{batch_id.removeprefix('batch_')}-{odd}")
        assert bad.status == 400 and bad.body["error"]["param"] == "requestId", odd
    assert (await call("GET", f"/{batch_id}/requests", query={"limit": "²"})).status == 400
    await drivers.step("alice", batch_id)  # a draft is not run
    assert runner.submitted == []
    assert (await call("POST", f"/{batch_id}/finalize")).body["status"] == "FINALIZED"
    await drive(drivers, "alice", batch_id)
    summary = (await call("GET", f"/{batch_id}")).body
    assert (summary["requestTotal"], summary["requestCompleted"]) == (2, 2)
    results = (await call("GET", f"/{batch_id}/requests")).body["requests"]
    assert [r["output"]["echo"]["input"]["prompt"] for r in results] == ["b", "c"]
    other = await api.runpod(BatchCall("GET", f"/{batch_id}", "bob"), endpoint, name)
    assert other.status == 404 and other.body["id"] == batch_id
    elsewhere = await api.runpod(BatchCall("GET", f"/{batch_id}", "alice"), "default/other", "other")  # fmt: skip
    assert elsewhere.status == 404
    assert (await call("GET", "")).body["batches"][0]["id"] == batch_id
    bad = await call("POST", "", {"requests": "x"})
    assert bad.status == 400 and bad.body["error"]["param"] == "requests"


async def test_the_local_store_compares_and_sets_and_is_bounded(tmp_path):
    from llmendpoints_common.batch.files import FileRecord

    store = LocalBatchStore(tmp_path, max_bytes=100)
    record = FileRecord(id="file-" + "1" * 32, owner="a", filename="f", purpose="batch", bytes=50,
                        created_at=0, expires_at=1e12)  # fmt: skip
    writer = await store.write_file("a", record.id, 3600)
    await writer.write(b"x" * 50)
    await writer.commit(record)
    second = await store.write_file("a", "file-" + "2" * 32, 3600)
    with pytest.raises(StoreFull, match="LLMEP_BATCH_LOCAL_MAX_BYTES"):
        await second.write(b"y" * 60)
    await second.abort()
    left = sorted(p.name for p in (tmp_path / "files").rglob("*") if p.is_file())
    assert left == sorted([record.id, f"{record.id}.json"])  # nothing of the refused one
    assert await store.file("b", record.id) is None  # another owner
    content = await store.open_file("a", record.id)
    assert content.size == 50
    assert b"".join([c async for c in content.chunks()]) == b"x" * 50
    from llmendpoints_common.batch.record import BatchRecord, BatchStatus

    batch = BatchRecord(id="batch_" + "3" * 32, api="openai", owner="a", created_at=0,
                        expires_at=1e12, completion_window="24h", status=BatchStatus.VALIDATING)  # fmt: skip
    assert await store.write_batch(batch, 0) == 1
    with pytest.raises(StaleRevision):
        await store.write_batch(batch, 0)
    assert await store.active() == [("a", batch.id)]
    assert await store.sweep(0) == 0
    assert await store.sweep(2e12) == 1  # the file expired


async def test_concurrent_uploads_against_a_bound_of_5_store_5(setup):
    """Each upload reserves its file before any of its bytes is stored, so uploads that run
    together cannot all pass the key's bound."""
    import asyncio

    _api, _, runner, store = setup
    tight = BatchAPI(store, runner, BatchLimits(max_files_per_key=5, min_window_seconds=1))

    def slow(i):
        async def events():
            yield FormField("purpose", "batch")
            yield FileStart("file", f"f{i}.jsonl")
            await asyncio.sleep(0.05)  # all of them under way at once
            yield json.dumps(chat(i)).encode() + b"\n"
            yield FileEnd()

        return Upload(events(), declared=400)

    replies = await asyncio.gather(
        *(tight.openai(BatchCall("POST", "files", "gina", upload=slow(i))) for i in range(20))
    )
    assert sorted(r.status for r in replies) == [200] * 5 + [429] * 15
    refused = next(r for r in replies if r.status == 429)
    assert refused.body["error"]["code"] == "file_limit_exceeded"
    assert "LLMEP_BATCH_MAX_FILES_PER_KEY" in refused.body["error"]["message"]
    assert len(await store.files("gina")) == 5
    # A file deleted gives its room back at once.
    first = next(r for r in replies if r.status == 200).body["id"]
    assert (await tight.openai(BatchCall("DELETE", f"files/{first}", "gina"))).status == 200
    again = await tight.openai(BatchCall("POST", "files", "gina", upload=slow(99)))
    assert again.status == 200


async def test_an_upload_refused_or_cut_stores_nothing_and_lets_its_room_go(setup, tmp_path):
    api, _, _, store = setup
    data = json.dumps(chat(0)).encode() + b"\n"
    # The wrong purpose before the file: refused before a byte of it is stored.
    bad = await api.openai(BatchCall("POST", "files", "hal", upload=form(data, fields=[("purpose", "fine-tune")])))  # fmt: skip
    assert bad.status == 400 and bad.body["error"]["param"] == "purpose"
    # After it: refused at the end, and what was stored goes.
    late = await api.openai(
        BatchCall("POST", "files", "hal", upload=form(data, fields=(), after=[("purpose", "x")]))
    )
    assert late.status == 400 and late.body["error"]["param"] == "purpose"
    # expires_after sets how long the bytes are kept: it must come before them.
    expiry = await api.openai(BatchCall("POST", "files", "hal", upload=form(data, after=[("expires_after[seconds]", "7200")])))  # fmt: skip
    assert expiry.status == 400 and expiry.body["error"]["param"] == "expires_after"

    class Gone(Exception):
        pass

    async def cut():
        yield FormField("purpose", "batch")
        yield FileStart("file", "f.jsonl")
        yield data
        raise Gone()  # the client left mid-upload

    with pytest.raises(Gone):
        await api.openai(BatchCall("POST", "files", "hal", upload=Upload(cut(), declared=999)))
    assert await store.files("hal") == []
    assert [p for p in (tmp_path / "files").rglob("*") if p.is_file()] == []
    room, _ = await store.room("hal")
    assert room.holds == {}
    # A purpose sent after the file is fine.
    fine = await api.openai(
        BatchCall(
            "POST", "files", "hal", upload=form(data, fields=(), after=[("purpose", "batch")])
        )
    )
    assert fine.status == 200 and fine.body["bytes"] == len(data)


async def test_a_long_validation_keeps_its_lease_and_stores_its_input_in_parts(tmp_path):
    """The input streams from the store a chunk at a time; while it is read the driver keeps
    renewing its lease (another host would take a batch whose lease ran out), and the requests
    are stored as parts as they pass."""
    now = [1000.0]

    def clock() -> float:
        now[0] += 0.2  # every look at the clock: a long read
        return now[0]

    store = LocalBatchStore(tmp_path, max_bytes=100_000_000, clock=clock)

    async def resolve(owner, model):
        return "default/local"

    drivers = BatchDrivers(
        store, Runner(), holder="pod", limits=LIMITS, resolve=resolve, clock=clock,
        lease_seconds=2.0,
    )  # fmt: skip
    api = BatchAPI(store, Runner(), LIMITS, clock=clock)
    lines = [{**chat(i), "body": {**chat(i)["body"], "pad": "x" * 1000}} for i in range(3000)]
    file = await api.create_file(upload(lines), "alice")
    assert file["bytes"] > 3 * 1024 * 1024  # several of the store's 1 MiB chunks
    created = await api.create_batch(create_body(file["id"]), "alice")
    leases = []
    write = store.write_batch

    async def watched(record, revision):
        leases.append(record.lease_until)
        return await write(record, revision)

    store.write_batch = watched
    await drivers.step("alice", created.id)
    record, _ = await store.batch("alice", created.id)
    assert record.status.value == "in_progress" and record.total == 3000
    # Taken, renewed while the file was read, and the renewed lease kept by the last write.
    assert len(leases) >= 3 and leases[-1] == leases[-2] > leases[0]
    assert sum(record.parts) == 3000 and len(record.parts) == 3  # PART_LINES each
