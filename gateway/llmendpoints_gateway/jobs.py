"""The RunPod job API under ``/v2/{endpoint}/...`` on the shared queue (JOBS_QUEUE_URL).

The gateway accepts, reports, streams, cancels, retries and purges jobs with no runtime pod
running: jobs wait in NATS JetStream until a runtime pod of the endpoint pulls them (see
llmendpoints_common.queue). The verbs are the ones the runtime serves too
(``llmendpoints_common.jobs.api.JobVerbs`` over ``QueueJobService``): same input checks, same
answers, same errors with the job's ``id``. This module only adds what a front door across
endpoints does around them: the caller's key name as the job's owner (an admin key reaches every
job), the key's limits (a submission is a request; a /runsync holds a concurrency slot while it
waits), the job's admission (the gateway's word on whose it is and what it may be billed, where
no pod may write: llmendpoints_common.jobs.admission), metering, and a nudge to the autoscaler when the endpoint has no ready replica. A job
this gateway moves into a final state (a /cancel, a /purge-queue) has its webhook sent from
here, as a runtime pod sends those of the jobs it runs. Checks that need the model (sampling
parameter values, image support) happen in the runtime, which fails the job with the reason.
"""

from __future__ import annotations

from collections.abc import Callable
from urllib.parse import parse_qsl

from llmendpoints_common.destinations import DestinationPolicy
from llmendpoints_common.errors import NotFoundError, ServiceUnavailableError
from llmendpoints_common.jobs import admission
from llmendpoints_common.jobs.api import JobCall, JobVerbs, split_verb
from llmendpoints_common.jobs.record import JobRecord
from llmendpoints_common.jobs.service import status_body
from llmendpoints_common.queue.client import QueueJobService
from llmendpoints_common.webhooks import (
    DEFAULT_RETRIES,
    DEFAULT_RETRY_DELAY_SECONDS,
    WebhookSender,
)
from llmendpoints_edge.asgi import Scope, Send, header_text, send_json

from llmendpoints_gateway.access import Access
from llmendpoints_gateway.keys import Key
from llmendpoints_gateway.limiter import Limiter
from llmendpoints_gateway.queue import SharedQueue
from llmendpoints_gateway.registry import Endpoint
from llmendpoints_gateway.request import RequestLog


class JobGateway:
    def __init__(
        self,
        queue: SharedQueue,
        limiter: Limiter,
        *,
        webhook_policy: DestinationPolicy,
        webhook_timeout_seconds: float,
        webhook_max_concurrency: int,
        nudge: Callable[[str], None] | None = None,
    ):
        self.queue = queue
        self.limiter = limiter
        self.webhook_policy = webhook_policy
        self.nudge = nudge
        self.webhooks = WebhookSender(
            retries=DEFAULT_RETRIES,
            delay_seconds=DEFAULT_RETRY_DELAY_SECONDS,
            timeout_seconds=webhook_timeout_seconds,
            max_concurrency=webhook_max_concurrency,
            policy=webhook_policy,
        )
        self._verbs: dict[str, JobVerbs] = {}

    @property
    def pending_webhooks(self) -> int:
        """Webhook deliveries still being tried: the SIGTERM drain waits for them."""
        return self.webhooks.pending

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        # The drain has waited for deliveries already (up to DRAIN_TIMEOUT_SECONDS); what is
        # still being retried now is given up, not allowed to hold the exit.
        await self.webhooks.aclose(timeout=1.0)

    def verbs(self, endpoint: str) -> JobVerbs:
        """The job verbs of ``endpoint`` (its ``<namespace>/<name>``)."""
        connection = self.queue.connection
        if connection is None:
            raise ServiceUnavailableError(
                "the job queue is not reachable yet; retry", headers={"retry-after": "2"}
            )
        verbs = self._verbs.get(endpoint)
        if verbs is None:
            service = QueueJobService(
                connection, endpoint, on_final=self._ended, admitted_by=admission.GATEWAY
            )
            verbs = self._verbs[endpoint] = JobVerbs(service, webhook_policy=self.webhook_policy)
        return verbs

    def _ended(self, record: JobRecord) -> None:
        # Called once per job, by whoever moved it into its final state: here, a /cancel or
        # /purge-queue through this gateway.
        if record.webhook is not None:
            self.webhooks.send(record.webhook, status_body(record))

    async def answer(
        self,
        scope: Scope,
        body: bytes,
        send: Send,
        state: RequestLog,
        key: Key | None,
        ep: Endpoint,
        path: str,
    ) -> None:
        """One job verb of ``ep``; ``path`` is what follows ``/v2/{endpoint}/``."""
        verb, job_id = split_verb(path)
        if verb == "openai":
            raise NotFoundError(f"/v2/{ep.name}/{path} is not a route of this gateway")
        state.endpoint = ep.id
        caller, admin = Access.caller(key)
        call = JobCall(
            method=scope["method"],
            verb=verb,
            caller=caller,
            admin=admin,
            job_id=job_id,
            query=dict(parse_qsl((scope.get("query_string") or b"").decode("latin-1"))),
            body=body,
            idempotency_key=header_text(scope, b"idempotency-key") or None,
        )
        # A submission is one of the key's requests, and so is a /retry (the job runs again);
        # a /runsync holds a concurrency slot while it waits for its job.
        counted = call.submits or verb == "retry"
        if counted and key is not None and key.limits.any:
            state.ticket = await self.limiter.admit(key, hold=verb == "runsync")
        reply = await self.verbs(ep.id).handle(call)
        if counted and (job := reply.accepted_id) is not None:
            if not ep.ready and self.nudge is not None:
                self.nudge(ep.id)
            state.model = ep.models[0] if ep.models else ""
            state.record_kind = "job"
            state.record_id = f"job-{job}" if verb != "retry" else None  # each retry once
        await send_json(send, reply.status, reply.body, dict(reply.headers))
