"""Usage on the shared queue: what each answer and each job cost, per key, endpoint and model.

- ``Metering.finish``: when a request ends -- answered, refused, abandoned -- its metrics, its
  limiter ticket (the lease released, the tokens charged) and its usage record;
- ``UsagePublisher``: records go to the stream ``LLMEP_USAGE`` in the background (the request
  path only appends to a bounded buffer), de-duplicated by the record's id;
- ``JobUsageMeter``: a job's tokens when it ends (completed, timed out, cancelled while it
  ran), whoever ran it, billed only as its admission allows (jobs/admission.py);
- ``read_usage``: the records back, for ``llmendpoints-gateway usage``.

What is metered and how is metering.py's (pure).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections import deque
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from llmendpoints_common.identity import EndpointRef
from llmendpoints_common.jobs.admission import JobAdmission, Verdict, judge
from llmendpoints_common.jobs.record import JobRecord
from llmendpoints_common.queue import admissions, names
from llmendpoints_common.queue.connect import connect
from llmendpoints_common.queue.natsjwt import Permissions
from llmendpoints_common.queue.pull import PullLane
from llmendpoints_common.queue.topology import (
    QueueLayout,
    ensure_streams,
    ensure_usage_consumer,
)
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from llmendpoints_gateway.keys import KeyRing
from llmendpoints_gateway.limiter import Limiter
from llmendpoints_gateway.metering import (
    JOB_USAGE_STATUS,
    Usage,
    UsageRecord,
    job_usage_id,
    usage_of_job,
)
from llmendpoints_gateway.metrics import GatewayMetrics
from llmendpoints_gateway.queue import SharedQueue
from llmendpoints_gateway.registry import Registry
from llmendpoints_gateway.request import RequestLog

logger = logging.getLogger("llmendpoints.gateway.usage")


class Metering:
    """What a request or a job cost: counted in metrics, charged to the key's limits, recorded
    for chargeback (with a shared queue)."""

    def __init__(
        self,
        gateway_id: str,
        metrics: GatewayMetrics,
        limiter: Limiter,
        keys: KeyRing,
        registry: Registry,
        publisher: UsagePublisher | None = None,
    ) -> None:
        self.gateway_id = gateway_id
        self.metrics = metrics
        self.limiter = limiter
        self.keys = keys
        self.registry = registry
        self.publisher = publisher

    def finish(self, state: RequestLog) -> None:
        """Count the answer (metrics, usage record) and end its limiter ticket."""
        if state.endpoint is None:
            return
        key = state.key_name or ""
        usage = state.usage or (state.meter.usage if state.meter is not None else None) or Usage()
        self.metrics.answered(state.endpoint, state.status, key)
        self._count_tokens(key, state.endpoint, usage)
        self.limiter.finish(state.ticket, usage.total)
        counted = not getattr(state.meter, "estimated", True)  # by the engine, not estimated
        if state.prompt_chars and usage.prompt_tokens and counted:
            # Learn the endpoint's characters per token (prefix-aware routing sizes its index).
            self.registry.observe_prompt(state.endpoint, state.prompt_chars, usage.prompt_tokens)
        if self.publisher is not None and state.record_kind is not None:
            self.publisher.record(
                UsageRecord(
                    # Unique per answer (a client may reuse an x-request-id); a job's is its id,
                    # so a job seen finished through two replicas is stored once.
                    id=state.record_id or f"{state.request_id}.{uuid.uuid4().hex[:16]}",
                    time=time.time(),
                    key=key,
                    endpoint=state.endpoint,
                    model=state.model or "",
                    status=state.status,
                    prompt_tokens=usage.prompt_tokens,
                    completion_tokens=usage.completion_tokens,
                    gateway=self.gateway_id,
                    kind=state.record_kind,
                    requests=state.record_requests,
                )
            )

    def job_unbilled(self, endpoint: str, reason: str) -> None:
        """JobUsageMeter's: a finished record it refused to bill."""
        self.metrics.jobs_unbilled.labels(endpoint).inc()

    def _count_tokens(self, key: str, endpoint: str, usage: Usage) -> None:
        self.metrics.tokens_used(endpoint, "prompt", usage.prompt_tokens, key)
        self.metrics.tokens_used(endpoint, "completion", usage.completion_tokens, key)

    def job_usage(
        self, record: JobRecord, verdict: Verdict, usage: Usage, written_at: float
    ) -> tuple[UsageRecord, Callable[[], None]]:
        """JobUsageMeter's callback: a finished job's usage record (one per run), billed to
        whom its admission says (``verdict``) at the time the queue stored its end
        (``written_at``: the server's clock, not the record's), and what to count once the
        usage stream stored it for the first time."""
        ep = self.registry.by_id(record.endpoint)  # a job record names "<namespace>/<name>"
        batch = verdict.batch  # a batch's request: metered apart, not rate-limited
        key_name = verdict.key or ""
        entry = UsageRecord(
            id=job_usage_id(record.id, record.runs),
            time=written_at,
            key=key_name,
            endpoint=record.endpoint,
            model=ep.models[0] if ep is not None and ep.models else "",
            status=JOB_USAGE_STATUS.get(record.status, 200),
            prompt_tokens=usage.prompt_tokens,
            completion_tokens=usage.completion_tokens,
            gateway=self.gateway_id,
            kind="batch" if batch else "job",
            # A job was counted when it was accepted; a batch's request is counted here.
            requests=1 if batch else 0,
        )

        def count() -> None:
            self._count_tokens(key_name, record.endpoint, usage)
            # Only a key the gateway admitted the job for is charged: a job accepted at a pod
            # is billed to the endpoint's own name, which no gateway key has.
            key = self.keys.by_name(key_name) if verdict.gateway_key else None
            if key is not None and not batch:
                # tokensPerMinute bounds interactive use; a batch is bounded by its key's
                # enqueued tokens (LLMEP_BATCH_MAX_ENQUEUED_TOKENS) instead.
                self.limiter.charge(key, usage.total)

        return entry, count


class UsagePublisher:
    """Publishes usage records to ``LLMEP_USAGE`` in the background: the request path only
    appends to a bounded buffer. While NATS is unreachable records wait (up to
    ``buffer_limit``, then the oldest are dropped with a warning) and go out once it is back."""

    def __init__(self, queue: SharedQueue, buffer_limit: int = 100_000):
        self.queue = queue
        self._buffer: deque[UsageRecord] = deque()
        self._limit = buffer_limit
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.dropped = 0
        self.published = 0

    def record(self, record: UsageRecord) -> None:
        if len(self._buffer) >= self._limit:
            self._buffer.popleft()
            self.dropped += 1
            if self.dropped in (1, 1000) or self.dropped % 100_000 == 0:
                logger.warning("usage buffer full: %d record(s) dropped", self.dropped)
        self._buffer.append(record)
        self._wake.set()

    @property
    def pending(self) -> int:
        return len(self._buffer)

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self, timeout: float = 3.0) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self._buffer and self.queue.connected and loop.time() < deadline:
            self._wake.set()
            await asyncio.sleep(0.05)
        if self._buffer:
            logger.warning("%d usage record(s) not published at shutdown", len(self._buffer))
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        js = (await self.queue.wait()).js
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._buffer:
                batch = [self._buffer[i] for i in range(min(256, len(self._buffer)))]
                acks = await asyncio.gather(
                    *(
                        js.publish(
                            names.usage_subject(r.endpoint, r.key),
                            r.encode(),
                            headers={"Nats-Msg-Id": r.id},
                        )
                        for r in batch
                    ),
                    return_exceptions=True,
                )
                done = 0
                for ack in acks:
                    if isinstance(ack, BaseException):
                        break
                    done += 1
                for _ in range(done):
                    self._buffer.popleft()
                self.published += done
                if done < len(batch):
                    failed = next(a for a in acks if isinstance(a, BaseException))
                    logger.warning("publishing usage records failed (%s); retrying", failed)
                    await asyncio.sleep(1.0)


# How often the meter looks for endpoints' records streams (a new endpoint's first jobs wait
# in its usage consumer meanwhile: nothing is missed).
DISCOVER_SECONDS = 5.0
# Records one pull may bring (and, in bytes, one message of the server's max_payload at most).
PULL_BATCH = 16
_PULL_WAIT_SECONDS = 5.0
OnUsage = Callable[[JobRecord, Verdict, Usage, float], tuple[UsageRecord, Callable[[], None]]]


class JobUsageMeter:
    """Meters the tokens of jobs when they end, whoever ran them and however the client learns
    the result (``/runsync``, ``/status``, a webhook, never) -- on the word of whoever admitted
    them, never on a pod's.

    Each endpoint's records stream has the durable consumer ``llmep-gateway-usage`` (made by the
    operator with the stream; checked here, and repaired with a warning when someone changed
    it); every gateway replica pulls from it, so each record write is handled by one replica.
    What a finished record is billed is ``metering.usage_of_job`` -- a COMPLETED job's output
    usage, a TIMED_OUT or CANCELLED job's ``usage`` (what its worker stopped at; a job cancelled
    while queued has none and is billed nothing) -- and only when ``admission.judge`` agrees:
    the record is stored where it says, its owner is its admission's, its run was admitted and
    not billed yet, its tokens within the admitted bound. Then it becomes the usage record
    ``job_usage_id(id, run)``, the run is marked billed in the admission, and a record the
    usage stream stored for the first time is counted in ``tokens_total`` and charged to the
    owner's tokensPerMinute (a gateway key's; a job admitted at a pod bills the endpoint's own
    name). A record that disagrees is logged, counted in ``refused``, and billed to nobody."""

    def __init__(
        self,
        queue: SharedQueue,
        on_usage: OnUsage,
        on_refused: Callable[[str, str], None] | None = None,
    ) -> None:
        self.queue = queue
        self.on_usage = on_usage
        self.on_refused = on_refused
        self._task: asyncio.Task | None = None
        self._streams: dict[str, asyncio.Task] = {}
        self.counted = 0
        self.refused = 0
        self._logged: dict[str, int] = {}

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        tasks = [t for t in (self._task, *self._streams.values()) if t is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._streams.clear()

    async def _run(self) -> None:
        connection = await self.queue.wait()
        while True:
            try:
                found = set(await records_streams(connection.nc))
                for stream in list(self._streams):
                    if stream not in found:  # the endpoint was deleted
                        self._streams.pop(stream).cancel()
                for stream in found:
                    task = self._streams.get(stream)
                    if task is None or task.done():
                        self._streams[stream] = asyncio.create_task(self._meter(stream))
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                logger.warning("metering job usage: %s; retrying", exc)
            await asyncio.sleep(DISCOVER_SECONDS)

    async def _meter(self, stream: str) -> None:
        connection = await self.queue.wait()
        js, nc = connection.js, connection.nc
        ref = names.endpoint_of_stream(stream)
        try:
            repaired = await ensure_usage_consumer(js, ref)
            if repaired:
                logger.warning("the usage meter's consumer of %s was %s", ref.id, repaired)
            # One pull brings at most one message of the server's largest size beyond a batch.
            lane = await PullLane.open(
                nc, stream, names.USAGE_CONSUMER, max_bytes=nc.max_payload + 65_536
            )
        except Exception as exc:
            logger.warning("metering job usage of %s: %s; retrying", ref.id, exc)
            return
        never = asyncio.Event()
        try:
            while True:
                messages = await lane.take(PULL_BATCH)
                if not messages:
                    messages = await lane.wait(_PULL_WAIT_SECONDS, never)
                for message in messages:
                    await self._handle(js, ref, message)
                    await message.ack()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            logger.warning("metering job usage of %s: %s; retrying", ref.id, exc)
        finally:
            await lane.close()

    async def _handle(self, js: Any, ref: EndpointRef, message: Any) -> None:
        job_id = names.job_of_record_subject(ref, message.subject)
        if job_id is None or not message.data:
            return
        try:
            record = JobRecord.decode(message.data)
        except ValueError:
            self._refuse(ref, job_id, "not a job record")
            return
        written_at = message.metadata.timestamp.timestamp()
        for run in ended_runs(record):
            await self._bill(js, ref, job_id, run, written_at)

    async def _bill(
        self, js: Any, ref: EndpointRef, job_id: str, record: JobRecord, written_at: float
    ) -> None:
        usage = usage_of_job(record, written_at)
        if usage is None:
            return
        found = await admissions.read(js, ref, job_id)
        admitted = found[0] if found is not None else None
        verdict = judge(
            record,
            stored_endpoint=ref.id,
            stored_id=job_id,
            admission=admitted,
            prompt_tokens=usage.prompt_tokens,
            completion_tokens=usage.completion_tokens,
        )
        if not verdict.billable or admitted is None:
            if verdict.reason is not None:
                self._refuse(ref, job_id, verdict.reason)
            return
        entry, count = self.on_usage(record, verdict, usage, written_at)
        ack = await js.publish(
            names.usage_subject(entry.endpoint, entry.key),
            entry.encode(),
            headers={"Nats-Msg-Id": entry.id},
        )
        await self._mark_billed(js, ref, admitted, record.runs)
        if not ack.duplicate:
            self.counted += 1
            count()

    @staticmethod
    async def _mark_billed(js: Any, ref: EndpointRef, admitted: JobAdmission, run: int) -> None:
        """The run is billed: a later write of the same end bills nothing (whatever its time)."""

        def billed(current: JobAdmission) -> JobAdmission | None:
            if current.billed_runs >= run:
                return None
            return current.model_copy(update={"billed_runs": run})

        await admissions.update(js, ref, admitted.id, admitted.by, billed)

    def _refuse(self, ref: EndpointRef, job_id: str, reason: str) -> None:
        """Not billed: logged (the first ten of an endpoint, then every thousandth: a pod
        writing forged records must not flood the log) and counted."""
        self.refused += 1
        seen = self._logged[ref.id] = self._logged.get(ref.id, 0) + 1
        if seen <= 10 or seen % 1000 == 0:
            logger.warning(
                "job %s of endpoint %s is not billed: %s (%d such record(s) of this endpoint)",
                job_id,
                ref.id,
                reason,
                seen,
            )
        if self.on_refused is not None:
            self.on_refused(ref.id, reason)


def ended_runs(record: JobRecord) -> list[JobRecord]:
    """The billable ends a record shows: the run a /retry replaced (its end may never have been
    read: a later write removes it), then the record itself."""
    runs = []
    if (ended := record.ended_run) is not None and ended.run < record.runs:
        runs.append(
            record.model_copy(
                update={
                    "runs": ended.run,
                    "status": ended.status,
                    "usage": ended.usage,
                    "output": None,
                    "finished_at": None,
                }
            )
        )
    runs.append(record)
    return runs


async def records_streams(nc: Any) -> list[str]:
    """Every endpoint's records stream (the stream names JetStream lists for their subjects)."""
    found: list[str] = []
    offset = 0
    while True:
        request = {"subject": "llmep.ep.*.*.rec.*", "offset": offset}
        reply = await nc.request("$JS.API.STREAM.NAMES", json.dumps(request).encode(), timeout=5)
        answer = json.loads(reply.data)
        if "error" in answer:
            raise RuntimeError(f"listing streams: {answer['error'].get('description')}")
        page = answer.get("streams") or []
        found.extend(s for s in page if s.startswith(names.RECORDS_STREAM_PREFIX))
        offset += len(page)
        if not page or offset >= int(answer.get("total", 0)):
            return found


CONNECT_TIMEOUT_SECONDS = 10.0


async def read_usage(
    url: str, since: float, until: float | None, creds_file: str | None = None
) -> list[UsageRecord]:
    """Every record of ``LLMEP_USAGE`` that ended in [since, until): read from the first
    message stored at ``since`` (the stream's own time index) up to its last message now."""
    nc, permissions = await _connect_once(url, creds_file)
    try:
        js = nc.jetstream(timeout=10)
        if permissions is None or permissions.may_publish(
            f"$JS.API.STREAM.CREATE.{names.USAGE_STREAM}"
        ):
            await ensure_streams(js, QueueLayout())
        info = await js.stream_info(names.USAGE_STREAM)
        if info.state.messages == 0:
            return []
        return await _records_between(js, since, until, info.state.last_seq)
    finally:
        await nc.close()


async def _connect_once(url: str, creds_file: str | None) -> tuple[NATS, Permissions | None]:
    """Bounded, unlike the servers' reconnect-forever (nats-py keeps retrying a first connect
    whatever its options say): a CLI says it cannot reach the queue."""

    async def quiet(exc: Exception) -> None:
        pass

    try:
        return await asyncio.wait_for(
            connect(
                url,
                name="llmendpoints-gateway-usage",
                creds_file=creds_file,
                connect_timeout=5,
                reconnect=False,
                error_cb=quiet,
            ),
            CONNECT_TIMEOUT_SECONDS,
        )
    except TimeoutError:
        raise ConnectionError(
            f"no NATS server answered within {CONNECT_TIMEOUT_SECONDS:.0f} s"
        ) from None


async def _records_between(
    js: JetStreamContext, since: float, until: float | None, last: int
) -> list[UsageRecord]:
    """The records that ended in [since, until), up to stream sequence ``last``."""
    # Records may be stored a moment after they ended: start a minute early, filter exactly.
    start = datetime.fromtimestamp(max(0.0, since - 60.0), tz=UTC)
    sub = await js.pull_subscribe(
        "llmep.usage.>",
        stream=names.USAGE_STREAM,
        config=ConsumerConfig(
            deliver_policy=DeliverPolicy.BY_START_TIME,
            ack_policy=AckPolicy.NONE,
            opt_start_time=start.isoformat().replace("+00:00", "Z"),
            inactive_threshold=60.0,
            mem_storage=True,
        ),
    )
    records: list[UsageRecord] = []
    try:
        while True:
            try:
                messages = await sub.fetch(1000, timeout=1.0)
            except TimeoutError:
                break
            seq = 0
            for msg in messages:
                seq = msg.metadata.sequence.stream
                record = UsageRecord.decode(msg.data)
                if (
                    record is not None
                    and record.time >= since
                    and (until is None or record.time < until)
                ):
                    records.append(record)
            if seq >= last:
                break
    finally:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()
    return records
