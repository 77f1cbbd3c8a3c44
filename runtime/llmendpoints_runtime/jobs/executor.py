"""The job lifecycle: queue, run at most MAX_CONCURRENCY at once, time out, cancel, retry.

``IN_QUEUE -> IN_PROGRESS -> COMPLETED | FAILED | CANCELLED | TIMED_OUT``. Jobs wait in the
queue while the engine is still starting (that is the request holding a scale-from-zero needs);
their ``delayTime`` includes that wait, ``executionTime`` does not. Every way a job can end
goes through ``_finish``, which records the final state, keeps the result for its retention
(30 min after /run, 1 min after /runsync, never past ``policy.ttl``), drops the input of a job
that cannot be retried, and fires the webhook.

Jobs are admitted by sequences, as OpenAI requests are (``admission.py``): at most
MAX_CONCURRENCY sequences of jobs run at once, a job with ``n: 4`` counting 4. ``policy.ttl``
bounds a job's whole life: a job still queued at its end is not started (``TIMED_OUT``), a
running one is aborted then.

This is the in-pod store (no ``JOBS_QUEUE_URL``). It implements the same verbs as the shared
queue (``llmendpoints_common.jobs.service.JobService``), owner checks and Idempotency-Key
included, so the routes do not know which one they talk to. ``produce`` -- one attempt's engine
work -- is shared with the queue worker (``jobs/queue_worker.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from llmendpoints_common.errors import (
    APIError,
    ConflictError,
    RateLimitError,
    RequestTimeoutError,
    ServiceUnavailableError,
    error_from_exception,
)
from llmendpoints_common.jobs.models import job_sequences
from llmendpoints_common.jobs.service import status_body
from llmendpoints_common.waiting import wait_until_set
from llmendpoints_common.webhooks import WebhookSender

from llmendpoints_runtime.admission import Admission, AdmissionQueue
from llmendpoints_runtime.jobs import work
from llmendpoints_runtime.jobs.batching import resolve_schedule
from llmendpoints_runtime.jobs.errors import JobNotFound
from llmendpoints_runtime.jobs.models import RETRYABLE_STATUSES, JobRequest, JobStatus
from llmendpoints_runtime.jobs.port import JobEngine
from llmendpoints_runtime.jobs.settings import JobSettings
from llmendpoints_runtime.jobs.store import InMemoryJobStore, Job, JobStore
from llmendpoints_runtime.jobs.tally import UsageTally

log = logging.getLogger(__name__)


@dataclass
class _Running:
    task: asyncio.Task[Any]
    request_id: str
    sequences: int = 1
    tally: UsageTally = field(default_factory=UsageTally)


class JobExecutor:
    def __init__(
        self,
        engine: JobEngine,
        settings: JobSettings,
        *,
        store: JobStore | None = None,
        webhooks: WebhookSender | None = None,
        clock: Callable[[], float] = time.time,
        concurrency_limit: Callable[[], int] | None = None,
        on_finish: Callable[[Job], None] | None = None,
        gate: Admission | None = None,
        others_queued: Callable[[], int] = lambda: 0,
        id_suffix: str = "",
    ) -> None:
        """``gate``: where running jobs take their slots (default: a pool of their own of
        ``concurrency_limit``); ``others_queued``: jobs queued by the pod's other API
        processes, which count against MAX_QUEUE_LENGTH too; ``id_suffix`` ends every job id
        (which process holds the job, in such a pod)."""
        self._engine = engine
        self._settings = settings
        self._concurrency_limit = concurrency_limit or (lambda: settings.max_concurrency)
        self._on_finish = on_finish  # e.g. a metrics counter by final status
        self._clock = clock
        self.store: JobStore = store or InMemoryJobStore(
            settings.max_stored_jobs, clock, max_bytes=settings.max_stored_job_bytes
        )
        self._webhooks = webhooks or WebhookSender(
            retries=settings.webhook_retries,
            delay_seconds=settings.webhook_retry_delay_seconds,
            timeout_seconds=settings.webhook_timeout_seconds,
            max_concurrency=settings.webhook_max_concurrency,
        )
        self._queue: asyncio.Queue[str] = asyncio.Queue()
        self._workers: list[asyncio.Task[None]] = []
        self._running: dict[str, _Running] = {}
        self._done: dict[str, asyncio.Event] = {}
        self._queued = 0
        self._queued_low_priority = 0
        # Sequences of the queued jobs (all, and low-priority ones), for the scaling signals.
        self._queued_sequences = 0
        self._queued_low_priority_sequences = 0
        # Running jobs' sequences are admitted here (the limit follows concurrency_limit).
        self._gate: Admission = gate or AdmissionQueue(
            max(1, self._concurrency_limit()), max_waiting=1 << 62
        )
        self._others_queued = others_queued
        self._id_suffix = id_suffix
        self._retried = 0
        self._draining = False
        # (owner, Idempotency-Key) -> (job id, until when it answers for that key)
        self._idempotent: dict[tuple[str, str], tuple[str, float]] = {}

    # ---- observability -------------------------------------------------------------------

    @property
    def queued(self) -> int:
        """Jobs accepted but not started (part of llmendpoints_queue_depth)."""
        return self._queued

    @property
    def queued_for_scaling(self) -> int:
        """Sequences of queued jobs that should make the autoscaler add replicas: all but those
        sent with ``policy.lowPriority`` (RunPod's meaning: "does not trigger worker
        scaling"). Part of llmendpoints_queue_depth."""
        return self._queued_sequences - self._queued_low_priority_sequences

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def running_sequences(self) -> int:
        """Sequences of the running jobs (part of llmendpoints_requests_in_flight)."""
        return sum(r.sequences for r in self._running.values())

    @property
    def retried(self) -> int:
        return self._retried

    async def health(self) -> dict[str, Any]:
        """RunPod's ``/health`` shape, plus the engine's own view."""
        counts: Counter[JobStatus] = await self.store.counts()
        load = self._engine.load()
        ready = self._engine.is_ready()
        busy = self.running > 0 or load.running > 0 or load.waiting > 0
        return {
            "jobs": {
                "completed": counts[JobStatus.COMPLETED],
                "failed": counts[JobStatus.FAILED],
                "inProgress": counts[JobStatus.IN_PROGRESS],
                "inQueue": counts[JobStatus.IN_QUEUE],
                "retried": self._retried,
                "cancelled": counts[JobStatus.CANCELLED],
                "timedOut": counts[JobStatus.TIMED_OUT],
            },
            "workers": {
                "idle": int(ready and not busy),
                "running": int(ready and busy),
                "initializing": int(not ready),
                "ready": int(ready),
                "throttled": 0,
                "unhealthy": 0,
            },
            "engine": {
                "state": "initializing" if not ready else ("busy" if busy else "idle"),
                "running": load.running,
                "waiting": load.waiting,
            },
        }

    # ---- lifecycle of the executor -------------------------------------------------------

    def start(self) -> None:
        """Run up to the concurrency limit's worth of workers (needs a running event loop).

        The limit is read again on every submission: with MAX_CONCURRENCY unset the runtime
        raises it to the engine's batch size once the engine is up, and workers are added then.
        """
        while len(self._workers) < self._concurrency_limit():
            self._workers.append(
                asyncio.create_task(self._worker(), name=f"job-worker-{len(self._workers)}")
            )

    async def drain(self, timeout: float) -> None:
        """Start no new job; let running ones finish for up to ``timeout`` s; fail the rest."""
        self._draining = True
        running = [r.task for r in self._running.values()]
        if running:
            await asyncio.wait(running, timeout=timeout)
        for worker in self._workers:
            worker.cancel()  # a worker still running a job aborts it and fails it
        await asyncio.gather(*self._workers, return_exceptions=True)
        self._workers = []
        await self._webhooks.aclose()

    # ---- the API's verbs -----------------------------------------------------------------

    async def submit(
        self,
        request: JobRequest,
        *,
        sync: bool,
        owner: str = "",
        idempotency_key: str | None = None,
    ) -> Job:
        self.start()  # lazily: workers need the server's event loop, and the limit may grow
        if idempotency_key is not None and (
            first := await self._first_with(owner, idempotency_key)
        ):
            return first
        if self._queued + self._others_queued() >= self._settings.max_queue_length:
            raise RateLimitError(
                f"the job queue is full ({self._settings.max_queue_length} jobs waiting); "
                "retry later"
            )
        ttl_ms = request.policy.ttl or self._settings.default_ttl_ms
        job = Job(
            id=_new_job_id() + self._id_suffix,
            request=request,
            sync=sync,
            ttl_seconds=ttl_ms / 1000,
            retention_seconds=(
                self._settings.runsync_retention_seconds
                if sync
                else self._settings.run_retention_seconds
            ),
            submitted_at=self._clock(),
            owner=owner,
        )
        await self.store.add(job)
        self._enqueue(job)
        if idempotency_key is not None:
            expires = self._clock() + self._settings.idempotency_window_seconds
            self._idempotent[(owner, idempotency_key)] = (job.id, expires)
        return job

    async def _first_with(self, owner: str, key: str) -> Job | None:
        """The job an earlier /run with this Idempotency-Key made, within the window."""
        now = self._clock()
        for entry, (_, expires) in list(self._idempotent.items()):
            if expires <= now:
                del self._idempotent[entry]
        if (found := self._idempotent.get((owner, key))) is None:
            return None
        return await self.store.get(found[0])

    async def wait(self, job_id: str, timeout_seconds: float, *, owner: str | None = None) -> Job:
        """Wait until the job ends or the timeout passes; return its latest state."""
        job = await self.get(job_id, owner=owner)
        event = self._done.get(job_id)
        if event is not None and timeout_seconds > 0:
            await wait_until_set(event, timeout_seconds)
        try:
            return await self.get(job_id, owner=owner)
        except JobNotFound:
            # It ended at the end of its policy.ttl and is gone already: the waiter still
            # learns how it ended.
            return job

    async def get(self, job_id: str, *, owner: str | None = None) -> Job:
        """The job; another owner's job is answered like an unknown one (None: an admin)."""
        job = await self.store.get(job_id)
        if job is None or (owner is not None and job.owner != owner):
            raise JobNotFound(job_id)
        return job

    async def take_stream(self, job_id: str, *, owner: str | None = None) -> tuple[Job, list[Any]]:
        """The chunks produced since the last call, and the job."""
        job = await self.get(job_id, owner=owner)
        chunks = job.chunks[job.stream_cursor :]
        job.stream_cursor = len(job.chunks)
        await self.store.save(job)
        return job, chunks

    async def cancel(self, job_id: str, *, owner: str | None = None) -> Job:
        job = await self.get(job_id, owner=owner)
        if job.status is JobStatus.IN_QUEUE:
            self._leave_queue(job)  # its queue entry is skipped when a worker reaches it
            await self._finish(job, JobStatus.CANCELLED)
        elif job.status is JobStatus.IN_PROGRESS:
            if (running := self._running.get(job.id)) is not None:
                job.usage = running.tally.usage()  # what it used until now: it is billed
            await self._finish(job, JobStatus.CANCELLED)
            await self._stop(job.id)
        else:
            raise ConflictError(
                f"job {job.id} is {job.status.value}; only IN_QUEUE or IN_PROGRESS jobs can "
                "be cancelled",
                param="id",
            )
        return job

    async def retry(self, job_id: str, *, owner: str | None = None) -> Job:
        job = await self.get(job_id, owner=owner)
        if job.status not in RETRYABLE_STATUSES:
            raise ConflictError(
                f"job {job.id} is {job.status.value}; only FAILED or TIMED_OUT jobs can be retried",
                param="id",
            )
        if self._queued + self._others_queued() >= self._settings.max_queue_length:
            raise RateLimitError("the job queue is full; retry later")
        job.reset_for_retry()
        await self.store.save(job)
        self._retried += 1
        self._enqueue(job)
        return job

    async def purge_queue(self, *, owner: str | None = None) -> int:
        """Cancel the owner's jobs still waiting in the queue (everyone's for None)."""
        queued = [
            job
            for job in await self.store.in_state(JobStatus.IN_QUEUE)
            if owner is None or job.owner == owner
        ]
        for job in queued:
            self._leave_queue(job)
            await self._finish(job, JobStatus.CANCELLED)
        return len(queued)

    # ---- running jobs --------------------------------------------------------------------

    def _enqueue(self, job: Job) -> None:
        self._done[job.id] = asyncio.Event()
        self._count_queued(job, 1)
        self._queue.put_nowait(job.id)

    def _leave_queue(self, job: Job) -> None:
        self._count_queued(job, -1)

    def _count_queued(self, job: Job, sign: int) -> None:
        low = job.request.policy.lowPriority
        sequences = job_sequences(job.request)
        self._queued += sign
        self._queued_low_priority += sign * low
        self._queued_sequences += sign * sequences
        self._queued_low_priority_sequences += sign * sequences * low

    async def _worker(self) -> None:
        while True:
            job_id = await self._queue.get()
            if self._draining:
                continue  # shutting down: the job stays IN_QUEUE and is not started
            job = await self.store.get(job_id)
            if job is None or job.status is not JobStatus.IN_QUEUE:
                continue  # cancelled or purged while queued (already uncounted)
            try:
                await self._engine.wait_ready()
            except APIError as exc:
                if job.status is JobStatus.IN_QUEUE:
                    self._leave_queue(job)
                    await self._finish(job, JobStatus.FAILED, error=exc.to_error())
                continue
            if job.status is not JobStatus.IN_QUEUE:
                continue  # cancelled while waiting for the engine
            if self._clock() >= job.life_ends_at:
                self._leave_queue(job)
                await self._finish(job, JobStatus.TIMED_OUT, error=_ttl_error(job, started=False))
                continue
            sequences = job_sequences(job.request)
            self._gate.set_limit(self._concurrency_limit())
            # A job heavier than the whole limit runs alone (as OpenAI requests do).
            slots = await self._gate.acquire(sequences)
            try:
                if job.status is not JobStatus.IN_QUEUE:
                    continue  # cancelled while waiting for its sequences' slots
                self._leave_queue(job)
                await self._execute(job, sequences)
            finally:
                self._gate.release(slots)

    async def _execute(self, job: Job, sequences: int = 1) -> None:
        job.status = JobStatus.IN_PROGRESS
        job.started_at = self._clock()
        job.attempts += 1
        await self.store.save(job)
        request_id = job.engine_request_id
        tally = UsageTally()
        task = asyncio.create_task(self._produce(job, request_id, tally))
        self._running[job.id] = _Running(task, request_id, sequences, tally)
        timeout_ms = (
            job.request.policy.executionTimeout or self._settings.default_execution_timeout_ms
        )
        # The job's life (policy.ttl) ends before its execution timeout would: it stops then.
        life_left = job.life_ends_at - job.started_at
        cut_by_ttl = life_left < timeout_ms / 1000
        try:
            done, _ = await asyncio.wait(
                {task}, timeout=max(0.0, life_left) if cut_by_ttl else timeout_ms / 1000
            )
        except asyncio.CancelledError:  # the runtime is shutting down mid-job
            await self._stop(job.id)
            await self._finish(job, JobStatus.FAILED, error=_shutdown_error())
            raise
        if job.status.is_final:  # cancelled meanwhile; _finish already ran
            self._running.pop(job.id, None)
            return
        if not done:
            await self._stop(job.id)
            error = (
                _ttl_error(job, started=True)
                if cut_by_ttl
                else RequestTimeoutError(
                    f"the job ran longer than policy.executionTimeout ({timeout_ms} ms) and "
                    "was aborted",
                    param="policy.executionTimeout",
                ).to_error()
            )
            job.usage = tally.usage()  # what it used until the stop: it is billed
            await self._finish(job, JobStatus.TIMED_OUT, error=error)
            return
        self._running.pop(job.id, None)
        if task.cancelled():
            await self._finish(job, JobStatus.CANCELLED)
        elif (exc := task.exception()) is not None:
            if not isinstance(exc, APIError):
                log.exception("job %s failed", job.id, exc_info=exc)
            await self._finish(job, JobStatus.FAILED, error=error_from_exception(exc))
        else:
            await self._finish(job, JobStatus.COMPLETED, output=task.result())

    async def _produce(self, job: Job, request_id: str, tally: UsageTally) -> Any:
        return await produce(
            self._engine, self._settings, job.request, request_id, job.chunks.append, tally
        )

    async def _stop(self, job_id: str) -> None:
        """Abort the engine request now (its running count drops at once), then the task."""
        running = self._running.pop(job_id, None)
        if running is None:
            return
        try:
            await self._engine.abort(running.request_id)
        except Exception:
            log.exception("aborting engine request %s failed", running.request_id)
        running.task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await running.task

    async def _finish(
        self,
        job: Job,
        status: JobStatus,
        *,
        output: Any = None,
        error: dict[str, Any] | None = None,
    ) -> None:
        job.status = status
        job.finished_at = self._clock()
        if job.started_at is None and status is not JobStatus.CANCELLED:
            job.started_at = job.finished_at
        job.output = output
        job.error = error
        if status not in RETRYABLE_STATUSES:
            # The result is kept, not the request: only /retry (FAILED, TIMED_OUT) needs it.
            job.request = job.request.model_copy(update={"input": None})
        await self.store.save(job)
        if (event := self._done.pop(job.id, None)) is not None:
            event.set()
        if self._on_finish is not None:
            self._on_finish(job)
        if job.request.webhook is not None:
            self._webhooks.send(str(job.request.webhook), status_body(job))


async def produce(
    engine: JobEngine,
    settings: JobSettings,
    request: JobRequest,
    request_id: str,
    publish: Callable[[Any], None],
    tally: UsageTally | None = None,
    *,
    priority: int = 0,
) -> Any:
    """One attempt of a job on the engine: ``publish`` gets each stream chunk as it exists;
    the return value is the output. Raises for a job that fails. ``tally`` counts the tokens
    used as they are produced (what a job stopped before its end is billed). ``priority``:
    vLLM's (a batch's request runs above 0, below interactive requests)."""
    job_input = request.input
    schedule = resolve_schedule(
        max_batch_size=job_input.max_batch_size,
        min_batch_size=job_input.min_batch_size,
        growth=job_input.batch_size_growth_factor,
        default_max=settings.default_batch_size,
        default_min=settings.default_min_batch_size,
        default_growth=settings.default_batch_size_growth_factor,
    )
    if job_input.is_openai:
        return await work.run_openai_route(
            engine,
            job_input,
            schedule=schedule,
            raw_output=settings.raw_openai_output,
            publish=publish,
            tally=tally,
            priority=priority,
        )
    return await work.run_generation(
        engine,
        job_input,
        request_id=request_id,
        schedule=schedule,
        default_max_tokens=settings.default_max_tokens,
        publish=publish,
        tally=tally,
        priority=priority,
    )


def _ttl_error(job: Job, *, started: bool) -> dict[str, Any]:
    ttl_ms = round(job.ttl_seconds * 1000)
    what = "while it ran and was aborted" if started else "before it could start"
    return RequestTimeoutError(
        f"the job reached the end of its policy.ttl ({ttl_ms} ms from submission) {what}",
        param="policy.ttl",
    ).to_error()


def _shutdown_error() -> dict[str, Any]:
    return ServiceUnavailableError("the runtime shut down while the job ran").to_error()


def _new_job_id() -> str:
    return f"{uuid.uuid4()}"
