"""The chart's NATS, configured exactly as the chart renders it (nats.conf, the keys Secret, the
init container's trust and routes files: nats_chart_kit), with each role's real credential:

- the gateway's (its init container's own command) limits, meters and serves jobs;
- an endpoint's (what the operator mints into <endpoint>-queue-creds) runs that endpoint's
  queue end to end -- the real QueueJobService, QueueWorker, depth and /health -- once the
  operator's credential has created the streams and the endpoint's consumers;
- and refuses, on the server, everything else: another endpoint's records, jobs, chunks,
  consumers, cancels and replies, the quotas, usage records, and every delete or purge, which
  the gateway's credential is refused too.

A refused request waits out its timeout (the server answers nothing; its log says "Publish
Violation" or "Subscription Violation"); each test also checks that nothing changed.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import nats
import nats.errors
import pytest
from llmendpoints_common.identity import EndpointRef
from llmendpoints_common.jobs.models import JobStatus, parse_job_request
from llmendpoints_common.queue import names, signals
from llmendpoints_common.queue.client import QueueConnection, QueueJobService
from llmendpoints_common.queue.depth import endpoint_depth
from llmendpoints_common.queue.topology import QueueLayout, ensure_consumers
from llmendpoints_common.queue.trust import Signer, mint
from llmendpoints_common.queue.worker import QueueWorker, WorkerSettings
from nats.aio.client import RawCredentials

from .helm_kit import render
from .nats_chart_kit import lay_out, running

A = EndpointRef("team-a", "chat")
B = EndpointRef("team-b", "chat")  # the same name, another namespace
REFUSED = 0.5  # seconds a refused request is given (the server never answers it)


@pytest.fixture(scope="module")
def chart_nats(helm: Path, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("chart-nats")
    docs = render(helm, tmp, {"queue": {"enabled": True, "nats": {"replicas": 1}}, "gateway": {"enabled": True}})  # fmt: skip
    nats_files, _ = lay_out(docs, tmp / "pod")
    gateway_pod = next(
        d for d in docs if d["kind"] == "Deployment" and "gateway" in d["metadata"]["name"]
    )["spec"]["template"]["spec"]
    with running(nats_files) as server:
        yield server, nats_files, gateway_pod, tmp


def _signer(chart_nats) -> Signer:
    return Signer.from_dir(chart_nats[1].keys)


def _creds(chart_nats, role: str, endpoint: EndpointRef | None = None) -> str:
    return mint(_signer(chart_nats), role, endpoint, issued_at=int(time.time()))


def _gateway_creds_file(chart_nats) -> str:
    """The gateway pod's init container, run as it is in the pod (its paths moved here)."""
    _, files, gateway_pod, tmp = chart_nats
    (init,) = gateway_pod["initContainers"]
    out = tmp / "gateway-creds"
    out.mkdir(exist_ok=True)
    command = [
        part.replace("/etc/llmendpoints/queue-keys", str(files.keys)).replace(
            "/etc/llmendpoints/queue", str(out)
        )
        for part in init["command"]
    ]
    bin_dir = Path(sys.executable).parent
    done = subprocess.run([str(bin_dir / command[0]), *command[1:]], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return str(out / "queue.creds")


async def _connect(url: str, creds: str, name: str, timeout: float = 5.0) -> QueueConnection:
    return await QueueConnection.connect(url, name=name, creds=creds, request_timeout=timeout)


async def _refused(call) -> None:
    with pytest.raises((nats.errors.TimeoutError, TimeoutError)):
        await call


def test_the_chart_lets_the_gateway_limit_and_meter(chart_nats):
    from llmendpoints_common.jobs.record import claim, finish
    from llmendpoints_common.queue.state import JobStates
    from llmendpoints_gateway.keys import Key
    from llmendpoints_gateway.limiter import Limiter
    from llmendpoints_gateway.metering import UsageRecord
    from llmendpoints_gateway.queue import SharedQueue
    from llmendpoints_gateway.quotas import Limits
    from llmendpoints_gateway.usage import JobUsageMeter, UsagePublisher, read_usage

    server = chart_nats[0]
    url = server.url
    gateway_creds = _gateway_creds_file(chart_nats)

    async def scenario() -> None:
        # The operator creates the streams (nobody else's credential may).
        operator = await _connect(url, _creds(chart_nats, "operator"), "operator")
        queue = SharedQueue(url, "g", gateway_creds)  # the gateway's one connection
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
        connection = await QueueConnection.connect(url, name="gw", creds_file=gateway_creds)
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

            usage.record(UsageRecord("r1", time.time(), "team", A.id, "m", 200, 1, 2))
            jobs = QueueJobService(connection, A)
            job = await jobs.submit(
                parse_job_request(b'{"input": {"prompt": "x"}}'), sync=False, owner="team"
            )
            states = JobStates(connection.js, A)
            now = time.time()
            await states.update(job.id, lambda r: claim(r, now=now, worker="w"))
            output = [{"usage": {"input": 1, "output": 1}}]
            await states.update(
                job.id, lambda r: finish(r, JobStatus.COMPLETED, now=now, output=output)
            )
            while not counted or usage.pending:
                assert time.monotonic() < deadline, "the job's usage was not counted"
                await asyncio.sleep(0.05)
            ids = {r.id for r in await read_usage(url, now - 60, None, gateway_creds)}
            assert ids == {"r1", f"job-{job.id}-usage"}
            # The gateway's /cancel and /purge-queue take queued jobs' messages out.
            before = (await endpoint_depth(connection.js, A)).queued
            queued = await jobs.submit(
                parse_job_request(b'{"input": {"prompt": "y"}}'), sync=False, owner="team"
            )
            assert (await endpoint_depth(connection.js, A)).queued == before + 1
            await jobs.cancel(queued.id, owner="team")
            assert (await endpoint_depth(connection.js, A)).queued == before
        finally:
            await connection.close()
            await operator.close()
            await meter.stop()
            await usage.stop()
            await limiter.stop()
            await queue.stop()

    asyncio.run(scenario())
    assert not server.violations(), server.violations()


def test_an_endpoints_pods_work_with_their_own_credential_only(chart_nats):
    """A's credential alone: submit (with an Idempotency-Key), run on the real worker with
    stream chunks, wait, stream, health, cancel, retry, purge -- no violation."""
    server = chart_nats[0]
    A = EndpointRef("team-a", "work")  # its own endpoint: the server is the module's

    async def scenario() -> None:
        operator = await _connect(server.url, _creds(chart_nats, "operator"), "operator")
        await ensure_consumers(operator.js, A, QueueLayout())
        pod = await _connect(server.url, _creds(chart_nats, "runtime", A), "pod-a")
        service = QueueJobService(pod, A)

        async def execute(record, publish):
            if record.request["input"].get("prompt") == "fail":
                raise ValueError("no")
            publish({"n": 1})
            publish({"n": 2})
            return [{"n": 1}, {"n": 2}]

        async def abort(record) -> None:
            return None

        worker = QueueWorker(
            service,
            name="pod-a",
            execute=execute,
            abort=abort,
            free_slots=lambda: 2,
            settings=WorkerSettings(poll_seconds=0.2),
        )
        try:
            job = await service.submit(
                parse_job_request(b'{"input": {"prompt": "x"}}'),
                sync=True,
                owner="alice",
                idempotency_key="k-1",
            )
            again = await service.submit(
                parse_job_request(b'{"input": {"prompt": "x"}}'),
                sync=False,
                owner="alice",
                idempotency_key="k-1",
            )
            assert again.id == job.id
            assert (await service.health())["jobs"]["inQueue"] == 1
            await worker.start()
            done = await service.wait(job.id, 20, owner="alice")
            assert done.status is JobStatus.COMPLETED
            _, chunks = await service.take_stream(job.id, owner="alice")
            assert chunks == [{"n": 1}, {"n": 2}]
            failed = await service.submit(
                parse_job_request(b'{"input": {"prompt": "fail"}}'), sync=True, owner="alice"
            )
            assert (await service.wait(failed.id, 20, owner="alice")).status is JobStatus.FAILED
            await worker.stop(1)
            retried = await service.retry(failed.id, owner="alice")
            assert retried.status is JobStatus.IN_QUEUE
            queued = await service.submit(
                parse_job_request(b'{"input": {"prompt": "q"}}'), sync=False, owner="alice"
            )
            assert (await service.cancel(queued.id, owner="alice")).status is JobStatus.CANCELLED
            assert await service.purge_queue(owner="alice") == 1  # the retried job
            # The cancelled jobs' messages stay until a worker reaches them (a pod may not
            # delete queue messages): it acknowledges them and runs nothing.
            ran: list[str] = []

            async def must_not_run(record, publish):
                ran.append(record.id)

            worker = QueueWorker(
                service, name="pod-a2", execute=must_not_run, abort=abort,
                free_slots=lambda: 2, settings=WorkerSettings(poll_seconds=0.2),
            )  # fmt: skip
            await worker.start()
            deadline = time.monotonic() + 20
            while (await endpoint_depth(pod.js, A, stream_fallback=False)).queued:
                assert time.monotonic() < deadline, "the cancelled jobs' messages stayed"
                await asyncio.sleep(0.1)
            assert ran == []
        finally:
            await worker.stop(1)
            await pod.close()
            await operator.close()

    asyncio.run(scenario())
    assert not server.violations(), server.violations()


def test_an_endpoints_credential_reaches_nothing_else(chart_nats):
    server = chart_nats[0]

    async def scenario() -> None:
        operator = await _connect(server.url, _creds(chart_nats, "operator"), "operator")
        gateway = await _connect(server.url, _creds(chart_nats, "gateway"), "gateway")
        admin = await _connect(server.url, _creds(chart_nats, "admin"), "admin")
        for endpoint in (A, B):
            await ensure_consumers(operator.js, endpoint, QueueLayout())
        b_jobs = QueueJobService(gateway, B)
        b_job = await b_jobs.submit(
            parse_job_request(b'{"input": {"prompt": "B secret prompt"}}'), sync=False, owner="b"
        )
        await signals.publish_held(gateway.js, B, "gw-1", 4)
        quota_subject = names.kv_subject(names.QUOTAS_BUCKET, names.quota_key("b-key"))
        await gateway.js.publish(quota_subject, b'{"w": 1}')

        usage_before = (await admin.js.stream_info(names.USAGE_STREAM)).state.messages
        a_creds = _creds(chart_nats, "runtime", A)
        a_pod = await _connect(server.url, a_creds, "pod-a", timeout=REFUSED)
        js = a_pod.js
        try:
            b_record = names.kv_subject(names.JOB_STATE_BUCKET, names.job_key(B, b_job.id))
            # B's record: no direct get, no core subscription to its updates.
            await _refused(
                js.get_msg(names.kv_stream(names.JOB_STATE_BUCKET), subject=b_record, direct=True)
            )
            await _refused(js.get_msg(names.kv_stream(names.JOB_STATE_BUCKET), seq=1, direct=True))
            # B's jobs: no pull from B's consumer, no consumer of its own on B's subjects.
            await _refused(_pull_one(js, names.jobs_consumer(B)))
            await _refused(
                js.add_consumer(
                    names.JOBS_STREAM,
                    durable_name="thief",
                    name="thief",
                    filter_subject=names.jobs_subject(B),
                )
            )
            # Stream-wide reads that no subject can scope: refused whole.
            await _refused(js.get_msg(names.JOBS_STREAM, seq=1))
            await _refused(js.stream_info(names.JOBS_STREAM, subjects_filter=">"))
            await _refused(js.delete_msg(names.JOBS_STREAM, 1))
            # Deletes and purges of anything.
            for stream in (names.JOBS_STREAM, names.kv_stream(names.QUOTAS_BUCKET),
                           names.USAGE_STREAM, names.kv_stream(names.JOB_STATE_BUCKET)):  # fmt: skip
                await _refused(js.purge_stream(stream))
                await _refused(js.delete_stream(stream))
            await _refused(js.delete_consumer(names.JOBS_STREAM, names.jobs_consumer(A)))
            # Writes it must never make: quotas, usage, B's queue and records, held signals.
            for subject in (
                quota_subject,
                names.usage_subject(A, "anyone"),
                names.jobs_subject(B),
                b_record,
                names.held_key(A, "gw-1"),
            ):
                await _refused(js.publish(subject, b"forged"))
            await a_pod.nc.publish(names.cancel_subject(B, b_job.id), b"")
            await a_pod.nc.publish(names.nudge_subject(B), b"")
            # Subscriptions to others' traffic: B's cancels, every reply inbox, B's records.
            for subject in (names.cancel_subject(B), "_INBOX.>", b_record, "llmep.>"):
                await a_pod.nc.subscribe(subject)
            await a_pod.nc.flush()
            await asyncio.sleep(0.3)

            # Nothing changed, as an admin sees it.
            b_view = QueueJobService(admin, B)
            assert (await b_view.get(b_job.id, owner=None)).status is JobStatus.IN_QUEUE
            assert (await endpoint_depth(admin.js, B)).queued == 1
            quota = await admin.js.get_msg(
                names.kv_stream(names.QUOTAS_BUCKET), subject=quota_subject, direct=True
            )
            assert quota.data == b'{"w": 1}'
            assert await signals.read_held(admin.js, B) == 4
            assert await signals.read_held(admin.js, A) == 0
            usage = await admin.js.stream_info(names.USAGE_STREAM)
            assert usage.state.messages == usage_before
            for stream in (names.JOBS_STREAM, names.USAGE_STREAM):
                await admin.js.stream_info(stream)  # still there
        finally:
            for connection in (a_pod, gateway, admin, operator):
                await connection.close()

    asyncio.run(scenario())
    refused = "\n".join(server.violations())
    for what in ("$JS.API.DIRECT.GET.KV_LLMEP_JOB_STATE", "$JS.API.CONSUMER.MSG.NEXT.LLMEP_JOBS",
                 "$JS.API.STREAM.PURGE", "$JS.API.STREAM.DELETE", "$KV.LLMEP_QUOTAS",
                 "llmep.usage.", "_INBOX.>", "Subscription Violation"):  # fmt: skip
        assert what in refused, f"{what} was not refused:\n{refused}"


async def _pull_one(js, durable: str):
    sub = await js.pull_subscribe_bind(durable=durable, stream=names.JOBS_STREAM)
    try:
        return await sub.fetch(1, timeout=REFUSED)
    finally:
        await sub.unsubscribe()


def test_the_gateways_credential_cannot_delete_or_purge(chart_nats):
    server = chart_nats[0]
    gateway_creds = Path(_gateway_creds_file(chart_nats)).read_text()

    async def scenario() -> None:
        operator = await _connect(server.url, _creds(chart_nats, "operator"), "operator")
        gateway = await _connect(server.url, gateway_creds, "gateway", timeout=REFUSED)
        try:
            streams = [s.config.name for s in await _streams(operator)]
            assert names.JOBS_STREAM in streams and names.USAGE_STREAM in streams
            for stream in streams:
                await _refused(gateway.js.purge_stream(stream))
                await _refused(gateway.js.delete_stream(stream))
            await _refused(gateway.js.delete_consumer(names.JOBS_STREAM, names.jobs_consumer(A)))
            assert sorted(s.config.name for s in await _streams(operator)) == sorted(streams)
        finally:
            await gateway.close()
            await operator.close()

    asyncio.run(scenario())
    violations = "\n".join(server.violations())
    assert "$JS.API.STREAM.PURGE" in violations and "$JS.API.STREAM.DELETE" in violations


def test_only_the_operator_sets_the_per_owner_cap_and_nothing_else(chart_nats):
    """The per-owner cap on queued jobs is the jobs stream's per-subject limit: the operator's
    credential sets it (its setting, on the existing stream); no other stream update is
    allowed to it, and neither the gateway's nor a pod's credential may change the cap."""
    from dataclasses import replace

    from llmendpoints_common.queue.topology import ensure_streams

    server = chart_nats[0]
    gateway_creds = Path(_gateway_creds_file(chart_nats)).read_text()

    async def scenario() -> None:
        operator = await _connect(server.url, _creds(chart_nats, "operator"), "operator")
        gateway = await _connect(server.url, gateway_creds, "gateway", timeout=REFUSED)
        pod = await _connect(server.url, _creds(chart_nats, "runtime", A), "pod", REFUSED)
        quick_operator = await _connect(
            server.url, _creds(chart_nats, "operator"), "operator-2", REFUSED
        )
        try:
            before = (await operator.js.stream_info(names.JOBS_STREAM)).config
            await ensure_streams(operator.js, QueueLayout(max_queued_per_owner=7), reconcile=True)
            capped = (await operator.js.stream_info(names.JOBS_STREAM)).config
            assert capped.max_msgs_per_subject == 7
            assert replace(capped, max_msgs_per_subject=before.max_msgs_per_subject) == before
            usage = (await operator.js.stream_info(names.USAGE_STREAM)).config
            for other in (quick_operator, gateway, pod):
                await _refused(other.js.update_stream(replace(usage, max_age=1.0)))
            for other in (gateway, pod):
                await _refused(other.js.update_stream(replace(capped, max_msgs_per_subject=-1)))
            assert (await operator.js.stream_info(names.JOBS_STREAM)).config == capped
            # Put back what the module's other tests expect.
            await ensure_streams(operator.js, QueueLayout(), reconcile=True)
        finally:
            await quick_operator.close()
            await pod.close()
            await gateway.close()
            await operator.close()

    asyncio.run(scenario())
    assert f"$JS.API.STREAM.UPDATE.{names.USAGE_STREAM}" in "\n".join(server.violations())


async def _streams(connection: QueueConnection):
    # The operator may not list streams; it reads the ones it created, one by one.
    from llmendpoints_common.queue.roles import STREAMS

    return [await connection.js.stream_info(name) for name in STREAMS]


def test_a_raw_nats_client_without_creds_is_refused(chart_nats):
    server = chart_nats[0]

    async def scenario() -> None:
        with pytest.raises(Exception) as refused:
            await nats.connect(server.url, allow_reconnect=False, max_reconnect_attempts=0,
                               connect_timeout=2)  # fmt: skip
        assert "authorization" in str(refused.value).lower()
        # A creds file signed by a key the server does not trust: a fresh installation's.
        from llmendpoints_common.queue.trust import Installation

        other = mint(Installation.generate().signer, "admin", issued_at=int(time.time()))
        with pytest.raises(Exception) as untrusted:
            await nats.connect(server.url, user_credentials=RawCredentials(other),
                               allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=2)  # fmt: skip
        assert "authorization" in str(untrusted.value).lower()

    asyncio.run(scenario())


def test_the_chart_lets_the_gateway_keep_and_drive_batches_and_pods_run_them(chart_nats):
    """The gateway's credential runs the whole batch store -- files in the object store (put,
    read, removed by roll-up markers, no purge), records, the drivers' listings and leases, the
    scaling signal -- while an endpoint's pods take the batch lane with their own credential
    and the operator reads the signal with its own. No violation anywhere; a pod's credential
    reaches neither the batch records nor the files."""
    from llmendpoints_common.batch.api import BatchAPI, BatchCall
    from llmendpoints_common.batch.driver import BatchDrivers
    from llmendpoints_common.batch.files import FileEnd, FileStart, FormField, Upload
    from llmendpoints_common.batch.limits import BatchLimits
    from llmendpoints_common.batch.record import BatchRecord
    from llmendpoints_common.batch.signal import BatchSignal
    from llmendpoints_common.queue import objects
    from llmendpoints_common.queue.batch_lines import QueueLines
    from llmendpoints_common.queue.batch_store import NatsBatchStore

    server = chart_nats[0]
    before = len(server.violations())  # the module's other tests refuse things too
    C = EndpointRef("team-c", "batch")
    gateway_creds = Path(_gateway_creds_file(chart_nats)).read_text()
    limits = BatchLimits(window_lines=4)

    async def scenario() -> None:
        operator = await _connect(server.url, _creds(chart_nats, "operator"), "operator")
        await ensure_consumers(operator.js, C, QueueLayout())
        gateway = await _connect(server.url, gateway_creds, "gateway")
        pod = await _connect(server.url, _creds(chart_nats, "runtime", C), "pod-c", timeout=REFUSED)  # fmt: skip
        store = NatsBatchStore(gateway)
        lines = QueueLines(gateway)

        async def resolve(owner: str, model: str) -> str:
            return C.id

        signalled: list[BatchRecord] = []

        async def signal(record: BatchRecord) -> None:
            signalled.append(record)
            await signals.publish_batch(gateway.js, C, BatchSignal.of(record))

        drivers = BatchDrivers(store, lines, holder="gw", limits=limits, resolve=resolve,
                               signal=signal, tick_seconds=0.1)  # fmt: skip
        api = BatchAPI(store, lines, limits, wake=drivers.wake)

        async def execute(record, publish):
            return {"object": "chat.completion", "usage": {"prompt_tokens": 1, "completion_tokens": 1}}  # fmt: skip

        async def abort(record) -> None:
            return None

        worker = QueueWorker(
            QueueJobService(pod, C), name="pod-c", execute=execute, abort=abort,
            free_slots=lambda: 2, batch_slots=lambda: 2, settings=WorkerSettings(poll_seconds=0.2),
        )  # fmt: skip
        try:
            data = b"".join(
                json.dumps(
                    {
                        "custom_id": f"r{i}",
                        "method": "POST",
                        "url": "/v1/chat/completions",
                        "body": {"model": "m", "messages": [{"role": "user", "content": "x"}]},
                    }
                ).encode()
                + b"\n"
                for i in range(10)
            )

            async def events():  # the upload as the gateway's multipart reader gives it
                for event in (FormField("purpose", "batch"), FileStart("file", "in.jsonl"), data, FileEnd()):  # fmt: skip
                    yield event

            file = await api.create_file(Upload(events(), len(data)), "team")
            created = await api.create_batch(
                json.dumps({"input_file_id": file["id"], "endpoint": "/v1/chat/completions",
                            "completion_window": "24h"}).encode(), "team",
            )  # fmt: skip
            await drivers.start()
            await worker.start()
            deadline = time.monotonic() + 60
            while True:
                shown = (await api.openai(BatchCall("GET", f"batches/{created.id}", "team"))).body
                if shown["status"] == "completed":
                    break
                assert time.monotonic() < deadline, shown
                if signalled and signalled[-1].active:
                    # The operator reads the batch's signal with its own credential.
                    seen = await signals.read_batches(operator.js, C)
                    assert [s.batch for s in seen] in ([created.id], [])
                await asyncio.sleep(0.1)
            assert shown["request_counts"]["completed"] == 10
            reply = await api.openai(BatchCall("GET", f"files/{shown['output_file_id']}/content", "team"))  # fmt: skip
            content = b"".join([chunk async for chunk in reply.content.chunks()])
            assert len(content.splitlines()) == 10
            # A file is removed without a purge, and is gone.
            deleted = await api.openai(BatchCall("DELETE", f"files/{file['id']}", "team"))
            assert deleted.body["deleted"] is True
            assert await objects.object_info(gateway.js, names.object_name("team", file["id"])) is None  # fmt: skip
            await signals.drop_batch(gateway.js, C, created.id)
            # The pod's credential: no batch record, no file, no listing.
            record_key = names.kv_subject(names.BATCHES_BUCKET, names.batch_key("team", created.id))
            await _refused(pod.js.get_msg(names.kv_stream(names.BATCHES_BUCKET), subject=record_key, direct=True))  # fmt: skip
            await _refused(
                pod.js.get_msg(
                    objects.FILES_STREAM,
                    subject=objects.meta_subject(
                        names.object_name("team", shown["output_file_id"])
                    ),
                    direct=True,
                )
            )
            await _refused(pod.js.publish(record_key, b"forged"))
        finally:
            await drivers.stop()
            await worker.stop(1)
            for connection in (pod, gateway, operator):
                await connection.close()

    asyncio.run(scenario())
    # The only violations are the pod's three refused attempts: the gateway's, the pod's and
    # the operator's batch work went through.
    violations = server.violations()[before:]
    refused = ("$JS.API.DIRECT.GET.KV_LLMEP_BATCHES", "$JS.API.DIRECT.GET.OBJ_LLMEP_FILES",
               '"$KV.LLMEP_BATCHES.')  # fmt: skip
    assert violations and all(any(r in v for r in refused) for v in violations), violations
    for what in refused:
        assert any(what in v for v in violations), f"{what} was not refused"


def test_a_pod_takes_jobs_while_an_older_operator_has_not_made_its_batch_lane(chart_nats):
    """A rolling upgrade: pods that know the batch lane under an operator that does not (the
    endpoint's normal and low consumers only). The pod's credential may not create the batch
    consumer; its worker takes jobs all the same, without batches, and says so."""
    server = chart_nats[0]
    before = len(server.violations())
    D = EndpointRef("team-d", "older")

    async def scenario() -> None:
        operator = await _connect(server.url, _creds(chart_nats, "operator"), "operator")
        await ensure_consumers(operator.js, D, QueueLayout(), priorities=("normal", "low"))
        pod = await _connect(server.url, _creds(chart_nats, "runtime", D), "pod-d")
        service = QueueJobService(pod, D)

        async def execute(record, publish):
            return [{"ok": True}]

        async def abort(record) -> None:
            return None

        worker = QueueWorker(
            service, name="pod-d", execute=execute, abort=abort, free_slots=lambda: 2,
            batch_slots=lambda: 2, settings=WorkerSettings(poll_seconds=0.2),
        )  # fmt: skip
        try:
            await worker.start()
            job = await service.submit(
                parse_job_request(b'{"input": {"prompt": "x"}}'), sync=True, owner="d"
            )
            assert (await service.wait(job.id, 20, owner="d")).status is JobStatus.COMPLETED
        finally:
            await worker.stop(1)
            await pod.close()
            await operator.close()

    asyncio.run(scenario())
    assert server.violations()[before:] == []


def test_gateway_processes_share_routing_records_and_pods_cannot_forge_them(chart_nats):
    """Two gateway processes with the chart's gateway credential: what one routes, the other's
    prefix index learns (route_sharing.py). A runtime pod's credential may not publish one."""
    from llmendpoints_gateway.queue import SharedQueue
    from llmendpoints_gateway.route_sharing import RouteSharing

    server = chart_nats[0]
    gateway_creds = _gateway_creds_file(chart_nats)

    async def scenario() -> None:
        heard: list[tuple[str, str, list[int]]] = []
        queues = [SharedQueue(server.url, f"g{i}", gateway_creds) for i in range(2)]
        sharing = [
            RouteSharing(queues[0], "gw-0", lambda *r: heard.append(("gw-0", *r))),
            RouteSharing(queues[1], "gw-1", lambda *r: heard.append(("gw-1", *r))),
        ]
        for part in (*queues, *sharing):
            await part.start()
        a_pod = await _connect(server.url, _creds(chart_nats, "runtime", A), "pod-a")
        try:
            deadline = time.monotonic() + 20
            while not all(s._subscription for s in sharing):
                assert time.monotonic() < deadline, "not subscribed"
                await asyncio.sleep(0.05)
            sharing[0].record("team-a/chat", "http://10.0.0.1:8000", [1, 2, 3])
            while not heard:
                assert time.monotonic() < deadline, "the other process heard nothing"
                await asyncio.sleep(0.05)
            await a_pod.nc.publish(names.routes_subject("forged"), b"\x00")
            await a_pod.nc.flush()
            await asyncio.sleep(0.3)
            # The other process applied it; the sender did not hear itself; the forgery died.
            assert heard == [("gw-1", "team-a/chat", "http://10.0.0.1:8000", [1, 2, 3])]
        finally:
            await a_pod.close()
            for part in (*sharing, *reversed(queues)):
                await part.stop()

    asyncio.run(scenario())
    refused = "\n".join(server.violations())
    assert "llmep.routes.forged" in refused, refused
