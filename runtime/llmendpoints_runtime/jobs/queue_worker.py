"""The job API on the shared queue (``JOBS_QUEUE_URL``): this pod answers every verb for every
job of its endpoint (``ENDPOINT_NAMESPACE``/``ENDPOINT_ID``), and is one of the endpoint's
workers. With ``JOBS_QUEUE_CREDS_FILE`` (the operator mounts one per endpoint) it can reach that
endpoint's own two streams and worker consumers and nothing else.

- The verbs are ``llmendpoints_common.queue.client.QueueJobService``'s (the gateway uses the
  same), so a job submitted anywhere is seen, streamed, cancelled from here.
- The worker (``llmendpoints_common.queue.worker.QueueWorker``) takes jobs only while the engine
  is ready, the pod is not draining, and fewer than the admission limit (MAX_CONCURRENCY, or the
  engine's batch size) of its jobs run: a pod never holds jobs it cannot start.
- Each attempt runs exactly like an in-pod job (``executor.produce``): same engine calls, same
  stream batches, same errors. Checks that need the engine (sampling parameters, the OpenAI
  request body, images for a text-only model) run first: a job the gateway accepted without an
  engine fails here with the same 400 message an in-pod ``/run`` would have answered.
- ``/runsync`` goes through the queue too, rather than running on the pod that received it: it
  keeps the endpoint's FIFO order and its capacity limit; bench/queue_runsync.py measures what
  that costs.
- The queue unreachable: the pod keeps serving OpenAI requests, the job verbs answer 503 with
  ``Retry-After``, and the client reconnects on its own (at start-up too).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from llmendpoints_common.destinations import DestinationPolicy
from llmendpoints_common.errors import ServiceUnavailableError
from llmendpoints_common.identity import EndpointRef
from llmendpoints_common.jobs import admission
from llmendpoints_common.jobs.models import JobLimits, JobRequest, check_limits, job_sequences
from llmendpoints_common.jobs.record import JobRecord, JobUsage
from llmendpoints_common.jobs.service import status_body
from llmendpoints_common.queue.client import (
    RETRY_AFTER_SECONDS,
    QueueConnection,
    QueueJobService,
    QueueJobSettings,
)
from llmendpoints_common.queue.topology import QueueLayout
from llmendpoints_common.queue.worker import QueueWorker, WorkerSettings
from llmendpoints_common.webhooks import WebhookSender

from llmendpoints_runtime.jobs.executor import produce
from llmendpoints_runtime.jobs.port import JobEngine
from llmendpoints_runtime.jobs.routes import job_verbs
from llmendpoints_runtime.jobs.settings import JobSettings, finished_jobs_counter
from llmendpoints_runtime.jobs.tally import UsageTally
from llmendpoints_runtime.jobs.wiring import job_routers
from llmendpoints_runtime.jobs.work import check_images

log = logging.getLogger("llmendpoints.jobs.queue")


@dataclass(frozen=True)
class SharedQueueSettings:
    url: str
    endpoint: EndpointRef
    layout: QueueLayout
    service: QueueJobSettings
    worker: WorkerSettings
    creds_file: str | None = None
    # Batches: whether this pod takes batch requests, at which vLLM priority, and the share of
    # its capacity they may take at most.
    batch: BatchShare | None = None


@dataclass(frozen=True)
class BatchShare:
    priority: int = 10
    max_share: float = 0.75

    def slots(self, capacity: int, busy: int, engine_waiting: int) -> int:
        """How many batch requests a pod of ``capacity`` may run when ``busy`` of it runs
        other work (interactive requests, jobs) and the engine has ``engine_waiting`` requests
        it cannot schedule yet (pure). Never past ``max_share`` of the capacity, never into
        room other work uses, none while the engine is saturated."""
        if engine_waiting > 0:
            return 0
        share = max(1, int(capacity * self.max_share))
        return max(0, min(share, capacity - busy))


def shared_queue_settings(settings: Any) -> SharedQueueSettings:
    """From the runtime's settings (environment variables)."""
    timeout = settings.jobs_heartbeat_timeout_seconds
    batch = (
        BatchShare(priority=settings.batch_priority, max_share=settings.batch_max_share)
        if settings.batch_enabled
        else None
    )
    return SharedQueueSettings(
        batch=batch,
        url=settings.jobs_queue_url.get_secret_value(),
        endpoint=EndpointRef(settings.endpoint_namespace, settings.endpoint_id),
        creds_file=settings.jobs_queue_creds_file,
        layout=QueueLayout(
            replicas=settings.jobs_queue_replicas,
            max_queue_length=settings.max_queue_length,
            heartbeat_timeout_seconds=timeout,
        ),
        service=QueueJobSettings(
            run_retention_seconds=settings.jobs_run_retention_seconds,
            runsync_retention_seconds=settings.jobs_runsync_retention_seconds,
            idempotency_window_seconds=settings.jobs_idempotency_window_seconds,
            default_ttl_seconds=JobLimits(max_ttl_ms=settings.max_job_ttl_ms).default_ttl_ms / 1000,
        ),
        worker=WorkerSettings(
            max_attempts=settings.jobs_max_attempts,
            heartbeat_interval_seconds=timeout / 3,
            default_execution_timeout_seconds=JobLimits(
                max_execution_timeout_ms=settings.max_execution_timeout_ms
            ).default_execution_timeout_ms
            / 1000,
        ),
    )


def check_with_engine(engine: JobEngine, request: JobRequest, limits: JobLimits) -> None:
    """The checks only a process with the model can make (400 at /run, FAILED in a worker),
    and this server's limits again (MAX_N, the policy's maxima): whoever accepted the job --
    the gateway, another pod -- may have had other settings."""
    check_limits(request, limits)
    job_input = request.input
    if job_input.is_openai:
        assert job_input.openai_route is not None
        engine.check_openai_input(job_input.openai_route, job_input.openai_input)
    else:
        engine.check_sampling_params(job_input.sampling_params)
    check_images(engine, job_input)


class SharedQueueJobs:
    """The routes' JobService on the shared queue, plus this pod's worker."""

    def __init__(
        self,
        engine: JobEngine,
        job_settings: JobSettings,
        settings: SharedQueueSettings,
        *,
        capacity: Callable[[], int],
        interactive: Callable[[], int] = lambda: 0,
        batch_capacity: Callable[[], int] | None = None,
        on_final: Callable[[JobRecord], None] | None = None,
        webhook_policy: DestinationPolicy | None = None,
    ) -> None:
        self._engine = engine
        self._job_settings = job_settings
        self.settings = settings
        self._capacity = capacity
        # Interactive requests admitted (running or waiting for a slot): batch requests keep
        # out of their way.
        self._interactive = interactive
        self._batch_capacity = batch_capacity or capacity
        self._on_final = on_final
        self._webhooks = WebhookSender(
            retries=job_settings.webhook_retries,
            delay_seconds=job_settings.webhook_retry_delay_seconds,
            timeout_seconds=job_settings.webhook_timeout_seconds,
            max_concurrency=job_settings.webhook_max_concurrency,
            policy=webhook_policy,
        )
        self._service: QueueJobService | None = None
        self._worker: QueueWorker | None = None
        self._connecting: asyncio.Task[None] | None = None
        self.name = f"{socket.gethostname()}-{os.getpid()}"
        # Sequences of the running jobs beyond one per job: the worker counts jobs, the engine
        # runs sequences (a job with n: 4 is 4), so the free slots it is told are sequences.
        self._extra_sequences = 0
        # What each running attempt used so far (by engine request id), until the worker asks.
        self._tallies: dict[str, UsageTally] = {}

    # ---- lifecycle -----------------------------------------------------------------------

    async def start(self) -> None:
        """Connect in the background: the pod serves OpenAI requests whether or not the queue
        is reachable yet."""
        self._connecting = asyncio.create_task(
            self._connect_until_done(), name="jobs-queue-connect"
        )

    async def _connect_until_done(self) -> None:
        delay = 0.5
        while True:
            try:
                connection = await QueueConnection.connect(
                    self.settings.url,
                    name=f"llmep-runtime-{self.name}",
                    creds_file=self.settings.creds_file,
                    layout=self.settings.layout,
                )
                break
            except Exception as exc:
                log.warning(
                    "job queue unreachable (%s: %s); retrying in %.0f s",
                    type(exc).__name__,
                    exc,
                    delay,
                )
                await asyncio.sleep(delay)
                delay = min(delay * 2, 10.0)
        # Jobs accepted here are this pod's word: billed to the endpoint's own name, never to a
        # gateway key (llmendpoints_common.jobs.admission).
        self._service = QueueJobService(
            connection,
            self.settings.endpoint,
            self.settings.service,
            on_final=self._ended,
            admitted_by=admission.ENDPOINT,
        )
        self._worker = QueueWorker(
            self._service,
            name=self.name,
            execute=self._execute,
            abort=self._abort,
            free_slots=self._free_slots,
            batch_slots=self._batch_slots if self.settings.batch is not None else None,
            usage=self._attempt_usage,
            settings=self.settings.worker,
            layout=self.settings.layout,
        )
        await self._worker.start()
        log.info("job queue connected: working for endpoint %s", self.settings.endpoint.id)

    async def stop(self, timeout: float) -> None:
        if self._connecting is not None and not self._connecting.done():
            self._connecting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._connecting
        if self._worker is not None:
            await self._worker.stop(timeout)
        await self._webhooks.aclose()
        if self._service is not None:
            await self._service.connection.close()

    @property
    def running(self) -> int:
        return self._worker.running if self._worker is not None else 0

    @property
    def running_sequences(self) -> int:
        """Sequences of the jobs this pod runs (part of llmendpoints_requests_in_flight)."""
        return self.running + self._extra_sequences

    def busy(self) -> int:
        """Work a draining pod waits for: jobs it runs, webhooks being delivered."""
        return self.running + self._webhooks.pending

    async def drain(self, timeout: float) -> None:
        """Take no new job; running ones get ``timeout`` s, the rest go back to the queue."""
        await self.stop(timeout)

    # ---- the worker's side ---------------------------------------------------------------

    def _free_slots(self) -> int:
        if self._engine.draining() or not self._engine.is_ready():
            return 0
        # A job is taken while one slot is free; its other sequences count once it runs (a
        # pod may so run up to MAX_N - 1 sequences over its limit, never more).
        return self._capacity() - self._extra_sequences

    def _batch_slots(self) -> int:
        """Batch requests this pod may run now (the worker subtracts those it runs)."""
        share = self.settings.batch
        if share is None or self._engine.draining() or not self._engine.is_ready():
            return 0
        worker = self._worker
        batch_running = worker.running_batch if worker is not None else 0
        others = (worker.running if worker is not None else 0) - batch_running
        busy = self._interactive() + max(0, others) + self._extra_sequences
        return share.slots(self._batch_capacity(), busy, self._engine.load().waiting)

    async def _execute(self, record: JobRecord, publish: Callable[[Any], None]) -> Any:
        request = JobRequest.model_validate(record.request)
        check_with_engine(self._engine, request, self._job_settings.limits)
        extra = job_sequences(request) - 1
        self._extra_sequences += extra
        tally = self._tallies[record.engine_request_id] = UsageTally()
        # A batch's request runs below interactive ones inside the engine too.
        share = self.settings.batch
        priority = share.priority if record.batch is not None and share is not None else 0
        try:
            return await produce(
                self._engine,
                self._job_settings,
                request,
                record.engine_request_id,
                publish,
                tally,
                priority=priority,
            )
        finally:
            self._extra_sequences -= extra

    def _attempt_usage(self, record: JobRecord) -> JobUsage | None:
        """The worker asks once per attempt, after it stopped (None: it never reached the
        engine -- refused by the checks, or no slot)."""
        tally = self._tallies.pop(record.engine_request_id, None)
        return tally.usage() if tally is not None else None

    async def _abort(self, record: JobRecord) -> None:
        await self._engine.abort(record.engine_request_id)

    def _ended(self, record: JobRecord) -> None:
        if record.webhook is not None:
            self._webhooks.send(record.webhook, status_body(record))
        if self._on_final is not None:
            self._on_final(record)

    # ---- the routes' JobService ----------------------------------------------------------

    def _connected(self) -> QueueJobService:
        if self._service is None:
            raise ServiceUnavailableError(
                f"the job queue is not reachable yet; retry in {RETRY_AFTER_SECONDS} s",
                headers={"Retry-After": str(RETRY_AFTER_SECONDS)},
            )
        return self._service

    async def submit(
        self, request: JobRequest, *, sync: bool, owner: str, idempotency_key: str | None = None
    ) -> JobRecord:
        return await self._connected().submit(
            request, sync=sync, owner=owner, idempotency_key=idempotency_key
        )

    async def wait(self, job_id: str, timeout_seconds: float, *, owner: str | None) -> JobRecord:
        return await self._connected().wait(job_id, timeout_seconds, owner=owner)

    async def get(self, job_id: str, *, owner: str | None) -> JobRecord:
        return await self._connected().get(job_id, owner=owner)

    async def take_stream(self, job_id: str, *, owner: str | None) -> tuple[JobRecord, list[Any]]:
        return await self._connected().take_stream(job_id, owner=owner)

    async def cancel(self, job_id: str, *, owner: str | None) -> JobRecord:
        return await self._connected().cancel(job_id, owner=owner)

    async def retry(self, job_id: str, *, owner: str | None) -> JobRecord:
        return await self._connected().retry(job_id, owner=owner)

    async def purge_queue(self, *, owner: str | None) -> int:
        return await self._connected().purge_queue(owner=owner)

    async def health(self) -> dict[str, Any]:
        body = await self._connected().health()
        load = self._engine.load()
        ready = self._engine.is_ready()
        busy = self.running > 0 or load.running > 0 or load.waiting > 0
        # This pod as a worker (RunPod counts workers; the endpoint's other pods are theirs).
        body["workers"] = {
            "idle": int(ready and not busy),
            "running": int(ready and busy),
            "initializing": int(not ready),
            "ready": int(ready),
            "throttled": 0,
            "unhealthy": 0,
        }
        body["engine"] = {
            "state": "initializing" if not ready else ("busy" if busy else "idle"),
            "running": load.running,
            "waiting": load.waiting,
        }
        return body


def build_queue_feature(
    engine: JobEngine,
    job_settings: JobSettings,
    settings: SharedQueueSettings,
    *,
    registry: Any,
    capacity: Callable[[], int],
    webhook_policy: DestinationPolicy,
    interactive: Callable[[], int] = lambda: 0,
    batch_capacity: Callable[[], int] | None = None,
) -> QueueJobFeature:
    """The job API on the shared queue, as a feature of the runtime (``compose.py``)."""
    finished = finished_jobs_counter(registry)
    jobs = SharedQueueJobs(
        engine,
        job_settings,
        settings,
        capacity=capacity,
        interactive=interactive,
        batch_capacity=batch_capacity,
        on_final=lambda record: finished.labels(status=record.status.value).inc(),
        webhook_policy=webhook_policy,
    )
    return QueueJobFeature(jobs, engine, job_settings, webhook_policy)


class QueueJobFeature:
    """What compose.py plugs in: the routers (whose lifespan connects to the queue), the work a
    draining pod waits for, and the drain."""

    def __init__(
        self,
        jobs: SharedQueueJobs,
        engine: JobEngine,
        job_settings: JobSettings,
        webhook_policy: DestinationPolicy,
    ) -> None:
        self.jobs = jobs
        self.verbs = job_verbs(jobs, engine, job_settings, webhook_policy)

    def busy(self) -> int:
        return self.jobs.busy()

    async def drain(self, timeout: float) -> None:
        await self.jobs.drain(timeout)

    def routers(self, openai_target: Callable[[Any], Any]) -> list[Any]:
        jobs = self.jobs

        @contextlib.asynccontextmanager
        async def lifespan(_: Any) -> Any:
            await jobs.start()
            try:
                yield
            finally:
                await jobs.stop(timeout=0)  # after the drain: what still runs goes back

        routers = job_routers(self.verbs, openai_target)
        routers[0].lifespan_context = lifespan  # the root router's
        return routers
