"""The RunPod job API under ``/v2/{endpoint}/...`` on the shared queue (JOBS_QUEUE_URL).

The gateway accepts, reports, streams, cancels, retries and purges jobs with no runtime pod
running: jobs wait in NATS JetStream until a runtime pod of the endpoint pulls them (see
llmendpoints_common.queue). The verbs are the queue client's (``QueueJobService``); this module
only maps HTTP to them, with the caller's key name as the job's owner (an admin key reaches
every job). A job this gateway moves into a final state (a /cancel, a /purge-queue) has its
webhook sent from here, as a runtime pod sends those of the jobs it runs. Input is checked against the job schema here; checks that need the model (sampling
parameter values, image support) happen in the runtime, which fails the job with the reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from llmendpoints_common.destinations import DestinationPolicy, DestinationRefused, check_url
from llmendpoints_common.errors import (
    APIError,
    BadRequestError,
    NotFoundError,
    ServiceUnavailableError,
)
from llmendpoints_common.jobs.models import JobRequest, parse_job_request
from llmendpoints_common.jobs.record import JobRecord
from llmendpoints_common.jobs.service import status_body
from llmendpoints_common.queue.client import QueueConnection, QueueJobService
from llmendpoints_common.webhooks import (
    DEFAULT_MAX_CONCURRENCY,
    DEFAULT_RETRIES,
    DEFAULT_RETRY_DELAY_SECONDS,
    DEFAULT_TIMEOUT_SECONDS,
    WebhookSender,
)

logger = logging.getLogger("llmendpoints.gateway.jobs")

DEFAULT_RUNSYNC_WAIT_MS = 90_000
MAX_RUNSYNC_WAIT_MS = 300_000


class JobGateway:
    def __init__(
        self,
        url: str,
        gateway_id: str,
        *,
        webhooks: WebhookSender | None = None,
        webhook_policy: DestinationPolicy | None = None,
        webhook_timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS,
        webhook_max_concurrency: int = DEFAULT_MAX_CONCURRENCY,
        creds_file: str | None = None,
    ):
        self.url = url
        self.creds_file = creds_file
        self.gateway_id = gateway_id
        self.webhook_policy = webhook_policy or DestinationPolicy()
        self.webhooks = webhooks or WebhookSender(
            retries=DEFAULT_RETRIES,
            delay_seconds=DEFAULT_RETRY_DELAY_SECONDS,
            timeout_seconds=webhook_timeout_seconds,
            max_concurrency=webhook_max_concurrency,
            policy=self.webhook_policy,
        )
        self._connection: QueueConnection | None = None
        self._services: dict[str, QueueJobService] = {}
        self._task: asyncio.Task | None = None

    @property
    def pending_webhooks(self) -> int:
        """Webhook deliveries still being tried: the SIGTERM drain waits for them."""
        return self.webhooks.pending

    async def start(self) -> None:
        self._task = asyncio.create_task(self._connect())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
        # The drain has waited for deliveries already (up to DRAIN_TIMEOUT_SECONDS); what is
        # still being retried now is given up, not allowed to hold the exit.
        await self.webhooks.aclose(timeout=1.0)
        if self._connection is not None:
            await self._connection.close()

    async def _connect(self) -> None:
        while True:
            try:
                self._connection = await QueueConnection.connect(
                    self.url, name=f"gateway-{self.gateway_id}", creds_file=self.creds_file
                )
                logger.info("job API on the shared queue")
                return
            except Exception as exc:
                logger.warning("cannot reach the job queue (%s); retrying", type(exc).__name__)
                await asyncio.sleep(2.0)

    def service(self, endpoint: str) -> QueueJobService:
        """``endpoint``: ``<namespace>/<name>``."""
        if self._connection is None:
            raise ServiceUnavailableError(
                "the job queue is not reachable yet; retry", headers={"retry-after": "2"}
            )
        service = self._services.get(endpoint)
        if service is None:
            service = self._services[endpoint] = QueueJobService(
                self._connection, endpoint, on_final=self._ended
            )
        return service

    def _job_request(self, body: bytes | None) -> JobRequest:
        """The job, with its webhook checked as the runtime checks it (no DNS here; the
        delivery resolves and checks again)."""
        job_request = parse_job_request(body or b"")
        if job_request.webhook is not None:
            try:
                check_url(str(job_request.webhook), self.webhook_policy)
            except DestinationRefused as exc:
                raise BadRequestError(f"webhook: {exc}", param="webhook") from None
        return job_request

    def _ended(self, record: JobRecord) -> None:
        # Called once per job, by whoever moved it into its final state: here, a /cancel or
        # /purge-queue through this gateway.
        if record.webhook is not None:
            self.webhooks.send(record.webhook, status_body(record))

    async def handle(
        self,
        endpoint: str,
        method: str,
        verb: str,
        query: dict[str, str],
        headers: dict[str, str],
        body: bytes | None,
        owner: str | None,
    ) -> dict[str, Any]:
        """One job verb; ``verb`` is the path after ``/v2/{endpoint}/``; ``endpoint`` is the
        endpoint's ``<namespace>/<name>``."""
        name, _, job_id = verb.partition("/")
        in_url = endpoint.rpartition("/")[2]
        jobs = self.service(endpoint)
        submit_owner = owner or ""
        match method, name, bool(job_id):
            case "POST", "run", False:
                job = await jobs.submit(
                    self._job_request(body),
                    sync=False,
                    owner=submit_owner,
                    idempotency_key=headers.get("idempotency-key") or None,
                )
                return {"id": job.id, "status": job.status.value}
            case "POST", "runsync", False:
                wait_ms = _wait_ms(query.get("wait"))
                accepted = await jobs.submit(self._job_request(body), sync=True, owner=submit_owner)
                job = await jobs.wait(accepted.id, wait_ms / 1000, owner=owner)
                return (
                    status_body(job)
                    if job.status.is_final
                    else {"id": job.id, "status": job.status.value}
                )
            case "GET" | "POST", "status", True:
                return status_body(await jobs.get(job_id, owner=owner))
            case "GET" | "POST", "stream", True:
                job, chunks = await jobs.take_stream(job_id, owner=owner)
                reply: dict[str, Any] = {
                    "id": job.id,
                    "status": job.status.value,
                    "stream": [{"output": c} for c in chunks],
                }
                if job.error is not None:
                    reply["error"] = job.error
                return reply
            case "POST", "cancel", True:
                job = await jobs.cancel(job_id, owner=owner)
                return {"id": job.id, "status": job.status.value}
            case "POST", "retry", True:
                job = await jobs.retry(job_id, owner=owner)
                return {"id": job.id, "status": job.status.value}
            case "POST", "purge-queue", False:
                return {"removed": await jobs.purge_queue(owner=owner), "status": "completed"}
            case "GET", "health", False:
                return await jobs.health()
        if name in (
            "run",
            "runsync",
            "status",
            "stream",
            "cancel",
            "retry",
            "purge-queue",
            "health",
        ):
            raise APIError(405, f"{method} /v2/{in_url}/{verb}: wrong method or missing job id")
        raise NotFoundError(f"/v2/{in_url}/{verb} is not a job API route")


def _wait_ms(raw: str | None) -> int:
    if raw is None:
        return DEFAULT_RUNSYNC_WAIT_MS
    if not raw.isdigit():
        raise BadRequestError(
            f"wait: must be a whole number of milliseconds, got {raw!r}", param="wait"
        )
    if int(raw) > MAX_RUNSYNC_WAIT_MS:
        raise BadRequestError(
            f"wait: at most {MAX_RUNSYNC_WAIT_MS} ms, got {raw}; use /run and /status for longer jobs",
            param="wait",
        )
    return int(raw)


# The one durable consumer every gateway replica pulls job state changes from: each change is
# handled by one replica.
JOB_USAGE_CONSUMER = "gateway-job-usage"


class JobUsageMeter:
    """Meters the tokens of jobs when they complete, whoever ran them and however the client
    learns the result (``/runsync``, ``/status``, a webhook, never).

    Every gateway replica pulls from one durable consumer on the job records
    (``KV_LLMEP_JOB_STATE``), so each change is handled by one replica. A COMPLETED record's
    output usage becomes the usage record ``job-<id>-usage``; the stream drops a second copy
    (a later write to the finished record, e.g. a ``/stream`` read moving its cursor), and only
    a record the stream stored for the first time is counted in ``tokens_total`` and charged to
    the owner's tokensPerMinute."""

    def __init__(self, url: str, gateway_id: str, on_usage, creds_file: str | None = None) -> None:
        self.url = url
        self.creds_file = creds_file
        self.gateway_id = gateway_id
        # on_usage(record: JobRecord, usage) -> UsageRecord | None: what to store and count
        self.on_usage = on_usage
        self._task: asyncio.Task | None = None
        self._connection: QueueConnection | None = None
        self.counted = 0

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._connection is not None:
            await self._connection.close()

    async def _run(self) -> None:
        from llmendpoints_common.queue import names
        from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

        from llmendpoints_gateway.metering import usage_of_job_output

        while True:
            try:
                if self._connection is None:
                    self._connection = await QueueConnection.connect(
                        self.url,
                        name=f"gateway-job-usage-{self.gateway_id}",
                        creds_file=self.creds_file,
                    )
                js = self._connection.js
                sub = await js.pull_subscribe(
                    names.kv_subject(names.JOB_STATE_BUCKET, ">"),
                    durable=JOB_USAGE_CONSUMER,
                    stream=names.kv_stream(names.JOB_STATE_BUCKET),
                    config=ConsumerConfig(
                        deliver_policy=DeliverPolicy.NEW,
                        ack_policy=AckPolicy.EXPLICIT,
                        ack_wait=30.0,
                        max_ack_pending=10_000,
                    ),
                )
                while True:
                    try:
                        messages = await sub.fetch(256, timeout=5.0)
                    except TimeoutError:
                        continue
                    for msg in messages:
                        await self._handle(js, msg.data, usage_of_job_output)
                        await msg.ack()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                logger.warning("metering job usage: %s; retrying", exc)
                await asyncio.sleep(2.0)

    async def _handle(self, js, data: bytes | None, usage_of_job_output) -> None:
        from llmendpoints_common.jobs.models import JobStatus
        from llmendpoints_common.queue import names

        if not data:
            return
        try:
            record = JobRecord.decode(data)
        except ValueError:
            return
        if record.status is not JobStatus.COMPLETED:
            return
        usage = usage_of_job_output(record.output)
        if usage is None:
            return
        entry, count = self.on_usage(record, usage)
        ack = await js.publish(
            names.usage_subject(entry.endpoint, entry.key),
            entry.encode(),
            headers={"Nats-Msg-Id": entry.id},
        )
        if not ack.duplicate:
            self.counted += 1
            count()
