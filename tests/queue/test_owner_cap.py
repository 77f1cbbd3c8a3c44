"""One key cannot fill an endpoint's queue (issue 21): the per-owner cap on queued jobs, on a
real nats-server.

- JetStream itself refuses the job over the cap (the jobs stream's per-subject limit; subjects
  carry the owner), so two gateway replicas submitting at once never overshoot it;
- the refusal is a RunPod-style 429 naming the limit; nothing is queued or left behind; other
  keys and the process go on;
- a job that ends (a worker ran it) or is cancelled frees its slot;
- upgrading a queue made before the cap (or its bounds): the operator sets them on the
  existing streams, and on the shared ones made before any bound; jobs queued before are run.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json

import pytest
from llmendpoints_common.errors import RateLimitError
from llmendpoints_common.identity import EndpointRef
from llmendpoints_common.jobs.api import JobCall, JobVerbs
from llmendpoints_common.jobs.models import JobStatus, parse_job_request
from llmendpoints_common.queue import names
from llmendpoints_common.queue.client import QueueConnection, QueueJobService
from llmendpoints_common.queue.depth import endpoint_depth
from llmendpoints_common.queue.topology import (
    QueueLayout,
    ensure_endpoint_queue,
    ensure_streams,
)
from llmendpoints_common.queue.worker import QueueWorker, WorkerSettings
from nats.js import api as js_api

CAP = 3
RUN = parse_job_request(b'{"input": {"prompt": "p"}}')


async def _connect(url: str, name: str, layout: QueueLayout) -> QueueConnection:
    return await QueueConnection.connect(url, name=name, layout=layout)


async def _submit_all(services, owner: str, count: int) -> tuple[list, list]:
    results = await asyncio.gather(
        *(services[i % 2].submit(RUN, sync=False, owner=owner) for i in range(count)),
        return_exceptions=True,
    )
    accepted = [r for r in results if not isinstance(r, BaseException)]
    refused = [r for r in results if isinstance(r, BaseException)]
    return accepted, refused


def test_one_key_cannot_fill_an_endpoints_queue(tmp_path):
    from integration.nats_kit import running_nats

    ep = EndpointRef("team-a", "capped")
    layout = QueueLayout(max_queued_per_owner=CAP)

    async def scenario(url: str) -> None:
        replicas = [await _connect(url, f"gateway-{i}", layout) for i in range(2)]
        services = [QueueJobService(c, ep) for c in replicas]
        try:
            await ensure_endpoint_queue(replicas[0].js, ep, layout)
            # Ten submissions at once through two replicas: exactly the cap gets in.
            accepted, refused = await _submit_all(services, "alice", 10)
            assert len(accepted) == CAP and len(refused) == 10 - CAP
            assert all(isinstance(e, RateLimitError) for e in refused)
            assert (await endpoint_depth(replicas[0].js, ep)).queued == CAP
            # Another key is not affected.
            assert (await services[1].submit(RUN, sync=False, owner="bob")).id

            # Over the cap through the job API: RunPod's error body, naming the limit.
            verbs = JobVerbs(services[0])
            reply = await verbs.handle(JobCall("POST", "run", "alice", body=b'{"input": {}}'))
            assert reply.status == 400  # a bad job is still a 400, not a 429
            reply = await verbs.handle(
                JobCall("POST", "run", "alice", body=b'{"input": {"prompt": "p"}}')
            )
            assert reply.status == 429 and reply.headers["Retry-After"] == "5"
            error = reply.body["error"]
            assert error["type"] == "RateLimitError"
            assert f"key 'alice' has {CAP} jobs queued or running" in error["message"]
            assert "LLMEP_OPERATOR_JOBS_MAX_QUEUED_PER_OWNER" in error["message"]
            # Nothing of the refused jobs stays: the queue and the records hold the cap's jobs.
            assert (await endpoint_depth(replicas[0].js, ep)).queued == CAP + 1
            assert len(await services[0].queued_messages()) == CAP + 1

            # A cancelled job frees its slot.
            await services[0].cancel(accepted[0].id, owner="alice")
            again = await services[1].submit(RUN, sync=False, owner="alice")
            with pytest.raises(RateLimitError):
                await services[0].submit(RUN, sync=False, owner="alice")

            # Jobs a worker ran free theirs when they end.
            async def execute(record, publish):
                return [{"usage": {"input": 1, "output": 1}}]

            async def abort(record):
                return None

            worker = QueueWorker(
                services[0], name="pod", execute=execute, abort=abort, free_slots=lambda: 4,
                settings=WorkerSettings(poll_seconds=0.2),
            )  # fmt: skip
            await worker.start()
            try:
                done = await services[1].wait(again.id, 20, owner="alice")
                assert done.status is JobStatus.COMPLETED
                for job in accepted[1:]:
                    ended = await services[1].wait(job.id, 20, owner="alice")
                    assert ended.status is JobStatus.COMPLETED
                fresh, refused = await _submit_all(services, "alice", CAP)
                assert len(fresh) == CAP and not refused
                for job in fresh:
                    ended = await services[0].wait(job.id, 20, owner="alice")
                    assert ended.status is JobStatus.COMPLETED
            finally:
                await worker.stop(1)
        finally:
            for connection in replicas:
                await connection.close()

    with running_nats(tmp_path) as server:
        asyncio.run(scenario(server.url))


def test_a_queue_made_before_the_cap_gets_it_and_loses_no_job(tmp_path):
    """An upgrade: an endpoint's queue made by a release with no per-owner cap and a larger
    bound, and the shared usage stream made before it had a bound; a job waits. The new
    operator sets the cap and the bounds on the existing streams (nothing else of them
    changes); the waiting job and new per-owner jobs run, and the cap holds."""
    from integration.nats_kit import running_nats

    ep = EndpointRef("team-a", "upgraded")
    old_layout = QueueLayout(max_queued_per_owner=0, endpoint_max_bytes=64 * 1024 * 1024)
    new_layout = QueueLayout(max_queued_per_owner=CAP)

    async def scenario(url: str) -> None:
        old = await _connect(url, "old-release", old_layout)
        try:
            await ensure_endpoint_queue(old.js, ep, old_layout)
            usage = (await old.js.stream_info(names.USAGE_STREAM)).config
            await old.js.update_stream(dataclasses.replace(usage, max_bytes=-1))
            service = QueueJobService(old, ep)
            waiting = await service.submit(RUN, sync=False, owner="alice")
            queue = names.queue_stream(ep)
            assert (await old.js.stream_info(queue)).config.max_msgs_per_subject == 10_000

            # The new operator: its bounds on the existing streams.
            operator = await _connect(url, "operator", new_layout)
            await ensure_streams(operator.js, new_layout, reconcile=True)
            await ensure_endpoint_queue(operator.js, ep, new_layout, reconcile=True)
            info = await operator.js.stream_info(queue)
            assert info.config.max_msgs_per_subject == CAP
            assert info.config.retention == js_api.RetentionPolicy.WORK_QUEUE  # nothing else
            assert info.config.discard_new_per_subject
            records = await operator.js.stream_info(names.records_stream(ep))
            assert records.config.max_bytes == new_layout.endpoint_max_bytes
            usage = (await operator.js.stream_info(names.USAGE_STREAM)).config
            assert usage.max_bytes == new_layout.usage_max_bytes
            consumer = await operator.js.consumer_info(queue, names.jobs_consumer(ep, "normal"))
            assert consumer.num_pending == 1  # the old job is still queued

            new = QueueJobService(operator, ep)
            fresh = [await new.submit(RUN, sync=False, owner="alice") for _ in range(CAP - 1)]
            with pytest.raises(RateLimitError):
                await new.submit(RUN, sync=False, owner="alice")
            ran: list[str] = []

            async def execute(record, publish):
                ran.append(record.id)
                return json.loads('[{"usage": {"input": 1, "output": 1}}]')

            async def abort(record):
                return None

            worker = QueueWorker(
                new, name="pod", execute=execute, abort=abort, free_slots=lambda: 4,
                settings=WorkerSettings(poll_seconds=0.2),
            )  # fmt: skip
            await worker.start()
            try:
                for job in [waiting, *fresh]:
                    ended = await new.wait(job.id, 20, owner="alice")
                    assert ended.status is JobStatus.COMPLETED
            finally:
                await worker.stop(1)
            assert sorted(ran) == sorted(j.id for j in [waiting, *fresh])
            await operator.close()
        finally:
            await old.close()

    with running_nats(tmp_path) as server:
        asyncio.run(scenario(server.url))
