"""Every verb of the job API on the shared queue, with no engine: what a runtime pod that is
not running the job, and the gateway with no runtime pod at all, answer with.

- ``submit``: the record is written first, then the job's message is queued; only when both are
  stored does the caller get an id. If the queue cannot store either, the caller gets 503 with
  ``Retry-After`` and the half-written record is removed.
- ``wait``: subscribes to the record's key and returns when the job ends or the wait runs out.
- ``take_stream``: chunks of the current attempt after the job's shared cursor, in order; the
  cursor moves by compare-and-set, so two readers never get the same chunk.
- ``cancel``: a queued job's message is deleted from its endpoint's queue (every role that
  reaches the endpoint may: the stream is the endpoint's own); a running job's worker is told
  on ``llmep.ep.<ns>.<name>.cancel.<id>`` and aborts the engine request (it also notices the
  record at its next heartbeat, should the message be missed).
- Admission: a new job's admission (who accepted it, for whom, the most it may be billed:
  jobs/admission.py) is written before its record -- by the gateway where pods may not write,
  by a pod where only its endpoint is billed (``admitted_by``).
- Ownership: every verb but ``health`` takes the caller's ``owner`` (the API key's name; None for
  an admin, who sees every job). Another owner's job is answered exactly like an unknown one.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import json
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import nats.errors
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js.errors import APIError, NoStreamResponseError, NotFoundError

from llmendpoints_common.errors import (
    APIError as HTTPError,
)
from llmendpoints_common.errors import (
    ConflictError,
    ContentTooLargeError,
    RateLimitError,
    ServiceUnavailableError,
)
from llmendpoints_common.errors import (
    NotFoundError as JobNotFoundError,
)
from llmendpoints_common.identity import EndpointRef, as_ref
from llmendpoints_common.jobs import admission
from llmendpoints_common.jobs.models import (
    DEFAULT_TTL_MS,
    FINAL_STATUSES,
    JobRequest,
    JobStatus,
)
from llmendpoints_common.jobs.record import (
    Conflict,
    JobRecord,
    cancel,
    record_ttl,
    requeue_for_retry,
)
from llmendpoints_common.queue import admissions, names
from llmendpoints_common.queue.connect import connect, limits_of
from llmendpoints_common.queue.depth import endpoint_depth
from llmendpoints_common.queue.natsjwt import Permissions, UserLimits
from llmendpoints_common.queue.state import (
    WRONG_LAST_SEQUENCE,
    JobStates,
    StaleRevision,
    purge_marker,
)
from llmendpoints_common.queue.topology import QueueLayout, ensure_endpoint_streams, ensure_streams

log = logging.getLogger(__name__)

RETRY_AFTER_SECONDS = 5
ATTEMPT_HEADER = "Llmep-Attempt"
# How long a waiter re-reads a job whose end it was told of, while the write lands (seconds).
_READ_BACK_DELAYS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1)
# How long a waiter that subscribed to an existing record waits between reads of it (seconds;
# the last is repeated): see QueueJobService.wait.
_RECHECK_PAUSES = (0.05, 0.1, 0.2, 0.5, 1.0, 2.0)
# A /runsync's watch that no wait() took within this long is dropped.
_UNCLAIMED_WATCH_SECONDS = 10.0
_MSG_ID = "Nats-Msg-Id"
# JetStream's error code for a message its stream would not store: "maximum messages per
# subject exceeded" (the per-owner cap), "maximum bytes exceeded" (the endpoint's bound).
_STORE_FAILED = 10077
_EXPECTED_LAST = "Nats-Expected-Last-Subject-Sequence"
# An admission outlives its job's life by this much: the meter bills a job's end up to
# BILLED_WRITES_WITHIN_SECONDS after it (gateway/metering.py), and reads it then.
_ADMISSION_SLACK_SECONDS = 600.0
ENDPOINT_BOUND_SETTING = "LLMEP_OPERATOR_JOBS_QUEUE_ENDPOINT_MAX_BYTES"


@dataclass(frozen=True)
class QueueJobSettings:
    # Results are kept this long after a job ends (RunPod: 30 min after /run, 1 min after
    # /runsync), never past the job's policy.ttl.
    run_retention_seconds: float = 30 * 60.0
    runsync_retention_seconds: float = 60.0
    # policy.ttl of jobs that set none (RunPod: 24 h; lowered to MAX_JOB_TTL_MS).
    default_ttl_seconds: float = DEFAULT_TTL_MS / 1000
    # A /run repeated with the same Idempotency-Key within this window gets the first job's id.
    idempotency_window_seconds: float = 600.0


class QueueConnection:
    """One connection to NATS, reconnecting forever; the job API answers 503 while it is down.

    ``permissions``: what the connection's credential permits (None: a password user, whose
    permissions this process cannot see; it is assumed to have what it needs)."""

    def __init__(
        self,
        nc: NATS,
        js: JetStreamContext,
        permissions: Permissions | None = None,
        layout: QueueLayout | None = None,
        limits: UserLimits | None = None,
    ) -> None:
        self.nc = nc
        self.js = js
        self.permissions = permissions
        # The credential's own bounds (its largest message may be below the server's).
        self.limits = limits or UserLimits()
        # What an endpoint's queue is made with when this credential may make it.
        self.layout = layout or QueueLayout()

    @classmethod
    async def connect(
        cls,
        url: str,
        *,
        name: str,
        creds_file: str | None = None,
        creds: str | None = None,
        layout: QueueLayout | None = None,
        request_timeout: float = 5.0,
        connect_timeout: float = 5.0,
    ) -> QueueConnection:
        """Connect (keep trying while the queue restarts: workers must come back on their
        own), and create the streams that are missing when the credential may."""
        nc, permissions = await connect(
            url, name=name, creds_file=creds_file, creds=creds, connect_timeout=connect_timeout
        )
        limits = limits_of(creds_file, creds=creds)
        connection = cls(nc, nc.jetstream(timeout=request_timeout), permissions, layout, limits)
        if connection.may(f"$JS.API.STREAM.CREATE.{names.USAGE_STREAM}"):
            await ensure_streams(connection.js, connection.layout)
        return connection

    @property
    def max_payload(self) -> int:
        """The largest message this connection may publish: the server's, or its credential's
        when lower (NATS closes a connection that publishes more)."""
        server = self.nc.max_payload
        own = self.limits.payload
        return min(server, own) if server and own > 0 else (server or own)

    def may(self, subject: str) -> bool:
        """Whether the credential may publish to ``subject`` (a JetStream API call is one):
        asked before calls that would otherwise wait out their timeout on a refusal."""
        return self.permissions is None or self.permissions.may_publish(subject)

    @property
    def connected(self) -> bool:
        return self.nc.is_connected

    async def close(self) -> None:
        # Not drain(): it waits up to 30 s for pull subscriptions that have nothing to finish.
        with contextlib.suppress(Exception):
            await self.nc.flush(timeout=2)
        with contextlib.suppress(Exception):
            await self.nc.close()


@contextlib.asynccontextmanager
async def queue_call(what: str) -> AsyncIterator[None]:
    """Turn "the queue could not do it" into 503 + Retry-After; HTTP errors pass through."""
    try:
        yield
    except HTTPError:
        raise
    except nats.errors.MaxPayloadError:
        raise ContentTooLargeError(
            f"{what}: the job is larger than the queue's message limit (max_payload of the "
            "NATS server); send a smaller input"
        ) from None
    except (nats.errors.NoRespondersError, NoStreamResponseError):
        raise ServiceUnavailableError(
            f"{what}: the endpoint's queue does not exist yet (the llmendpoints operator "
            f"creates it with the endpoint); retry in {RETRY_AFTER_SECONDS} s",
            headers={"Retry-After": str(RETRY_AFTER_SECONDS)},
        ) from None
    except APIError as exc:
        if exc.err_code == _STORE_FAILED and "maximum bytes" in (exc.description or ""):
            raise ServiceUnavailableError(
                f"{what}: the endpoint's queue is full (its records, results and stream output "
                f"take all the storage it is given, {ENDPOINT_BOUND_SETTING}); retry when "
                "results have expired or been read",
                code="queue_full",
                headers={"Retry-After": str(RETRY_AFTER_SECONDS)},
            ) from None
        raise _unavailable(what, exc) from None
    except (TimeoutError, nats.errors.Error, OSError) as exc:
        raise _unavailable(what, exc) from None


def _unavailable(what: str, exc: BaseException) -> ServiceUnavailableError:
    detail = getattr(exc, "description", None) or str(exc) or type(exc).__name__
    return ServiceUnavailableError(
        f"{what}: the job queue is unreachable ({detail}); retry in {RETRY_AFTER_SECONDS} s",
        headers={"Retry-After": str(RETRY_AFTER_SECONDS)},
    )


def owner_digest(owner: str, idempotency_key: str) -> str:
    """Idempotency keys are per owner: two tenants may pick the same key."""
    return hashlib.sha256(f"{owner}\0{idempotency_key}".encode()).hexdigest()[:32]


class QueueJobService:
    """The job API's verbs for one endpoint's jobs on the shared queue."""

    def __init__(
        self,
        connection: QueueConnection,
        endpoint: EndpointRef | str,
        settings: QueueJobSettings | None = None,
        *,
        clock: Callable[[], float] = time.time,
        on_final: Callable[[JobRecord], None] | None = None,
        admitted_by: str = admission.ENDPOINT,
    ) -> None:
        # An EndpointRef or "ns/name": a bad one is refused now, not at the first job.
        self.ref = as_ref(endpoint)
        names.records_stream(self.ref)
        names.jobs_consumer(self.ref)
        self.connection = connection
        self.endpoint = self.ref.id  # what job records carry
        self.settings = settings or QueueJobSettings()
        self.states = JobStates(connection.js, self.ref)
        # Who this front door is (jobs/admission.py): the gateway, or one of the endpoint's pods.
        self.admitted_by = admitted_by
        self._queue_stream = names.queue_stream(self.ref)
        self._queue_made = not connection.may(
            f"$JS.API.STREAM.CREATE.{names.records_stream(self.ref)}"
        )
        self._clock = clock
        # Whoever moves a job into a final state calls this once (the runtime sends webhooks).
        self._on_final = on_final
        self._finished_here: dict[JobStatus, int] = dict.fromkeys(FINAL_STATUSES, 0)
        # Subscriptions opened by a sync submit for the wait that follows it.
        self._watches: dict[str, tuple[Any, JobRecord]] = {}
        self._background: set[asyncio.Future[Any]] = set()
        self._retried = 0

    @property
    def js(self) -> JetStreamContext:
        return self.connection.js

    @property
    def may_unqueue(self) -> bool:
        """Whether this credential may take a queued message out (a password user, or any of
        the roles that reach the endpoint: its queue is its own stream)."""
        return self.connection.may(f"$JS.API.STREAM.MSG.DELETE.{self._queue_stream}")

    async def _ensure_queue(self) -> None:
        """The endpoint's streams, made on first use by a credential that may (a password
        user: local runs, a NATS you bring; its workers make their consumers, the gateway's
        meter its own); with per-role credentials the operator made them with the endpoint."""
        if not self._queue_made:
            await ensure_endpoint_streams(
                self.js, self.ref, self.connection.layout, reconcile=False
            )
            self._queue_made = True

    # ---- submit ------------------------------------------------------------------------

    async def submit(
        self,
        request: JobRequest,
        *,
        sync: bool,
        owner: str,
        idempotency_key: str | None = None,
    ) -> JobRecord:
        self._require_connection("/run")
        job_id = str(uuid.uuid4())
        async with queue_call("the job was not accepted"):
            await self._ensure_queue()
            if idempotency_key is not None:
                first = await self._claim_idempotency_key(owner, idempotency_key, job_id)
                if first is not None:
                    return first
            # A /runsync waits next: watch the record from before it exists, so the wait needs
            # no read of its own and misses no change.
            watch = (
                await self.connection.nc.subscribe(self.states.subject(job_id)) if sync else None
            )
            try:
                record = await self._store_and_queue(request, job_id, sync=sync, owner=owner)
            except BaseException:
                if watch is not None:
                    with contextlib.suppress(Exception):
                        await watch.unsubscribe()
                if idempotency_key is not None:
                    with contextlib.suppress(Exception):
                        await self._release_idempotency_key(owner, idempotency_key)
                raise
            if watch is not None:
                self._watches[job_id] = (watch, record)
                asyncio.get_running_loop().call_later(
                    _UNCLAIMED_WATCH_SECONDS, self._drop_watch, job_id
                )
            return record

    def _drop_watch(self, job_id: str) -> None:
        if (entry := self._watches.pop(job_id, None)) is not None:
            task = asyncio.ensure_future(entry[0].unsubscribe())
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    async def _store_and_queue(
        self, request: JobRequest, job_id: str, *, sync: bool, owner: str
    ) -> JobRecord:
        ttl_ms = request.policy.ttl
        record = JobRecord(
            id=job_id,
            endpoint=self.endpoint,
            owner=owner,
            request=request.model_dump(mode="json", exclude_none=True),
            sync=sync,
            submitted_at=self._clock(),
            retention_seconds=(
                self.settings.runsync_retention_seconds
                if sync
                else self.settings.run_retention_seconds
            ),
            ttl_seconds=ttl_ms / 1000 if ttl_ms is not None else self.settings.default_ttl_seconds,
        )
        self._check_size(record)
        await self.admit(record)
        await self.states.write(record, revision=0, ttl_seconds=record_ttl(record, self._clock()))
        try:
            await self._enqueue(record)
        except BaseException:
            with contextlib.suppress(Exception):
                await self.states.remove(job_id)
            raise
        return record

    async def admit(self, record: JobRecord) -> None:
        """Write a new job's admission (jobs/admission.py) before its record: who accepted it,
        its owner, what it may be billed at most; it lives as long as the job may. A job
        admitted before (a batch's request handed over again) keeps its first admission."""
        await self._ensure_queue()
        life = record.ttl_seconds if record.ttl_seconds is not None else record.retention_seconds
        admitted = admission.admit(
            record,
            by=self.admitted_by,
            now=self._clock(),
            life_seconds=life + _ADMISSION_SLACK_SECONDS,
        )
        await admissions.write(self.js, self.ref, admitted)

    async def queue_record(self, record: JobRecord) -> int:
        """Queue a stored record's message in its lane (a batch's requests: queue/batch_lines.py)."""
        return await self._enqueue(record)

    async def queued_messages(self) -> list[tuple[int, str]]:
        """(sequence, job id) of the endpoint's queue messages, oldest first."""
        return await self._queued_messages()

    async def unqueue(self, job_id: str) -> None:
        """Take a job's message out of the queue (a credential that may: ``may_unqueue``)."""
        await self._unqueue(job_id)

    async def _enqueue(self, record: JobRecord) -> int:
        priority = record.lane
        subject = names.jobs_subject(self.ref, priority, record.owner)
        try:
            ack = await self.js.publish(
                subject,
                record.id.encode(),
                # The queue drops a second copy of the same run (a publish retried after a
                # lost acknowledgement).
                headers={_MSG_ID: f"{record.id}.{record.runs}"},
            )
        except APIError as exc:
            if exc.err_code == _STORE_FAILED and "per subject" in (exc.description or ""):
                raise RateLimitError(
                    await self._queue_full_message(record.owner, priority),
                    headers={"Retry-After": str(RETRY_AFTER_SECONDS)},
                ) from None
            raise
        return ack.seq

    async def _queue_full_message(self, owner: str, priority: str) -> str:
        """Why a job was refused: the owner's queued jobs reached the per-owner cap (the jobs
        stream's per-subject limit, read when this credential may)."""
        limit = ""
        if self.connection.may(f"$JS.API.STREAM.INFO.{self._queue_stream}"):
            with contextlib.suppress(Exception):
                info = await self.js.stream_info(self._queue_stream)
                limit = f"{info.config.max_msgs_per_subject} "
        who = f"key {owner!r}" if owner else "this caller"
        kind = {"low": "low-priority ", names.BATCH_PRIORITY: "batch "}.get(priority, "")
        return (
            f"{who} has {limit}{kind}jobs queued or running on endpoint {self.endpoint!r}, the "
            "most one key may have there (per-owner queued job limit, "
            "LLMEP_OPERATOR_JOBS_MAX_QUEUED_PER_OWNER); retry when some have finished"
        )

    def _idempotency_subject(self, owner: str, key: str) -> str:
        return names.idempotency_subject(self.ref, owner_digest(owner, key))

    async def _claim_idempotency_key(self, owner: str, key: str, job_id: str) -> JobRecord | None:
        """None when this request is the first with the key; else the first job."""
        subject = self._idempotency_subject(owner, key)
        expected = 0
        while True:
            try:
                await self.js.publish(
                    subject,
                    job_id.encode(),
                    headers={_EXPECTED_LAST: str(expected)},
                    msg_ttl=max(1, round(self.settings.idempotency_window_seconds)),
                )
                return None
            except APIError as exc:
                if exc.err_code != WRONG_LAST_SEQUENCE:
                    raise
            try:
                raw = await self.js.get_msg(
                    names.records_stream(self.ref), subject=subject, direct=True
                )
            except NotFoundError:
                expected = 0  # the released key's marker expired meanwhile
                continue
            if raw.data:
                break
            # A key released by a submission that failed (an empty marker): claim it anew.
            expected = raw.seq
        first_id = raw.data.decode()
        current = await self.states.read(first_id)
        if current is None:
            # The first request is between storing its key and its record (or its result
            # expired): the id is what it was promised.
            return JobRecord(
                id=first_id,
                endpoint=self.endpoint,
                owner=owner,
                request={},
                sync=False,
                submitted_at=self._clock(),
                retention_seconds=0,
            )
        return current[0]

    async def _release_idempotency_key(self, owner: str, key: str) -> None:
        # A marker that rolls up (removes) the key's value, not a purge of the stream: a purge
        # request names its subject only in its body, which no permission can scope.
        await purge_marker(self.js, self._idempotency_subject(owner, key))

    # ---- reading -----------------------------------------------------------------------

    async def get(self, job_id: str, *, owner: str | None) -> JobRecord:
        self._require_connection("/status")
        async with queue_call("the job's status could not be read"):
            await self._ensure_queue()
            return await self._read_owned(job_id, owner)

    async def wait(self, job_id: str, timeout_seconds: float, *, owner: str | None) -> JobRecord:
        """The job once it ends, or its latest state when ``timeout_seconds`` run out.

        Changes arrive on the record's subject, as the server routes each write. A /runsync
        subscribed before its job existed (``submit``) sees every change. A record that existed
        before the subscription can end unseen: its last write routed just before the SUB
        reached the server, yet stored only after the first read (nats-server queues a stream's
        writes but answers a direct get at once). So such a record is also read again, after
        ``_RECHECK_PAUSES`` without news (bench/RESULTS.md, "A nudge lost between two
        connections")."""
        self._require_connection("/runsync")
        async with queue_call("the job's status could not be read"):
            await self._ensure_queue()
            if (watched := self._watches.pop(job_id, None)) is not None:
                subscription, record = watched
                self._check_owner(record, job_id, owner)
                pauses = itertools.repeat(math.inf)
            else:
                subscription = await self.connection.nc.subscribe(self.states.subject(job_id))
                pauses = itertools.chain(_RECHECK_PAUSES, itertools.repeat(_RECHECK_PAUSES[-1]))
            try:
                if watched is None:
                    record = await self._read_owned(job_id, owner)
                deadline = time.monotonic() + timeout_seconds
                while not record.status.is_final:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        break
                    try:
                        message = await subscription.next_msg(timeout=min(remaining, next(pauses)))
                    except nats.errors.TimeoutError:
                        record = await self._read_owned(job_id, owner)
                        continue
                    if not message.data or JobRecord.decode(message.data).status.is_final:
                        record = await self._read_back_end(job_id, owner)
                return record
            finally:
                with contextlib.suppress(Exception):
                    await subscription.unsubscribe()

    async def _read_back_end(self, job_id: str, owner: str | None) -> JobRecord:
        """A core subscriber sees a write as the server routes it: possibly before the stream
        has stored it, and even when JetStream then refuses it (a compare-and-set that lost).
        So an end is believed only once read back from the stream; the read is repeated for a
        moment while the write lands, and a refused end just means waiting on."""
        record = await self._read_owned(job_id, owner)
        for delay in _READ_BACK_DELAYS:
            if record.status.is_final:
                break
            await asyncio.sleep(delay)
            record = await self._read_owned(job_id, owner)
        return record

    async def take_stream(self, job_id: str, *, owner: str | None) -> tuple[JobRecord, list[Any]]:
        """Chunks of the current attempt produced since the last call (by anyone), in order."""
        self._require_connection("/stream")
        async with queue_call("the job's stream could not be read"):
            await self._ensure_queue()
            while True:
                current = await self.states.read(job_id)
                record = self._owned(current, job_id, owner)
                assert current is not None
                revision = current[1]
                chunks, cursor = await self._chunks_after(record)
                if cursor == record.stream_cursor:
                    return record, []
                moved = record.model_copy(update={"stream_cursor": cursor})
                try:
                    await self.states.write(
                        moved, revision=revision, ttl_seconds=record_ttl(moved, self._clock())
                    )
                except StaleRevision:
                    continue  # another reader or the worker wrote first: read again
                return moved, chunks

    async def _chunks_after(self, record: JobRecord) -> tuple[list[Any], int]:
        """The current attempt's chunks after the cursor (the count handed out so far), each
        read by its own subject. Chunks of an attempt that was abandoned (its worker died) are
        never read: the current attempt starts the output again from its first chunk."""
        chunks: list[Any] = []
        cursor = record.stream_cursor
        while True:
            subject = names.chunk_subject(self.ref, record.id, record.attempt, cursor + 1)
            try:
                raw = await self.js.get_msg(
                    names.records_stream(self.ref), subject=subject, direct=True
                )
            except NotFoundError:
                return chunks, cursor
            if raw.data is None:
                return chunks, cursor
            cursor += 1
            chunks.append(json.loads(raw.data))

    # ---- changing a job ----------------------------------------------------------------

    async def cancel(self, job_id: str, *, owner: str | None) -> JobRecord:
        self._require_connection("/cancel")
        async with queue_call("the job was not cancelled"):
            await self._ensure_queue()
            now = self._clock()
            result = await self.states.update(
                job_id,
                lambda r: _conflict_to_409(cancel, self._check_owner(r, job_id, owner), now=now),
                ttl=lambda r: record_ttl(r, now),
            )
            if result is None:
                raise _not_found(job_id)
            before, after = result
            if before.status is JobStatus.IN_QUEUE:
                if self.may_unqueue:
                    await self._unqueue(job_id)
            else:
                await self.connection.nc.publish(names.cancel_subject(self.ref, job_id))
            self.ended(after)
            return after

    async def retry(self, job_id: str, *, owner: str | None) -> JobRecord:
        self._require_connection("/retry")
        async with queue_call("the job was not queued again"):
            await self._ensure_queue()
            result = await self.states.update(
                job_id,
                lambda r: _conflict_to_409(requeue_for_retry, self._check_owner(r, job_id, owner)),
            )
            if result is None:
                raise _not_found(job_id)
            before, record = result
            # The earlier attempts' chunks stay until they expire: the new run's attempt has
            # its own chunk subjects.
            try:
                await self._enqueue(record)
            except BaseException:
                # Put the job back as it was: a retry that did not queue must not leave a job
                # IN_QUEUE that no worker will ever take.
                with contextlib.suppress(Exception):
                    await self.states.update(
                        job_id, lambda _: before, ttl=lambda r: record_ttl(r, self._clock())
                    )
                raise
            self._retried += 1
            await self._admit_run(record)
            # What the retry did (a worker may already have taken the job since).
            return record

    async def _admit_run(self, record: JobRecord) -> None:
        """A /retry starts a new run: its front door admits it (a retry at a pod of a job the
        gateway admitted is the pod's word, and that run is not billed)."""

        def more_runs(admitted: admission.JobAdmission) -> admission.JobAdmission | None:
            if admitted.runs >= record.runs:
                return None
            return admitted.model_copy(update={"runs": record.runs})

        with contextlib.suppress(Exception):  # the run still happens; it is just not billed
            await admissions.update(self.js, self.ref, record.id, self.admitted_by, more_runs)

    async def purge_queue(self, *, owner: str | None) -> int:
        """Cancel the caller's queued jobs (every queued job for an admin: ``owner=None``)."""
        self._require_connection("/purge-queue")
        removed = 0
        async with queue_call("the queue was not purged"):
            await self._ensure_queue()
            unqueue = self.may_unqueue
            for seq, job_id in await self._queued_messages():
                now = self._clock()
                try:
                    result = await self.states.update(
                        job_id,
                        lambda r, now=now: _purge_one(r, owner, now),
                        ttl=lambda r, now=now: record_ttl(r, now),
                    )
                except _Skip:
                    continue
                if result is None:
                    continue
                _, after = result
                if unqueue:
                    with contextlib.suppress(NotFoundError, APIError):
                        await self.js.delete_msg(self._queue_stream, seq)
                self.ended(after)
                removed += 1
        return removed

    async def _queued_messages(self) -> list[tuple[int, str]]:
        """(sequence, job id) of the endpoint's queue messages (queued and running), oldest
        first. Read one by one: only /purge-queue and the cancel of a queued job need them."""
        found: list[tuple[int, str]] = []
        seq = 0
        subject = names.jobs_filter(self.ref)
        while True:
            try:
                raw = await self.js.get_msg(
                    self._queue_stream, seq=seq + 1, subject=subject, next=True
                )
            except NotFoundError:
                return found
            seq = raw.seq
            if raw.data:
                found.append((seq, raw.data.decode()))

    async def _unqueue(self, job_id: str) -> None:
        """Take a cancelled job's message out of the queue, so the depth the autoscaler reads
        drops at once (a worker that meets it first just acknowledges it)."""
        for seq, queued_id in await self._queued_messages():
            if queued_id == job_id:
                with contextlib.suppress(NotFoundError, APIError):
                    await self.js.delete_msg(self._queue_stream, seq)
                return

    async def health(self) -> dict[str, Any]:
        """RunPod's ``/health`` shape from the queue: queued and running jobs of the endpoint
        (all pods); the final-state counts are the jobs that ended through this process."""
        self._require_connection("/health")
        async with queue_call("the queue's depth could not be read"):
            depth = await endpoint_depth(self.js, self.ref)
        return {
            "jobs": {
                "inQueue": depth.queued,
                "inProgress": depth.running,
                "completed": self._finished_here[JobStatus.COMPLETED],
                "failed": self._finished_here[JobStatus.FAILED],
                "cancelled": self._finished_here[JobStatus.CANCELLED],
                "timedOut": self._finished_here[JobStatus.TIMED_OUT],
                "retried": self._retried,
            },
            "queue": {"connected": self.connection.connected},
        }

    def ended(self, record: JobRecord) -> None:
        """Called once per job end by the writer that ended it."""
        self._finished_here[record.status] = self._finished_here.get(record.status, 0) + 1
        if self._on_final is not None:
            self._on_final(record)

    # ---- helpers -----------------------------------------------------------------------

    def _check_size(self, record: JobRecord) -> None:
        """A job whose record exceeds the server's message limit is a 413 that says so (the
        limit is NATS's ``max_payload``, 1 MiB unless the server raises it)."""
        limit = self.connection.max_payload
        size = len(record.encode())
        if limit and size > limit:
            raise ContentTooLargeError(
                f"the job is {size} bytes as stored; the shared queue takes at most {limit} "
                "bytes per job (the NATS server's max_payload, or this credential's payload "
                "limit); send a smaller input"
            )

    def _require_connection(self, what: str) -> None:
        if not self.connection.connected:
            raise ServiceUnavailableError(
                f"{what}: the job queue is unreachable (reconnecting); retry in "
                f"{RETRY_AFTER_SECONDS} s",
                headers={"Retry-After": str(RETRY_AFTER_SECONDS)},
            )

    async def _read_owned(self, job_id: str, owner: str | None) -> JobRecord:
        return self._owned(await self.states.read(job_id), job_id, owner)

    def _owned(
        self, current: tuple[JobRecord, int] | None, job_id: str, owner: str | None
    ) -> JobRecord:
        if current is None:
            raise _not_found(job_id)
        return self._check_owner(current[0], job_id, owner)

    @staticmethod
    def _check_owner(record: JobRecord, job_id: str, owner: str | None) -> JobRecord:
        if owner is not None and record.owner != owner:
            raise _not_found(job_id)
        return record


class _Skip(Exception):
    pass


def _purge_one(record: JobRecord, owner: str | None, now: float) -> JobRecord:
    if record.status is not JobStatus.IN_QUEUE or (owner is not None and record.owner != owner):
        raise _Skip
    return cancel(record, now=now)


def _conflict_to_409(
    change: Callable[..., JobRecord], record: JobRecord, **kwargs: Any
) -> JobRecord:
    try:
        return change(record, **kwargs)
    except Conflict as exc:
        raise ConflictError(str(exc), param="id") from None


def _not_found(job_id: str) -> JobNotFoundError:
    return JobNotFoundError(
        f"no job with id {job_id!r}: it never existed, or its result expired "
        "(policy.ttl) and was removed",
        param="id",
    )
