"""A worker of the shared queue: takes an endpoint's jobs while it has free capacity, runs each
through a given ``execute`` function, and writes the outcome. No engine here: the runtime passes
``execute`` (its engine calls), ``abort`` and how many more jobs it can run now.

Guarantees (see docs/jobs.md, "Shared queue"):

- **Never more than it can run:** it asks the queue for at most ``free_slots()`` messages, and
  asks again only when a slot frees. Normal jobs first, FIFO; ``lowPriority`` jobs only when no
  normal one is waiting; a batch's requests (the ``batch`` lane) only when neither is, and
  only as many as ``batch_slots()`` allows (the runtime keeps room for interactive requests
  there). Each lane is asked without waiting (a pull with ``no_wait``); only when none has
  anything does the worker wait, for a normal job, a freed slot, or ``poll_seconds``.
- **Nothing accepted is lost:** a job's message is acknowledged only after its final state is
  stored. While a job runs, the worker tells the queue every ``heartbeat_interval`` that it is
  still at work; a worker that stops doing so (SIGKILL, lost network) has its job delivered to
  another worker after the consumer's ``ack_wait`` (the heartbeat timeout). The new attempt
  starts the job again; ``max_attempts`` bound how often (then ``FAILED``, saying so).
- **One outcome per job:** every state change is a compare-and-set on the job's record; an
  attempt that was superseded (cancelled, or taken over after it looked dead) changes nothing.
- **A job stopped before its end bills what it used:** an attempt that times out
  (``policy.executionTimeout``, ``policy.ttl``) ends ``TIMED_OUT`` with the usage its
  ``usage`` function reports; a cancelled one adds its usage to the ``CANCELLED`` record that
  whoever cancelled wrote (once, for its own attempt). The gateway meters both, once per run.
- **Cancel from anywhere:** a cancel published on ``llmep.ep.<ns>.<name>.cancel.<id>`` aborts the
  engine request at once; the heartbeat also checks the record, so a missed message delays
  the abort by at most one heartbeat.
- **Consumers it is given:** with a runtime pod's credential the endpoint's worker consumers
  are the operator's to create; the worker waits for them (and reports progress well within
  the ack wait they were created with).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import nats.errors
from nats.aio.msg import Msg
from nats.js.errors import APIError as JetStreamError

from llmendpoints_common.errors import APIError, error_from_exception
from llmendpoints_common.jobs.models import JobStatus
from llmendpoints_common.jobs.record import (
    Conflict,
    JobRecord,
    JobUsage,
    claim,
    finish,
    gave_up_error,
    out_of_attempts,
    with_usage,
)
from llmendpoints_common.queue import names
from llmendpoints_common.queue.client import ATTEMPT_HEADER, QueueJobService, record_ttl
from llmendpoints_common.queue.pull import PullLane
from llmendpoints_common.queue.state import StaleRevision
from llmendpoints_common.queue.topology import NotCreatedYet, QueueLayout, ensure_endpoint_queue
from llmendpoints_common.waiting import wait_until_set

log = logging.getLogger(__name__)

Publish = Callable[[Any], None]
Execute = Callable[[JobRecord, Publish], Awaitable[Any]]
Abort = Callable[[JobRecord], Awaitable[None]]
# What an attempt used (asked once, after it stopped; the attempt's counts may be forgotten).
AttemptUsage = Callable[[JobRecord], JobUsage | None]


@dataclass(frozen=True)
class WorkerSettings:
    # Attempts per job (a redelivery after a worker vanished is an attempt).
    max_attempts: int = 3
    # How often a running job's worker reports progress (well under the heartbeat timeout).
    heartbeat_interval_seconds: float = 10.0
    # policy.executionTimeout when the job sets none.
    default_execution_timeout_seconds: float = 600.0
    # How long one pull waits for a job before looking at low-priority jobs again.
    poll_seconds: float = 2.0
    # How long a finished attempt's outcome is retried against an unreachable queue.
    outcome_write_patience_seconds: float = 120.0


@dataclass
class _Attempt:
    record: JobRecord
    task: asyncio.Task[Any]
    cancelled: bool = False


_JOB_LANES = ("normal", "low")  # the lanes every worker takes (the batch lane: if it may)
_BATCH_LANE_RETRY_SECONDS = 30.0


class QueueWorker:
    def __init__(
        self,
        service: QueueJobService,
        *,
        name: str,
        execute: Execute,
        abort: Abort,
        free_slots: Callable[[], int],
        batch_slots: Callable[[], int] | None = None,
        usage: AttemptUsage | None = None,
        settings: WorkerSettings | None = None,
        layout: QueueLayout | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.service = service
        self.name = name
        self._execute = execute
        self._abort = abort
        self._free_slots = free_slots
        # How many batch requests this worker may run now (None: none at all).
        self._batch_slots = batch_slots
        self._usage = usage or (lambda record: None)
        self.settings = settings or WorkerSettings()
        self._layout = layout or QueueLayout()
        self._clock = clock
        self._running: dict[str, _Attempt] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._batch_tasks: set[asyncio.Task[None]] = set()
        self._lanes: dict[str, PullLane] = {}
        self._batch_lane_retry_at = 0.0
        self._slot_freed = asyncio.Event()
        self._loop_task: asyncio.Task[None] | None = None
        self._stopping = False
        self._subscriptions: dict[str, Any] = {}
        self._heartbeat_seconds = self.settings.heartbeat_interval_seconds
        self._waiting_logged = False

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def running_batch(self) -> int:
        """Batch requests taken (claimed or running)."""
        return len(self._batch_tasks)

    @property
    def endpoint(self) -> str:
        return self.service.endpoint

    # ---- lifecycle -----------------------------------------------------------------------

    async def start(self) -> None:
        self._loop_task = asyncio.create_task(self._pull_loop(), name=f"queue-worker-{self.name}")

    async def stop(self, timeout: float) -> None:
        """Take no new job; give running ones ``timeout`` s; hand the rest back to the queue
        at once (another worker takes them without waiting for the heartbeat timeout)."""
        self._stopping = True
        self._slot_freed.set()
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._loop_task
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=timeout)
        for task in list(self._tasks):
            task.cancel()  # each hands its job back (nak) and aborts its engine request
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._close_subscriptions()

    async def _close_subscriptions(self) -> None:
        for sub in self._subscriptions.values():
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        self._subscriptions.clear()
        for lane in self._lanes.values():
            await lane.close()
        self._lanes.clear()

    def _may_create(self) -> bool:
        """A password user makes the endpoint's queue; a pod's credential waits for the
        operator to."""
        stream = names.records_stream(self.service.ref)
        return self.service.connection.may(f"$JS.API.STREAM.CREATE.{stream}")

    async def _connect_consumers(self) -> None:
        js = self.service.js
        ref = self.service.ref
        connection = self.service.connection
        ack_wait = await ensure_endpoint_queue(
            js, ref, self._layout, create=self._may_create(), priorities=_JOB_LANES
        )
        # Whoever created the consumers chose their ack wait (the heartbeat timeout); when it is
        # shorter than this worker was configured for, its heartbeat shrinks in proportion, so
        # a live worker is never taken for dead.
        self._heartbeat_seconds = self.settings.heartbeat_interval_seconds * min(
            1.0, ack_wait / self._layout.heartbeat_timeout_seconds
        )
        for priority in _JOB_LANES:
            self._lanes[priority] = await PullLane.open(
                connection.nc, names.queue_stream(ref), names.jobs_consumer(ref, priority)
            )
        await self._open_batch_lane()
        self._subscriptions["cancel"] = await connection.nc.subscribe(
            names.cancel_subject(ref), cb=self._on_cancel_message
        )
        self._waiting_logged = False

    async def _open_batch_lane(self) -> None:
        """The batch lane, when this worker takes batches and its consumer exists. An operator
        older than the batch lane has not created it: the worker takes jobs meanwhile and looks
        again every ``_BATCH_LANE_RETRY_SECONDS``."""
        if self._batch_slots is None or names.BATCH_PRIORITY in self._lanes:
            return
        if time.monotonic() < self._batch_lane_retry_at:
            return
        service = self.service
        try:
            await ensure_endpoint_queue(
                service.js, service.ref, self._layout, create=self._may_create(),
                priorities=(names.BATCH_PRIORITY,),
            )  # fmt: skip
        except NotCreatedYet as exc:
            self._batch_lane_retry_at = time.monotonic() + _BATCH_LANE_RETRY_SECONDS
            log.warning("job queue worker: %s; taking jobs without batches meanwhile", exc)
            return
        self._lanes[names.BATCH_PRIORITY] = await PullLane.open(
            service.connection.nc,
            names.queue_stream(service.ref),
            names.jobs_consumer(service.ref, names.BATCH_PRIORITY),
        )

    # ---- taking jobs ---------------------------------------------------------------------

    async def _pull_loop(self) -> None:
        while not self._stopping:
            try:
                if not self._lanes:
                    await self._connect_consumers()
                await self._open_batch_lane()
                # Jobs taken but still being claimed count too: never more than it can run.
                free = self._free_slots() - len(self._tasks)
                if free <= 0:
                    self._slot_freed.clear()
                    # The limit can also grow (the engine's batch size becomes known).
                    await wait_until_set(self._slot_freed, 1.0)
                    continue
                if not self.service.connection.connected:
                    await asyncio.sleep(0.5)
                    continue
                self._slot_freed.clear()
                # A lane at a time, highest first, each asked without waiting.
                messages = await self._lanes["normal"].take(1)
                if not messages:
                    messages = await self._lanes["low"].take(1)
                batch = False
                if not messages and (room := min(free, self._batch_room())) > 0:
                    messages = await self._lanes[names.BATCH_PRIORITY].take(room)
                    batch = True
                if not messages:
                    # Nothing to take now: wait for a normal job, a freed slot (a batch
                    # request may fit again) or the poll interval.
                    messages = await self._lanes["normal"].wait(
                        self.settings.poll_seconds, self._slot_freed
                    )
                    batch = False
                for message in messages:
                    self._spawn(message, batch=batch)
            except asyncio.CancelledError:
                raise
            except NotCreatedYet as exc:
                if not self._waiting_logged:
                    log.warning("job queue worker: %s; waiting for it", exc)
                    self._waiting_logged = True
                await asyncio.sleep(1.0)
            except Exception as exc:  # the queue is unreachable: keep serving, try again
                log.warning("job queue worker: %s: %s; retrying in 1 s", type(exc).__name__, exc)
                await self._close_subscriptions()
                await asyncio.sleep(1.0)

    def _batch_room(self) -> int:
        if self._batch_slots is None or names.BATCH_PRIORITY not in self._lanes:
            return 0
        return self._batch_slots() - len(self._batch_tasks)

    def _spawn(self, message: Msg, *, batch: bool = False) -> None:
        task = asyncio.create_task(self._take(message))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        if batch:
            self._batch_tasks.add(task)
            task.add_done_callback(self._batch_tasks.discard)

    # ---- one job -------------------------------------------------------------------------

    async def _take(self, message: Msg) -> None:
        job_id = message.data.decode()
        try:
            await self._take_job(message, job_id)
        except asyncio.CancelledError:
            # Shutting down mid-job: hand it back now rather than after the heartbeat timeout.
            with contextlib.suppress(Exception):
                await message.nak()
            raise
        except Exception:
            # Unexpected: leave the message unacknowledged; it is delivered again.
            log.exception("job %s: worker failed; the queue delivers it again", job_id)
        finally:
            self._slot_freed.set()

    async def _take_job(self, message: Msg, job_id: str) -> None:
        states = self.service.states
        current = await states.read(job_id)
        if current is None or current[0].status.is_final:
            await message.ack()  # cancelled, purged or expired while queued
            return
        record, revision = current
        if record.status is JobStatus.IN_PROGRESS and out_of_attempts(
            record, self.settings.max_attempts
        ):
            await self._give_up(message, record)
            return
        now = self._clock()
        claimed = claim(record, now=now, worker=self.name)
        try:
            revision = await states.write(claimed, revision=revision)
        except StaleRevision:  # changed since read (cancelled, stream read): decide again
            try:
                result = await states.update(job_id, lambda r: claim(r, now=now, worker=self.name))
            except Conflict:
                await message.ack()  # ended meanwhile
                return
            if result is None:
                await message.ack()
                return
            claimed, revision = result[1], None
        await self._run_attempt(message, claimed, revision)

    async def _give_up(self, message: Msg, record: JobRecord) -> None:
        now = self._clock()
        error = gave_up_error(record, self.settings.max_attempts)
        with contextlib.suppress(Conflict):
            result = await self.service.states.update(
                record.id,
                lambda r: finish(r, JobStatus.FAILED, now=now, error=error),
                ttl=lambda r: record_ttl(r, now),
            )
            if result is not None:
                self.service.ended(result[1])
        await message.ack()

    async def _run_attempt(self, message: Msg, record: JobRecord, revision: int | None) -> None:
        timeout_ms = record.execution_timeout_ms
        budget = (
            timeout_ms / 1000
            if timeout_ms is not None
            else self.settings.default_execution_timeout_seconds
        )
        now = self._clock()
        # executionTimeout bounds the job's whole execution, not one attempt: an attempt that
        # takes over from a dead worker gets what is left. policy.ttl bounds the job's whole
        # life: it never runs past it.
        started = record.started_at if record.started_at is not None else now
        remaining = max(0.0, started + budget - now)
        life = None if record.ttl_seconds is None else record.submitted_at + record.ttl_seconds
        cut_by_ttl = life is not None and life - now < remaining
        if cut_by_ttl:
            remaining = max(0.0, life - now)
        # Chunks live as long as their job can: its execution, then its retention.
        chunk_ttl = remaining + record.retention_seconds
        if life is not None:
            chunk_ttl = min(chunk_ttl, max(1.0, life - now))
        publisher = _ChunkPublisher(self.service, record, ttl=chunk_ttl)
        task = asyncio.create_task(self._execute(record, publisher.publish))
        attempt = _Attempt(record, task)
        self._running[record.id] = attempt
        heartbeat = asyncio.create_task(self._heartbeat(message, attempt))
        used: JobUsage | None = None
        try:
            done, _ = await asyncio.wait({task}, timeout=remaining)
            if not done:
                await self._stop_attempt(attempt)
                used = self._usage(record)
                status, output, error = (
                    JobStatus.TIMED_OUT,
                    None,
                    _timeout_error(record, budget, cut_by_ttl),
                )
            elif attempt.cancelled or task.cancelled():
                used = self._usage(record)
                await message.ack()  # whoever cancelled wrote CANCELLED
                if used is not None:
                    await self._add_usage(record, used)
                return
            elif (exc := task.exception()) is not None:
                if not isinstance(exc, APIError):
                    log.error("job %s failed", record.id, exc_info=exc)
                status, output, error = JobStatus.FAILED, None, error_from_exception(exc)
            else:
                status, output, error = JobStatus.COMPLETED, task.result(), None
            await publisher.flush()  # every chunk is stored before the job says it ended
            await self._write_outcome(message, record, revision, status, output, error, used)
        finally:
            heartbeat.cancel()
            if not task.done():
                await self._stop_attempt(attempt)
            if used is None:
                self._usage(record)  # asked once per attempt, whatever the outcome
            await publisher.close()
            if self._running.get(record.id) is attempt:
                del self._running[record.id]

    async def _write_outcome(
        self,
        message: Msg,
        record: JobRecord,
        revision: int | None,
        status: JobStatus,
        output: Any,
        error: dict[str, Any] | None,
        usage: JobUsage | None = None,
    ) -> None:
        deadline = time.monotonic() + self.settings.outcome_write_patience_seconds

        def end(current: JobRecord, now: float) -> JobRecord:
            return finish(
                current,
                status,
                now=now,
                attempt=record.attempt,
                output=output,
                error=error,
                usage=usage,
            )

        if revision is not None:
            # Usually nobody wrote since the claim: one compare-and-set, no read.
            now = self._clock()
            ended = end(record, now)
            with contextlib.suppress(StaleRevision, nats.errors.Error, OSError):
                await self.service.states.write(
                    ended, revision=revision, ttl_seconds=record_ttl(ended, now)
                )
                self.service.ended(ended)
                await message.ack()
                return
        while True:
            now = self._clock()
            try:
                result = await self.service.states.update(
                    record.id,
                    lambda r, now=now: end(r, now),
                    ttl=lambda r, now=now: record_ttl(r, now),
                )
                break
            except Conflict:
                current = await self.service.states.read(record.id)
                if current is not None and current[0].attempt != record.attempt:
                    # Another worker took the job over: its delivery owns the message.
                    return
                await message.ack()  # cancelled meanwhile
                return
            except (nats.errors.Error, OSError) as exc:
                if _storage_full(exc) and status is not JobStatus.FAILED:
                    # Its output does not fit in what is left of its endpoint's queue: the job
                    # ends FAILED saying so, rather than running again to the same end.
                    status, output, error = JobStatus.FAILED, None, _queue_full_error()
                    continue
                if time.monotonic() > deadline:
                    log.error(
                        "job %s: outcome not stored (%s); it runs again elsewhere", record.id, exc
                    )
                    return
                await asyncio.sleep(1.0)
        if result is not None:
            self.service.ended(result[1])
        await message.ack()

    async def _add_usage(self, record: JobRecord, usage: JobUsage) -> None:
        """Put what the cancelled attempt used on its CANCELLED record (whoever cancelled did
        not know it). A record that is gone, another attempt's, or already carrying usage is
        left alone; an unreachable queue loses this attempt's bill (logged), not the job."""
        now = self._clock()
        try:
            await self.service.states.update(
                record.id,
                lambda r: with_usage(r, usage, attempt=record.attempt),
                ttl=lambda r: record_ttl(r, now),
            )
        except Conflict:
            pass
        except (nats.errors.Error, OSError) as exc:
            log.warning("job %s: the cancelled attempt's usage was not stored (%s)", record.id, exc)

    async def _heartbeat(self, message: Msg, attempt: _Attempt) -> None:
        while True:
            await asyncio.sleep(self._heartbeat_seconds)
            with contextlib.suppress(Exception):
                await message.in_progress()
            with contextlib.suppress(Exception):
                current = await self.service.states.read(attempt.record.id)
                if current is not None and (
                    current[0].status.is_final or current[0].attempt != attempt.record.attempt
                ):
                    await self._cancel_attempt(attempt)
                    return

    async def _on_cancel_message(self, message: Msg) -> None:
        job_id = message.subject.rsplit(".", 1)[-1]
        if (attempt := self._running.get(job_id)) is not None:
            await self._cancel_attempt(attempt)

    async def _cancel_attempt(self, attempt: _Attempt) -> None:
        attempt.cancelled = True
        await self._stop_attempt(attempt)

    async def _stop_attempt(self, attempt: _Attempt) -> None:
        """Abort the engine request first (it stops at once), then the task."""
        try:
            await self._abort(attempt.record)
        except Exception:
            log.exception("aborting job %s failed", attempt.record.id)
        attempt.task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await attempt.task


def _storage_full(exc: BaseException) -> bool:
    """JetStream refused a write: the endpoint's records stream is at its bound."""
    return isinstance(exc, JetStreamError) and "maximum bytes" in (exc.description or "")


def _queue_full_error() -> dict[str, Any]:
    return {
        "message": "the job's output did not fit in its endpoint's queue (its records, results "
        "and stream output take all the storage it is given, "
        "LLMEP_OPERATOR_JOBS_QUEUE_ENDPOINT_MAX_BYTES); retry when results have expired or "
        "been read",
        "type": "ServiceUnavailableError",
        "code": "queue_full",
    }


def _timeout_error(record: JobRecord, budget: float, cut_by_ttl: bool) -> dict[str, Any]:
    if cut_by_ttl:
        ttl_ms = round((record.ttl_seconds or 0) * 1000)
        message = (
            f"the job reached the end of its policy.ttl ({ttl_ms} ms from submission) while it "
            "ran and was aborted"
        )
        param = "policy.ttl"
    else:
        message = (
            f"the job ran longer than policy.executionTimeout ({round(budget * 1000)} ms) and "
            "was aborted"
        )
        param = "policy.executionTimeout"
    return {"message": message, "type": "TimeoutError", "param": param, "code": 408}


class _ChunkPublisher:
    """Stores a job's stream chunks in order, one at a time, tagged with the attempt."""

    def __init__(self, service: QueueJobService, record: JobRecord, *, ttl: float) -> None:
        self._js = service.js
        self._ref = service.ref
        self._record = record
        self._queue: asyncio.Queue[bytes | None] = asyncio.Queue()
        self._count = 0
        self._full = False
        self._task = asyncio.create_task(self._drain())
        self._ttl = max(1, round(ttl))

    def publish(self, chunk: Any) -> None:
        self._queue.put_nowait(json.dumps(chunk).encode())

    async def _drain(self) -> None:
        while (data := await self._queue.get()) is not None:
            self._count += 1
            headers = {
                ATTEMPT_HEADER: str(self._record.attempt),
                "Nats-Msg-Id": f"{self._record.id}.{self._record.attempt}.{self._count}",
            }
            subject = names.chunk_subject(
                self._ref, self._record.id, self._record.attempt, self._count
            )
            while not self._full:
                try:
                    await self._js.publish(subject, data, headers=headers, msg_ttl=self._ttl)
                    break
                except JetStreamError as exc:
                    if not _storage_full(exc):
                        log.warning("job %s: chunk not stored yet (%s)", self._record.id, exc)
                        await asyncio.sleep(0.5)
                        continue
                    # The endpoint's queue is full: the rest of this attempt's stream output
                    # is not kept (its result still is, if it fits); retrying would never end.
                    log.warning(
                        "job %s: its endpoint's queue is full; stream output not kept",
                        self._record.id,
                    )
                    self._full = True
                except (nats.errors.Error, OSError) as exc:
                    log.warning("job %s: chunk not stored yet (%s)", self._record.id, exc)
                    await asyncio.sleep(0.5)

    async def flush(self) -> None:
        self._queue.put_nowait(None)
        await self._task

    async def close(self) -> None:
        if not self._task.done():
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
