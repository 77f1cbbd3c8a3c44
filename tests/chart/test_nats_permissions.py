"""The chart's NATS, configured exactly as the chart renders it (nats.conf, the keys Secret, the
init container's trust and routes files: nats_chart_kit), with each role's real credential:

- the gateway's (its init container's own command) limits, meters and serves jobs;
- an endpoint's (what the operator mints into <endpoint>-queue-creds-v2) runs that endpoint's
  queue end to end -- the real QueueJobService, QueueWorker, depth and /health -- once the
  operator's credential has created the streams and the endpoint's consumers;
- and refuses, on the server, everything else: another endpoint's records, jobs, chunks,
  consumers, cancels and replies, every consumer but its own workers' (the gateway's usage
  consumers by their real names and configs), gateway admissions, the quotas, usage records,
  and every delete or purge, which the gateway's credential is refused too;
- bounds it: what it writes fills its own endpoint's reserved storage and nobody else's, its
  job messages are a job id's size, its subscriptions are counted;
- and bills nobody with it: a forged COMPLETED record naming another key is billed to no key
  and spends no key's tokens-per-minute.

A refused request waits out its timeout (the server answers nothing; its log says "Publish
Violation" or "Subscription Violation"); each test also checks that nothing changed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
import time
from pathlib import Path

import nats
import nats.errors
import pytest
from llmendpoints_common.identity import EndpointRef
from llmendpoints_common.jobs import admission
from llmendpoints_common.jobs.models import JobStatus, parse_job_request
from llmendpoints_common.queue import names, signals
from llmendpoints_common.queue.client import QueueConnection, QueueJobService
from llmendpoints_common.queue.depth import endpoint_depth
from llmendpoints_common.queue.topology import QueueLayout, ensure_endpoint_queue
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
        await ensure_endpoint_queue(operator.js, A, QueueLayout())
        queue = SharedQueue(url, "g", gateway_creds)  # the gateway's one connection
        await queue.start()
        limiter = Limiter("g", queue)
        await limiter.start()
        counted: list[str] = []
        meter = JobUsageMeter(
            queue,
            lambda r, v, u, at: (
                UsageRecord(f"job-{r.id}-usage", at, v.key, r.endpoint, "m", 200,
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
            jobs = QueueJobService(connection, A, admitted_by=admission.GATEWAY)
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
        await ensure_endpoint_queue(operator.js, A, QueueLayout())
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
            # The cancelled jobs' messages are out of the queue at once: the pod may take
            # messages out of its own endpoint's queue (its own stream).
            assert (await endpoint_depth(pod.js, A)).queued == 0
            ran: list[str] = []

            async def must_not_run(record, publish):
                ran.append(record.id)

            worker = QueueWorker(
                service, name="pod-a2", execute=must_not_run, abort=abort,
                free_slots=lambda: 2, settings=WorkerSettings(poll_seconds=0.2),
            )  # fmt: skip
            await worker.start()
            await asyncio.sleep(0.5)
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
            await ensure_endpoint_queue(operator.js, endpoint, QueueLayout())
        b_jobs = QueueJobService(gateway, B, admitted_by=admission.GATEWAY)
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
        b_records, b_queue = names.records_stream(B), names.queue_stream(B)
        try:
            b_record = names.record_subject(B, b_job.id)
            # B's record: no direct get (by subject or by sequence), no core subscription.
            await _refused(js.get_msg(b_records, subject=b_record, direct=True))
            await _refused(js.get_msg(b_records, seq=1, direct=True))
            # B's jobs: no pull from B's consumer, no consumer of its own on B's subjects.
            await _refused(_pull_one(js, B, names.jobs_consumer(B)))
            await _refused(
                js.add_consumer(
                    b_queue,
                    durable_name="thief",
                    name="thief",
                    filter_subject=names.jobs_consumer_filter(B, "normal"),
                )
            )
            # B's stream by sequence, its info, its messages taken out.
            await _refused(js.get_msg(b_queue, seq=1))
            await _refused(js.stream_info(b_queue, subjects_filter=">"))
            await _refused(js.delete_msg(b_queue, 1))
            # Deletes and purges of anything, its own streams included.
            for stream in (names.queue_stream(A), names.records_stream(A), b_queue,
                           names.kv_stream(names.QUOTAS_BUCKET), names.USAGE_STREAM):  # fmt: skip
                await _refused(js.purge_stream(stream))
                await _refused(js.delete_stream(stream))
            await _refused(js.delete_consumer(names.queue_stream(A), names.jobs_consumer(A)))
            # Writes it must never make: quotas, usage, B's queue and records, held signals,
            # a gateway admission of its own endpoint.
            for subject in (
                quota_subject,
                names.usage_subject(A, "anyone"),
                names.jobs_subject(B, "normal", "b"),
                b_record,
                names.held_key(A, "gw-1"),
                names.admission_subject(A, "forged", names.ADMITTED_BY_GATEWAY),
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
            for stream in (names.queue_stream(A), names.records_stream(A), names.USAGE_STREAM):
                await admin.js.stream_info(stream)  # still there
        finally:
            for connection in (a_pod, gateway, admin, operator):
                await connection.close()

    asyncio.run(scenario())
    refused = "\n".join(server.violations())
    for what in (f"$JS.API.DIRECT.GET.{names.records_stream(B)}",
                 f"$JS.API.CONSUMER.MSG.NEXT.{names.queue_stream(B)}",
                 "$JS.API.STREAM.PURGE", "$JS.API.STREAM.DELETE", "$KV.LLMEP_QUOTAS",
                 "llmep.usage.", ".adm.gw.forged", "_INBOX.>", "Subscription Violation"):  # fmt: skip
        assert what in refused, f"{what} was not refused:\n{refused}"


async def _pull_one(js, endpoint: EndpointRef, durable: str, stream: str | None = None):
    sub = await js.pull_subscribe_bind(
        durable=durable, stream=stream or names.queue_stream(endpoint)
    )
    try:
        return await sub.fetch(1, timeout=REFUSED)
    finally:
        await sub.unsubscribe()


def test_the_gateways_credential_cannot_delete_or_purge(chart_nats):
    server = chart_nats[0]
    gateway_creds = Path(_gateway_creds_file(chart_nats)).read_text()

    async def scenario() -> None:
        operator = await _connect(server.url, _creds(chart_nats, "operator"), "operator")
        await ensure_endpoint_queue(operator.js, A, QueueLayout())
        gateway = await _connect(server.url, gateway_creds, "gateway", timeout=REFUSED)
        try:
            streams = [s.config.name for s in await _streams(operator)]
            assert names.records_stream(A) in streams and names.USAGE_STREAM in streams
            for stream in streams:
                await _refused(gateway.js.purge_stream(stream))
                await _refused(gateway.js.delete_stream(stream))
            await _refused(
                gateway.js.delete_consumer(names.queue_stream(A), names.jobs_consumer(A))
            )
            assert sorted(s.config.name for s in await _streams(operator)) == sorted(streams)
        finally:
            await gateway.close()
            await operator.close()

    asyncio.run(scenario())
    violations = "\n".join(server.violations())
    assert "$JS.API.STREAM.PURGE" in violations and "$JS.API.STREAM.DELETE" in violations


def test_only_the_operator_sets_the_bounds_and_deletes_only_an_endpoints_streams(chart_nats):
    """The bounds of every stream (``max_bytes``, message size, the per-owner cap) are the
    operator's settings, set on existing streams too; neither the gateway's nor a pod's
    credential may change any stream. The operator deletes a deleted endpoint's two streams,
    never a shared one."""
    from dataclasses import replace

    from llmendpoints_common.queue.topology import delete_endpoint_streams, ensure_streams

    server = chart_nats[0]
    gateway_creds = Path(_gateway_creds_file(chart_nats)).read_text()
    E = EndpointRef("team-e", "bounded")

    async def scenario() -> None:
        operator = await _connect(server.url, _creds(chart_nats, "operator"), "operator")
        quick_operator = await _connect(
            server.url, _creds(chart_nats, "operator"), "operator-2", REFUSED
        )
        gateway = await _connect(server.url, gateway_creds, "gateway", timeout=REFUSED)
        pod = await _connect(server.url, _creds(chart_nats, "runtime", E), "pod", REFUSED)
        try:
            await ensure_endpoint_queue(operator.js, E, QueueLayout())
            layout = QueueLayout(max_queued_per_owner=7, endpoint_max_bytes=8 * 1024 * 1024,
                                 usage_max_bytes=512 * 1024 * 1024)  # fmt: skip
            await ensure_streams(operator.js, layout, reconcile=True)
            await ensure_endpoint_queue(operator.js, E, layout, reconcile=True)
            queue = (await operator.js.stream_info(names.queue_stream(E))).config
            assert queue.max_msgs_per_subject == 7
            records = (await operator.js.stream_info(names.records_stream(E))).config
            assert records.max_bytes == 8 * 1024 * 1024
            usage = (await operator.js.stream_info(names.USAGE_STREAM)).config
            assert usage.max_bytes == 512 * 1024 * 1024
            for other in (gateway, pod):
                await _refused(other.js.update_stream(replace(usage, max_bytes=-1)))
                await _refused(other.js.update_stream(replace(queue, max_msgs_per_subject=-1)))
            # The operator deletes no shared stream, and a deleted endpoint's own.
            await _refused(quick_operator.js.delete_stream(names.USAGE_STREAM))
            assert await delete_endpoint_streams(operator.js, E)
            # Put back what the module's other tests expect.
            await ensure_streams(operator.js, QueueLayout(), reconcile=True)
        finally:
            await pod.close()
            await gateway.close()
            await quick_operator.close()
            await operator.close()

    asyncio.run(scenario())
    violations = "\n".join(server.violations())
    assert f"$JS.API.STREAM.UPDATE.{names.USAGE_STREAM}" in violations
    assert f"$JS.API.STREAM.DELETE.{names.USAGE_STREAM}" in violations


async def _streams(connection: QueueConnection):
    # The operator may not list streams; it reads the ones it created, one by one.
    from llmendpoints_common.queue.roles import STREAMS

    found = [await connection.js.stream_info(name) for name in STREAMS]
    for stream in (names.queue_stream(A), names.records_stream(A)):
        found.append(await connection.js.stream_info(stream))
    return found


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
        # This installation's own credential, minted before the queue's second layout (its
        # permissions reached other roles' consumers): revoked by the account.
        from llmendpoints_common.queue.trust import REVOKED_BEFORE

        for role, endpoint in (("runtime", A), ("gateway", None)):
            stale = mint(_signer(chart_nats), role, endpoint, issued_at=REVOKED_BEFORE - 86_400)
            with pytest.raises(Exception) as revoked:
                await nats.connect(server.url, user_credentials=RawCredentials(stale),
                                   allow_reconnect=False, max_reconnect_attempts=0,
                                   connect_timeout=2)  # fmt: skip
            assert "authorization" in str(revoked.value).lower()

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
        await ensure_endpoint_queue(operator.js, C, QueueLayout())
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
        await ensure_endpoint_queue(operator.js, D, QueueLayout(), priorities=("normal", "low"))
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
    from llmendpoints_gateway.prefix_index import RouteLog
    from llmendpoints_gateway.queue import SharedQueue
    from llmendpoints_gateway.route_sharing import RouteSharing

    server = chart_nats[0]
    gateway_creds = _gateway_creds_file(chart_nats)

    async def scenario() -> None:
        heard: list[tuple[str, str, list[int]]] = []
        queues = [SharedQueue(server.url, f"g{i}", gateway_creds) for i in range(2)]
        outboxes = [RouteLog(), RouteLog()]
        sharing = [
            RouteSharing(queues[0], "gw-0", outboxes[0], lambda *r: heard.append(("gw-0", *r))),
            RouteSharing(queues[1], "gw-1", outboxes[1], lambda *r: heard.append(("gw-1", *r))),
        ]
        for part in (*queues, *sharing):
            await part.start()
        a_pod = await _connect(server.url, _creds(chart_nats, "runtime", A), "pod-a")
        try:
            deadline = time.monotonic() + 20
            while not all(s._subscription for s in sharing):
                assert time.monotonic() < deadline, "not subscribed"
                await asyncio.sleep(0.05)
            outboxes[0].add("team-a/chat", "http://10.0.0.1:8000", [1, 2, 3])
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


# ---- issue 28: what one endpoint's own credential could still do -----------------------------


def test_a_pods_credential_pulls_and_changes_no_consumer_but_its_own(chart_nats, caplog):
    """With X's runtime credential: the gateway's usage consumers -- on X's own records and on
    Y's, by their real name and config -- can be neither pulled (they deliver every record,
    prompts and owners included) nor updated (switching billing off) nor deleted; no consumer
    can be created at all, a push consumer to the pod's own inbox included; Y's worker consumer
    cannot be pulled. Nothing changes. A consumer someone else changed is repaired by the
    gateway's meter when it starts, with a warning."""
    from dataclasses import replace

    from llmendpoints_common.queue.roles import endpoint_inbox
    from llmendpoints_common.queue.topology import consumer_config, usage_consumer_config
    from llmendpoints_gateway.queue import SharedQueue
    from llmendpoints_gateway.usage import JobUsageMeter

    server = chart_nats[0]
    X, Y = EndpointRef("team-x", "chat"), EndpointRef("team-y", "chat")
    gateway_creds = _gateway_creds_file(chart_nats)

    async def consumers(js) -> dict[tuple[str, str], object]:
        found = {}
        for ep in (X, Y):
            for stream, name in ((names.records_stream(ep), names.USAGE_CONSUMER),
                                 (names.queue_stream(ep), names.jobs_consumer(ep))):  # fmt: skip
                found[(stream, name)] = (await js.consumer_info(stream, name)).config
        return found

    async def scenario() -> None:
        operator = await _connect(server.url, _creds(chart_nats, "operator"), "operator")
        admin = await _connect(server.url, _creds(chart_nats, "admin"), "admin")
        gateway = await _connect(server.url, Path(gateway_creds).read_text(), "gateway")
        for endpoint in (X, Y):
            await ensure_endpoint_queue(operator.js, endpoint, QueueLayout())
        y_jobs = QueueJobService(gateway, Y, admitted_by=admission.GATEWAY)
        await y_jobs.submit(
            parse_job_request(b'{"input": {"prompt": "Y secret"}}'), sync=False, owner="y-key"
        )
        before = await consumers(admin.js)
        pod = await _connect(server.url, _creds(chart_nats, "runtime", X), "pod-x", REFUSED)
        js = pod.js
        try:
            for ep in (X, Y):
                records = names.records_stream(ep)
                # Pull the gateway's usage consumer, by its real name.
                await _refused(_pull_one(js, ep, names.USAGE_CONSUMER, stream=records))
                # Its config with the pod's own filter, a push version to the pod's own inbox,
                # a delete: refused.
                own_filter = replace(
                    usage_consumer_config(ep), filter_subject=names.records_filter(X)
                )
                inbox = f"{endpoint_inbox(X)}.stolen"
                push = replace(usage_consumer_config(ep), deliver_subject=inbox)
                for config in (own_filter, push):
                    await _refused(js.add_consumer(records, config))
                await _refused(js.delete_consumer(records, names.USAGE_CONSUMER))
            # The first layout's wildcard, aimed at the gateway's old durable: refused.
            await _refused(
                pod.nc.request(
                    "$JS.API.CONSUMER.MSG.NEXT.KV_LLMEP_JOB_STATE.gateway-job-usage",
                    b'{"batch": 1}',
                    timeout=REFUSED,
                )
            )
            # Its own worker consumer: not changed, and no consumer of its own, push or pull.
            queue = names.queue_stream(X)
            await _refused(js.add_consumer(queue, replace(consumer_config(X, "normal", QueueLayout()), max_deliver=1)))  # fmt: skip
            await _refused(
                js.add_consumer(
                    queue,
                    name="mine",
                    durable_name="mine",
                    deliver_subject=f"{endpoint_inbox(X)}.push",
                    filter_subject=names.jobs_consumer_filter(X, "normal"),
                )
            )
            # Y's worker consumer: not pulled.
            await _refused(_pull_one(js, Y, names.jobs_consumer(Y)))
            assert await consumers(admin.js) == before
            assert (await endpoint_depth(admin.js, Y)).queued == 1  # Y's job untouched

            # Someone (an admin, a credential of the first layout) changed the usage consumers:
            # the gateway's meter puts them back when it starts, saying so.
            x_records, y_records = names.records_stream(X), names.records_stream(Y)
            await admin.js.add_consumer(
                x_records, replace(usage_consumer_config(X, 1), max_ack_pending=1)
            )
            await admin.js.delete_consumer(y_records, names.USAGE_CONSUMER)
            await admin.js.add_consumer(
                y_records, replace(usage_consumer_config(Y, 1), deliver_subject="llmep.elsewhere")
            )
            queue_conn = SharedQueue(server.url, "g", gateway_creds)
            await queue_conn.start()
            meter = JobUsageMeter(queue_conn, lambda *args: None)
            await meter.start()
            try:
                deadline = time.monotonic() + 30
                while await consumers(admin.js) != before:
                    assert time.monotonic() < deadline, "the usage consumers were not repaired"
                    await asyncio.sleep(0.2)
            finally:
                await meter.stop()
                await queue_conn.stop()
        finally:
            for connection in (pod, gateway, admin, operator):
                await connection.close()

    with caplog.at_level("WARNING", logger="llmendpoints.gateway.usage"):
        asyncio.run(scenario())
    repaired = [
        r.getMessage() for r in caplog.records if "usage meter's consumer" in r.getMessage()
    ]
    assert any("team-x/chat was updated (max_ack_pending" in m for m in repaired), repaired
    assert any("team-y/chat was made again (deliver_subject" in m for m in repaired), repaired
    refused = "\n".join(server.violations())
    for what in (
        f"$JS.API.CONSUMER.MSG.NEXT.{names.records_stream(Y)}.{names.USAGE_CONSUMER}",
        f"$JS.API.CONSUMER.MSG.NEXT.{names.records_stream(X)}.{names.USAGE_CONSUMER}",
        f"$JS.API.CONSUMER.CREATE.{names.records_stream(X)}.{names.USAGE_CONSUMER}",
        f"$JS.API.CONSUMER.CREATE.{names.records_stream(Y)}.{names.USAGE_CONSUMER}",
        f"$JS.API.CONSUMER.DELETE.{names.records_stream(Y)}.{names.USAGE_CONSUMER}",
        "$JS.API.CONSUMER.MSG.NEXT.KV_LLMEP_JOB_STATE.gateway-job-usage",
        f"$JS.API.CONSUMER.CREATE.{names.queue_stream(X)}.mine",
        f"$JS.API.CONSUMER.MSG.NEXT.{names.queue_stream(Y)}",
    ):
        assert what in refused, f"{what} was not refused:\n{refused}"


def test_a_pod_filling_its_own_queue_fails_for_it_alone(chart_nats):
    """With F's runtime credential, publish as much as it is allowed: its records stream fills
    to its bound and refuses more (a record, a chunk; F's next job through the gateway gets 503
    naming the bound), its job messages are a job id's size and fill their own bound, its
    10,001st subscription is refused. Meanwhile another endpoint's jobs are accepted and run,
    usage records and quota writes are stored, and a new endpoint's queue is created: nothing
    F did took their room. (The bounds are the operator's settings, small here.)"""
    import nats.js.errors
    from llmendpoints_common.errors import ServiceUnavailableError
    from llmendpoints_common.queue.roles import RUNTIME_MAX_SUBSCRIPTIONS, endpoint_inbox

    server = chart_nats[0]
    F, G, H = (EndpointRef("team-f", "flood"), EndpointRef("team-g", "calm"),
               EndpointRef("team-h", "new"))  # fmt: skip
    layout = QueueLayout(endpoint_max_bytes=4 * 1024 * 1024, endpoint_queue_max_bytes=128 * 1024)
    gateway_creds = Path(_gateway_creds_file(chart_nats)).read_text()
    mib = b"x" * (1024 * 1024)

    async def fill(publish, limit: int) -> nats.js.errors.APIError:
        for i in range(limit):
            try:
                await publish(i)
            except nats.js.errors.APIError as exc:
                return exc
        raise AssertionError(f"{limit} publishes and no bound was reached")

    async def scenario() -> None:
        operator = await _connect(server.url, _creds(chart_nats, "operator"), "operator")
        for endpoint in (F, G):
            await ensure_endpoint_queue(operator.js, endpoint, layout)
        gateway = await _connect(server.url, gateway_creds, "gateway")
        pod = await _connect(server.url, _creds(chart_nats, "runtime", F), "pod-f")
        g_pod = await _connect(server.url, _creds(chart_nats, "runtime", G), "pod-g")
        js = pod.js
        try:
            # Records and chunks (1 MiB each, new subjects): refused at F's bound.
            full = await fill(lambda i: js.publish(names.record_subject(F, f"junk-{i}"), mib), 64)
            assert "maximum bytes exceeded" in full.description
            with pytest.raises(nats.js.errors.APIError, match="maximum bytes"):
                await js.publish(names.chunk_subject(F, "junk", 0, 1), mib)
            # Job messages: a job id's size at most, and a bound of their own.
            with pytest.raises(nats.js.errors.APIError, match="message size exceeds"):
                await js.publish(names.jobs_subject(F, "normal", "x"), b"j" * 2048)
            full = await fill(
                lambda i: js.publish(names.jobs_subject(F, "normal", f"k{i}"), b"j" * 100), 5000
            )
            assert "maximum bytes exceeded" in full.description
            # F's own next job through the gateway: 503 naming the bound, nothing stored.
            f_jobs = QueueJobService(gateway, F, admitted_by=admission.GATEWAY)
            with pytest.raises(ServiceUnavailableError) as caught:
                await f_jobs.submit(parse_job_request(b'{"input": {"prompt": "p"}}'),
                                    sync=False, owner="f-key")  # fmt: skip
            assert "LLMEP_OPERATOR_JOBS_QUEUE_ENDPOINT_MAX_BYTES" in caught.value.message
            # Subscriptions: counted per credential (the server refuses the one past the limit;
            # nats-py then closes that connection).
            raw = await nats.connect(
                server.url,
                user_credentials=RawCredentials(_creds(chart_nats, "runtime", F)),
                inbox_prefix=endpoint_inbox(F),
                allow_reconnect=False,
            )
            with contextlib.suppress(Exception):
                for i in range(RUNTIME_MAX_SUBSCRIPTIONS + 1):
                    await raw.subscribe(f"{endpoint_inbox(F)}.s{i}")
                await raw.flush(timeout=5)
            deadline = time.monotonic() + 20
            while not raw.is_closed:
                assert time.monotonic() < deadline, "the subscription past the limit was taken"
                await asyncio.sleep(0.05)
            assert "maximum subscriptions" in str(raw.last_error).lower()

            # Everyone else: G's jobs are accepted and run with G's own credential.
            g_jobs = QueueJobService(gateway, G, admitted_by=admission.GATEWAY)

            async def execute(record, publish):
                publish({"n": 1})
                return [{"usage": {"input": 1, "output": 1}}]

            async def abort(record) -> None:
                return None

            worker = QueueWorker(QueueJobService(g_pod, G), name="pod-g", execute=execute,
                                 abort=abort, free_slots=lambda: 2,
                                 settings=WorkerSettings(poll_seconds=0.2))  # fmt: skip
            await worker.start()
            try:
                job = await g_jobs.submit(
                    parse_job_request(b'{"input": {"prompt": "p"}}'), sync=True, owner="g-key"
                )
                assert (await g_jobs.wait(job.id, 20, owner="g-key")).status is JobStatus.COMPLETED
            finally:
                await worker.stop(1)
            # Usage records and quota writes are stored.
            ack = await gateway.js.publish(names.usage_subject(G, "g-key"), b"{}",
                                           headers={"Nats-Msg-Id": f"after-flood-{time.time()}"})  # fmt: skip
            assert ack.seq
            quota = names.kv_subject(names.QUOTAS_BUCKET, names.quota_key("g-key"))
            assert (await gateway.js.publish(quota, b'{"w": 2}')).seq
            # And a new endpoint's queue still has room on the servers.
            await ensure_endpoint_queue(operator.js, H, layout)
        finally:
            for connection in (pod, g_pod, gateway, operator):
                await connection.close()

    asyncio.run(scenario())
    assert "maximum subscriptions exceeded" in server.log_path.read_text().lower()


def test_a_forged_completed_record_bills_nobody(chart_nats, caplog):
    """With P's runtime credential, forge what billing reads. The gateway's real meter, keys,
    limiter and metrics: a COMPLETED record naming the key `victim` (tokens-per-minute 200, on
    another endpoint) bills `victim` nothing and spends none of its limit -- with no admission,
    with an admission the pod wrote itself (billed to P's own name then, never a gateway key's),
    or on a job the gateway admitted for another key; a gateway admission cannot be forged;
    tokens over what was admitted, a record naming another endpoint, and a finished record
    written again bill nothing more. A job P ran as admitted is billed to its key, once."""
    from llmendpoints_common.jobs.admission import JobAdmission, endpoint_key_name
    from llmendpoints_common.jobs.record import JobRecord, claim, finish
    from llmendpoints_common.queue import admissions
    from llmendpoints_common.queue.state import JobStates
    from llmendpoints_gateway.keys import Key, KeyRing, digest
    from llmendpoints_gateway.limiter import Limiter
    from llmendpoints_gateway.metrics import GatewayMetrics
    from llmendpoints_gateway.queue import SharedQueue
    from llmendpoints_gateway.quotas import Limits
    from llmendpoints_gateway.registry import Registry
    from llmendpoints_gateway.usage import JobUsageMeter, Metering, read_usage

    server = chart_nats[0]
    url = server.url
    P, V = EndpointRef("team-p", "forge"), EndpointRef("team-v", "victims")
    gateway_creds = _gateway_creds_file(chart_nats)
    victim = Key("victim", frozenset({V.id}), limits=Limits(tokens_per_minute=200))
    alice = Key("alice", frozenset({P.id}), limits=Limits(tokens_per_minute=1_000_000))
    huge = [{"usage": {"input": 5_000_000, "output": 5_000_000}}]

    async def scenario() -> None:
        operator = await _connect(url, _creds(chart_nats, "operator"), "operator")
        admin = await _connect(url, _creds(chart_nats, "admin"), "admin")
        for endpoint in (P, V):
            await ensure_endpoint_queue(operator.js, endpoint, QueueLayout())
        queue = SharedQueue(url, "g", gateway_creds)
        await queue.start()
        limiter = Limiter("g", queue)
        await limiter.start()
        keys = KeyRing()
        keys.set_secret_keys({digest("v-secret"): victim, digest("a-secret"): alice})
        metrics = GatewayMetrics(key_labels=True)
        metering = Metering("g", metrics, limiter, keys, Registry(metrics, 10, 1.5))
        meter = JobUsageMeter(queue, metering.job_usage, on_refused=metering.job_unbilled)
        await meter.start()
        gateway = await _connect(url, Path(gateway_creds).read_text(), "gateway")
        p_jobs = QueueJobService(gateway, P, admitted_by=admission.GATEWAY)  # the gateway's /run
        pod = await _connect(url, _creds(chart_nats, "runtime", P), "pod-p", REFUSED)
        states = JobStates(pod.js, P)
        since = time.time()
        try:
            now = time.time()

            def ended(job_id: str, owner: str, output, endpoint: str = P.id) -> JobRecord:
                return JobRecord(id=job_id, endpoint=endpoint, owner=owner, request={},
                                 sync=False, submitted_at=now, retention_seconds=600,
                                 ttl_seconds=600, status=JobStatus.COMPLETED, finished_at=now,
                                 output=output)  # fmt: skip

            # 1. No admission at all.
            await states.write(ended("forged-1", "victim", huge), revision=0)
            # 2. A gateway admission for it: refused by the server.
            forged = JobAdmission(id="forged-2", endpoint=P.id, owner="victim", by="gateway",
                                  prompt_tokens=10**8, completion_tokens=10**8,
                                  admitted_at=now, expires_at=now + 600)  # fmt: skip
            await _refused(admissions.write(pod.js, P, forged))
            # 3. Its own admission naming `victim` (the pod's word): billed to P's own name.
            await admissions.write(pod.js, P, forged.model_copy(update={"by": "endpoint"}))
            await states.write(ended("forged-2", "victim", huge), revision=0)
            # 4. A job the gateway admitted for alice, ended naming `victim` as its owner.
            body = b'{"input": {"prompt": "hi", "sampling_params": {"max_tokens": 16}}}'
            alices = [
                await p_jobs.submit(parse_job_request(body), sync=False, owner="alice")
                for _ in range(3)
            ]

            def run(output, **change):
                def done(r: JobRecord) -> JobRecord:
                    claimed = claim(r, now=now, worker="pod-p")
                    end = finish(claimed, JobStatus.COMPLETED, now=now, output=output)
                    return end.model_copy(update=change)

                return done

            await states.update(alices[0].id, run(huge, owner="victim"))
            # 5. Alice's own job, with more tokens than she was admitted for.
            await states.update(alices[1].id, run(huge))
            # 6. A record stored under P naming endpoint V.
            await states.write(ended("forged-6", "victim", huge, endpoint=V.id), revision=0)
            # 7. Alice's job as admitted: billed to alice, once, however often it is rewritten.
            fair = [{"usage": {"input": 3, "output": 16}}]
            await states.update(alices[2].id, run(fair))
            deadline = time.monotonic() + 60

            def seen(counter) -> float:
                return counter._value.get()

            while not seen(metrics.key_tokens.labels("alice", P.id, "completion")):
                assert time.monotonic() < deadline, "alice's job was not billed"
                await asyncio.sleep(0.1)
            for i in range(3):
                later = time.time()
                await states.update(
                    alices[2].id, lambda r, i=i, later=later: r.model_copy(
                        update={"finished_at": later, "stream_cursor": i + 1}
                    ),
                )  # fmt: skip
            while True:  # every write of P's records was handled
                info = await admin.js.consumer_info(names.records_stream(P), names.USAGE_CONSUMER)
                if info.num_pending == 0 and info.num_ack_pending == 0:
                    break
                assert time.monotonic() < deadline, "the meter did not read P's records"
                await asyncio.sleep(0.1)

            records = await read_usage(url, since - 1, None, gateway_creds)
            # This meter also bills what the module's earlier tests left on other endpoints (a
            # job G ran for `g-key` in the flood test, when it ended within the second before
            # `since`): only this test's endpoints are about these forgeries.
            ours = [r for r in records if r.endpoint in (P.id, V.id)]
            billed = sorted((r.key, r.prompt_tokens + r.completion_tokens) for r in ours)
            assert billed == [("alice", 19), (endpoint_key_name(P.id, "victim"), 10_000_000)]
            # Nothing of it reached victim: no tokens counted, its tokens-per-minute untouched.
            assert seen(metrics.key_tokens.labels("victim", P.id, "completion")) == 0
            assert await limiter.admit(victim, tokens=190) is not None  # 190 of its 200
            assert seen(metrics.key_tokens.labels("alice", P.id, "completion")) == 16  # once
            assert seen(metrics.jobs_unbilled.labels(P.id)) == 4
        finally:
            await meter.stop()
            for connection in (pod, gateway, admin, operator):
                await connection.close()
            await limiter.stop()
            await queue.stop()

    with caplog.at_level("WARNING", logger="llmendpoints.gateway.usage"):
        asyncio.run(scenario())
    reasons = "\n".join(r.getMessage() for r in caplog.records if "is not billed" in r.getMessage())
    for why in ("no admission", "names owner 'victim', the admission 'alice'",
                "5000000 prompt and 5000000 completion tokens reported",
                "names job 'forged-6' of 'team-v/victims'"):  # fmt: skip
        assert why in reasons, reasons
    assert ".adm.gw.forged-2" in "\n".join(server.violations())
