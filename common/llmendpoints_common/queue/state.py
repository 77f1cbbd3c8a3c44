"""Job records in their endpoint's records stream, changed only by compare-and-set.

A record is the last message on ``llmep.ep.<ns>.<name>.rec.<id>`` (queue/names.py). A write
carries both the expected revision (``Nats-Expected-Last-Subject-Sequence``: nobody wrote in
between) and a time to live (``Nats-TTL``: a record disappears when its retention ends, or at
its ``policy.ttl`` whatever its state, so ``/status`` then answers 404 with no sweeper). Every
write carries it: the latest write's TTL is the one that counts. Reads are direct gets of the
subject's last message (answered by any replica of the stream) on the endpoint's own stream
(``$JS.API.DIRECT.GET.LLMEP_RECORDS_<ns>_<name>.<subject>``), which is what lets a runtime
pod's credential read its own endpoint's records and no other's.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from nats.js import JetStreamContext
from nats.js.errors import APIError, NotFoundError

from llmendpoints_common.identity import EndpointRef, as_ref
from llmendpoints_common.jobs.record import JobRecord, record_ttl
from llmendpoints_common.queue import names

# JetStream's error code for "wrong last sequence" (someone else wrote the key first).
WRONG_LAST_SEQUENCE = 10071
_EXPECTED_LAST = "Nats-Expected-Last-Subject-Sequence"
# How long a purge marker stays (it is an empty value: a read finds no record).
_MARKER_TTL_SECONDS = 60


async def purge_marker(js: JetStreamContext, subject: str) -> None:
    """Remove a key's value: publish an empty PURGE marker that rolls up (deletes) the key's
    earlier messages and expires itself. Not a purge request: that names the key only in its
    body, and a permission cannot scope a body (so no role but admin may purge)."""
    await js.publish(
        subject,
        b"",
        headers={"KV-Operation": "PURGE", "Nats-Rollup": "sub"},
        msg_ttl=_MARKER_TTL_SECONDS,
    )


class StaleRevision(Exception):
    """The record changed since it was read; read it again and re-decide."""


class JobStates:
    """The records of one endpoint's jobs."""

    def __init__(self, js: JetStreamContext, endpoint: EndpointRef | str) -> None:
        self._js = js
        self.endpoint = as_ref(endpoint)
        self._stream = names.records_stream(self.endpoint)

    def subject(self, job_id: str) -> str:
        return names.record_subject(self.endpoint, job_id)

    async def read(self, job_id: str) -> tuple[JobRecord, int] | None:
        """The record and its revision, or None (never stored, expired, or not a job id)."""
        try:
            subject = self.subject(job_id)
        except ValueError:
            return None
        try:
            raw = await self._js.get_msg(self._stream, subject=subject, direct=True)
        except NotFoundError:
            return None
        if not raw.data:
            return None
        return JobRecord.decode(raw.data), raw.seq

    async def write(
        self, record: JobRecord, *, revision: int, ttl_seconds: float | None = None
    ) -> int:
        """Store ``record`` if the key is still at ``revision`` (0: the key must not exist).
        Returns the new revision; raises StaleRevision otherwise. ``ttl_seconds`` defaults to
        what is left of the record's life (``record_ttl``)."""
        if ttl_seconds is None:
            ttl_seconds = record_ttl(record, time.time())
        try:
            ack = await self._js.publish(
                self.subject(record.id),
                record.encode(),
                headers={_EXPECTED_LAST: str(revision)},
                msg_ttl=None if ttl_seconds is None else max(1, round(ttl_seconds)),
            )
        except APIError as exc:
            if exc.err_code == WRONG_LAST_SEQUENCE:
                raise StaleRevision(record.id) from None
            raise
        return ack.seq

    async def update(
        self,
        job_id: str,
        change: Callable[[JobRecord], JobRecord],
        *,
        ttl: Callable[[JobRecord], float | None] = lambda _: None,
    ) -> tuple[JobRecord, JobRecord] | None:
        """Apply ``change`` to the latest record until the write wins; returns (before, after),
        or None when there is no such job. ``change`` raises to refuse (nothing is written)."""
        while True:
            current = await self.read(job_id)
            if current is None:
                return None
            record, revision = current
            changed = change(record)
            try:
                await self.write(changed, revision=revision, ttl_seconds=ttl(changed))
            except StaleRevision:
                continue
            return record, changed

    async def remove(self, job_id: str) -> None:
        """Forget a record (a submission that could not be queued)."""
        await purge_marker(self._js, self.subject(job_id))
