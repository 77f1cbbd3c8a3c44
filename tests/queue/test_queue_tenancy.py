"""Two endpoints named `chat` in two namespaces share nothing in the queue (a real nats-server in
JWT mode; each endpoint's pods with the credential the operator mints for it alone).

The attack this answers: namespace B's pods took A's jobs and wrote A's results, B's admin key
purged A's queue, held requests and usage of one were counted for the other.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from llmendpoints_common.errors import NotFoundError
from llmendpoints_common.identity import EndpointRef
from llmendpoints_common.jobs.models import JobStatus, parse_job_request
from llmendpoints_common.queue import names, signals
from llmendpoints_common.queue.client import QueueConnection, QueueJobService
from llmendpoints_common.queue.depth import endpoint_depth
from llmendpoints_common.queue.topology import QueueLayout, ensure_endpoint_queue
from llmendpoints_common.queue.worker import QueueWorker, WorkerSettings
from nats_auth_kit import auth_nats

A = EndpointRef("team-a", "chat")
B = EndpointRef("team-b", "chat")


def job(prompt: str):
    return parse_job_request(f'{{"input": {{"prompt": "{prompt}"}}}}'.encode())


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with auth_nats(tmp_path_factory.mktemp("tenancy")) as running:
        yield running


def test_same_named_endpoints_in_two_namespaces_share_nothing(server):
    async def scenario() -> None:
        connect = QueueConnection.connect
        operator = await connect(server.url, name="operator", creds=server.creds("operator"))
        for endpoint in (A, B):
            await ensure_endpoint_queue(operator.js, endpoint, QueueLayout())
        gateway = await connect(server.url, name="gateway", creds=server.creds("gateway"))
        pod_a = await connect(server.url, name="pod-a", creds=server.creds("runtime", A.id))
        pod_b = await connect(server.url, name="pod-b", creds=server.creds("runtime", B.id))
        ran: dict[str, list[str]] = {"a": [], "b": []}

        def worker(service: QueueJobService, who: str) -> QueueWorker:
            async def execute(record, publish):
                ran[who].append(record.id)
                publish({"by": who})
                return [{"by": who}]

            async def abort(record) -> None:
                return None

            return QueueWorker(
                service, name=f"pod-{who}", execute=execute, abort=abort,
                free_slots=lambda: 4, settings=WorkerSettings(poll_seconds=0.2),
            )  # fmt: skip

        a_jobs, b_jobs = QueueJobService(pod_a, A), QueueJobService(pod_b, B)
        gw_a, gw_b = QueueJobService(gateway, A), QueueJobService(gateway, B)
        worker_b = worker(b_jobs, "b")
        worker_a = None
        try:
            # Jobs for both, through the gateway; only B has a worker.
            for_a = [
                await gw_a.submit(job(f"a{i}"), sync=False, owner="tenant-a") for i in range(3)
            ]
            for_b = [
                await gw_b.submit(job(f"b{i}"), sync=False, owner="tenant-b") for i in range(2)
            ]
            await worker_b.start()
            for b_job in for_b:
                assert (await gw_b.wait(b_job.id, 20, owner=None)).status is JobStatus.COMPLETED
            await asyncio.sleep(1.0)  # B's worker has had every chance to take A's jobs
            assert sorted(ran["b"]) == sorted(j.id for j in for_b)
            for a_job in for_a:
                assert (await gw_a.get(a_job.id, owner=None)).status is JobStatus.IN_QUEUE
            assert (await endpoint_depth(gateway.js, A)).queued == 3

            # Records: an id of A's is unknown at B (the keys are the endpoint's), even to B's
            # admin; and A's records say they are A's.
            with pytest.raises(NotFoundError):
                await b_jobs.get(for_a[0].id, owner=None)
            assert (await gw_a.get(for_a[0].id, owner=None)).endpoint == "team-a/chat"

            # B's admin purge (owner None: every queued job of the endpoint) purges B's only.
            await worker_b.stop(0)
            queued_b = [await gw_b.submit(job(f"q{i}"), sync=False, owner="b") for i in range(2)]
            assert await b_jobs.purge_queue(owner=None) == 2
            for b_job in queued_b:
                assert (await gw_b.get(b_job.id, owner=None)).status is JobStatus.CANCELLED
            assert (await endpoint_depth(gateway.js, A)).queued == 3
            for a_job in for_a:
                assert (await gw_a.get(a_job.id, owner=None)).status is JobStatus.IN_QUEUE

            # A's own pods run A's jobs, and their stream is A's.
            worker_a = worker(a_jobs, "a")
            await worker_a.start()
            for a_job in for_a:
                assert (await a_jobs.wait(a_job.id, 20, owner="tenant-a")).output == [{"by": "a"}]
            _, chunks = await gw_a.take_stream(for_a[0].id, owner=None)
            assert chunks == [{"by": "a"}]
            assert not set(ran["a"]) & set(ran["b"])

            # Held requests and nudges: one per endpoint.
            await signals.publish_held(gateway.js, A, "gw-1", 2)
            await signals.publish_held(gateway.js, B, "gw-1", 7)
            assert await signals.read_held(operator.js, A) == 2
            assert await signals.read_held(operator.js, B) == 7
            nudged: list[EndpointRef] = []
            # Returns once the server holds the subscription (a flush() did not promise that:
            # tests/queue/test_subscription_start.py).
            await signals.subscribe_nudges(operator.nc, nudged.append)
            await signals.nudge(gateway.nc, B)
            deadline = time.monotonic() + 30  # generous: a loaded machine delays delivery
            while not nudged:
                assert time.monotonic() < deadline, "no nudge arrived"
                await asyncio.sleep(0.05)
            assert nudged == [B]

            # Usage records: each on its endpoint's own subjects.
            for endpoint, tokens in ((A, b"1"), (B, b"2"), (B, b"3")):
                await gateway.js.publish(
                    names.usage_subject(endpoint, "same-key"),
                    tokens,
                    headers={"Nats-Msg-Id": f"{endpoint.id}-{tokens.decode()}"},
                )
            for endpoint, count in ((A, 1), (B, 2)):
                info = await operator.js.stream_info(
                    names.USAGE_STREAM, subjects_filter=f"llmep.usage.{names.tokens(endpoint)}.>"
                )
                assert sum((info.state.subjects or {}).values()) == count
        finally:
            for w in (worker_a, worker_b):
                if w is not None:
                    await w.stop(0)
            for connection in (pod_a, pod_b, gateway, operator):
                await connection.close()

    asyncio.run(scenario())
    assert not server.violations(), server.violations()


def test_names_keep_namespaces_apart():
    assert names.jobs_subject(A, "normal", "k").startswith("llmep.ep.team-a.chat.jobs.normal.")
    assert names.jobs_subject(B, "normal", "k").startswith("llmep.ep.team-b.chat.jobs.normal.")
    assert names.jobs_consumer(A, "low") == "workers-team-a_chat-low"
    assert names.queue_stream(A) == "LLMEP_QUEUE_team-a_chat" != names.queue_stream(B)
    assert names.records_stream(A) == "LLMEP_RECORDS_team-a_chat" != names.records_stream(B)
    assert names.record_subject(A, "j-1") == "llmep.ep.team-a.chat.rec.j-1"
    assert names.held_key(B, "gw") == "held.team-b.chat.gw"
    assert names.nudge_subject(A) == "llmep.nudge.team-a.chat"
    assert names.endpoint_of_nudge("llmep.nudge.team-b.chat_v2") == EndpointRef("team-b", "chat.v2")
    assert names.chunk_subject(A, "j-1", 2, 5) == "llmep.ep.team-a.chat.chunk.j-1.2.5"
    assert names.usage_subject(A, "k") != names.usage_subject(B, "k")
    # "a-b" + "c" and "a" + "b-c" stay apart in stream and consumer names: a namespace holds
    # no '_'.
    assert names.jobs_consumer("a-b/c") != names.jobs_consumer("a/b-c")
    assert names.queue_stream("a-b/c") != names.queue_stream("a/b-c")
    with pytest.raises(ValueError, match="endpoint id"):
        names.jobs_subject("chat", "normal", "k")  # which namespace?
    with pytest.raises(ValueError, match="endpoint namespace"):
        names.jobs_subject("Team/chat", "normal", "k")
