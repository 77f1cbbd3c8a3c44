"""A batch's requests as jobs of the shared queue's batch lane (``llmep.ep.<ep>.jobs.batch.*``).

Request ``i`` of batch ``b`` is the job ``line_job_id(b, i)`` of the batch's endpoint: a job
record like any other (the same workers run it, the same ``/status`` shows it to its owner)
with ``batch`` set, so its message goes to the batch lane and the worker runs it below every
interactive request. Handing a request over twice stores it once: the record is created only
if it does not exist (compare-and-set on revision 0), and its message carries a de-duplication
id.

A request's record is kept until its batch's results are written and, for a RunPod batch, as
long as the batch's results may be read (``GET .../requests`` reads them).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

from llmendpoints_common.batch.output import NOT_QUEUED, LineOutcome
from llmendpoints_common.batch.record import BatchRecord, line_job_id
from llmendpoints_common.errors import APIError as HTTPError
from llmendpoints_common.errors import RateLimitError
from llmendpoints_common.jobs import admission
from llmendpoints_common.jobs.models import JobStatus
from llmendpoints_common.jobs.record import Conflict, JobRecord, cancel
from llmendpoints_common.queue.client import QueueConnection, QueueJobService
from llmendpoints_common.queue.state import StaleRevision

# An OpenAI batch's results are in its files once written: its requests' records need only
# outlive the window by the time the files take to write (a day, for a driver that was down).
OPENAI_KEEP_SECONDS = 86_400.0


class QueueLines:
    """The driver's ``LineRunner`` on the shared queue (the gateway's credential)."""

    def __init__(
        self, connection: QueueConnection, *, clock: Callable[[], float] = time.time
    ) -> None:
        self.connection = connection
        self._clock = clock
        self._services: dict[str, QueueJobService] = {}
        # The endpoint's queued job ids, read once for a burst of checks (a driver taking over
        # checks each request it may have handed over before): endpoint -> (read at, ids).
        self._queued_ids: dict[str, tuple[float, set[str]]] = {}

    def _service(self, batch: BatchRecord) -> QueueJobService:
        assert batch.endpoint is not None
        service = self._services.get(batch.endpoint)
        if service is None:
            service = self._services[batch.endpoint] = QueueJobService(
                self.connection, batch.endpoint, clock=self._clock, admitted_by=admission.GATEWAY
            )
        return service

    def _keep_until(self, batch: BatchRecord) -> float:
        if batch.api == "openai":
            return batch.expires_at + OPENAI_KEEP_SECONDS
        return batch.expires_at + batch.output_ttl_seconds

    async def submit(self, batch: BatchRecord, index: int, request: dict[str, Any]) -> None:
        service = self._service(batch)
        job_id = line_job_id(batch.id, index)
        now = self._clock()
        keep = max(60.0, self._keep_until(batch) - now)
        record = JobRecord(
            id=job_id,
            endpoint=service.endpoint,
            owner=batch.owner,
            request=request,
            sync=False,
            submitted_at=now,
            retention_seconds=keep,
            ttl_seconds=keep,
            batch=batch.id,
        )
        try:
            # The gateway's admission first: the meter bills the request to its batch's owner.
            await service.admit(record)
            await service.states.write(record, revision=0, ttl_seconds=keep)
        except StaleRevision:
            current = await service.states.read(job_id)
            if current is None or current[0].status is not JobStatus.IN_QUEUE:
                return  # taken, or ended: nothing to hand over
            if await self._queued(service, job_id):
                return
            record = current[0]  # stored, its message lost (a driver stopped in between)
        try:
            await service.queue_record(record)
        except RateLimitError:
            # The key's queue is full (the per-owner cap): the record stays, and the next
            # submit finds it stored without its message and queues it. Removed, its purge
            # marker would refuse the new record for a minute.
            raise
        except BaseException:
            with contextlib.suppress(Exception):
                if record.runs == 1 and record.attempt == 0:
                    await service.states.remove(job_id)
            raise

    async def _queued(self, service: QueueJobService, job_id: str) -> bool:
        read_at, ids = self._queued_ids.get(service.endpoint, (0.0, set()))
        if time.monotonic() - read_at > 1.0:
            ids = {queued for _, queued in await service.queued_messages()}
            self._queued_ids[service.endpoint] = (time.monotonic(), ids)
        return job_id in ids

    async def outcome(self, batch: BatchRecord, index: int) -> LineOutcome:
        if batch.endpoint is None:
            return NOT_QUEUED
        current = await self._service(batch).states.read(line_job_id(batch.id, index))
        if current is None:
            return NOT_QUEUED
        record = current[0]
        return LineOutcome(
            status=record.status,
            output=record.output,
            error=record.error,
            started_at=record.started_at,
            finished_at=record.finished_at,
        )

    async def cancel(self, batch: BatchRecord, index: int, *, running: bool) -> None:
        service = self._service(batch)
        job_id = line_job_id(batch.id, index)
        if running:
            with contextlib.suppress(HTTPError):
                await service.cancel(job_id, owner=None)
            return
        now = self._clock()

        def queued_only(record: JobRecord) -> JobRecord:
            if record.status is not JobStatus.IN_QUEUE:
                raise Conflict(record.status.value)
            return cancel(record, now=now)

        try:
            result = await service.states.update(job_id, queued_only)
        except Conflict:
            return  # running (it finishes) or ended
        if result is not None and service.may_unqueue:
            await service.unqueue(job_id)
