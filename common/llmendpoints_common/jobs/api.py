"""The RunPod job API's verbs over HTTP-shaped input, written once for both front doors:
``(verb, job id, caller, query, body) -> (status, body, headers)``, no web framework.

The runtime's FastAPI router (one route per operation, so OpenAPI documents each) and the
gateway's job branch only turn a request into a ``JobCall`` and a ``JobReply`` into an answer;
vLLM's ``<feature>/{api_router, serving, protocol}`` split is the model. Whoever keeps the jobs
is the ``JobService`` handed in: the runtime's in-pod executor, or the shared queue (runtime
pods and the gateway alike).

Errors come back as a ``JobReply`` too, in the job API's envelope: the OpenAI-shaped error and
the ``id`` of the job the request named, so a client of either front door reads the same body.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from llmendpoints_common.destinations import DestinationPolicy, DestinationRefused, check_url
from llmendpoints_common.errors import APIError, BadRequestError, NotFoundError, job_error_body
from llmendpoints_common.jobs.models import JobLimits, JobRequest, parse_job_request
from llmendpoints_common.jobs.service import JobService, JobView, status_body

DEFAULT_RUNSYNC_WAIT_MS = 90_000
MAX_RUNSYNC_WAIT_MS = 300_000

# verb -> (methods, whether a job id follows it)
VERBS: dict[str, tuple[frozenset[str], bool]] = {
    "run": (frozenset({"POST"}), False),
    "runsync": (frozenset({"POST"}), False),
    "status": (frozenset({"GET", "POST"}), True),
    "stream": (frozenset({"GET", "POST"}), True),
    "cancel": (frozenset({"POST"}), True),
    "retry": (frozenset({"POST"}), True),
    "purge-queue": (frozenset({"POST"}), False),
    "health": (frozenset({"GET"}), False),
}
SUBMIT_VERBS = frozenset({"run", "runsync"})


@dataclass(frozen=True)
class JobCall:
    method: str
    verb: str  # one of VERBS
    caller: str  # the API key's name: the owner of what it submits
    admin: bool = False  # an admin key reaches every job
    job_id: str | None = None
    query: Mapping[str, str] = field(default_factory=dict)
    body: bytes = b""
    idempotency_key: str | None = None

    @property
    def owner(self) -> str | None:
        """Whose jobs the call may see: the caller's, or everyone's (None) for an admin."""
        return None if self.admin else self.caller

    @property
    def submits(self) -> bool:
        return self.verb in SUBMIT_VERBS


@dataclass(frozen=True)
class JobReply:
    status: int
    body: dict[str, Any]
    headers: Mapping[str, str] = field(default_factory=dict)

    @property
    def accepted_id(self) -> str | None:
        """The id of a job a /run or /runsync stored (None for an error)."""
        job_id = self.body.get("id") if self.status == 200 else None
        return job_id if isinstance(job_id, str) else None


def split_verb(path: str) -> tuple[str, str | None]:
    """``status/<id>`` -> ("status", "<id>"); ``run`` -> ("run", None) (pure)."""
    verb, _, job_id = path.partition("/")
    return verb, (job_id or None)


class JobVerbs:
    """One endpoint's job API over its ``JobService``.

    ``accepting()`` may refuse new jobs (a draining pod: 503); ``check(request)`` may refuse a
    job before it is stored (checks that need the engine: sampling parameters, the model, image
    support). Neither runs for the verbs about existing jobs.
    """

    def __init__(
        self,
        service: JobService,
        *,
        limits: JobLimits | None = None,
        webhook_policy: DestinationPolicy | None = None,
        default_wait_ms: int = DEFAULT_RUNSYNC_WAIT_MS,
        max_wait_ms: int = MAX_RUNSYNC_WAIT_MS,
        accepting: Callable[[], None] | None = None,
        check: Callable[[JobRequest], None] | None = None,
    ) -> None:
        self.service = service
        self.limits = limits
        self.webhook_policy = webhook_policy or DestinationPolicy()
        self.default_wait_ms = default_wait_ms
        self.max_wait_ms = max_wait_ms
        self.accepting = accepting
        self.check = check

    async def handle(self, call: JobCall) -> JobReply:
        try:
            return JobReply(200, await self._dispatch(call))
        except APIError as exc:
            return JobReply(
                exc.status_code, job_error_body(exc, job_id=call.job_id), dict(exc.headers)
            )

    async def _dispatch(self, call: JobCall) -> dict[str, Any]:
        allowed = VERBS.get(call.verb)
        if allowed is None:
            raise NotFoundError(f"/{call.verb} is not a job API route")
        methods, takes_id = allowed
        if call.method not in methods or takes_id != (call.job_id is not None):
            raise APIError(405, f"{call.method} /{call.verb}: wrong method or missing job id")
        jobs, owner = self.service, call.owner
        match call.verb:
            case "run":
                job = await self._submit(call, sync=False)
                return {"id": job.id, "status": job.status.value}
            case "runsync":
                wait_ms = self._wait_ms(call.query.get("wait"))
                accepted = await self._submit(call, sync=True)
                job = await jobs.wait(accepted.id, wait_ms / 1000, owner=owner)
                if not job.status.is_final:
                    return {"id": job.id, "status": job.status.value}
                return status_body(job)
            case "status":
                return status_body(await jobs.get(call.job_id, owner=owner))
            case "stream":
                job, chunks = await jobs.take_stream(call.job_id, owner=owner)
                reply: dict[str, Any] = {
                    "id": job.id,
                    "status": job.status.value,
                    "stream": [{"output": chunk} for chunk in chunks],
                }
                if job.error is not None:
                    reply["error"] = job.error
                return reply
            case "cancel":
                job = await jobs.cancel(call.job_id, owner=owner)
                return {"id": job.id, "status": job.status.value}
            case "retry":
                job = await jobs.retry(call.job_id, owner=owner)
                return {"id": job.id, "status": job.status.value}
            case "purge-queue":
                return {"removed": await jobs.purge_queue(owner=owner), "status": "completed"}
            case _:  # health
                return await jobs.health()

    async def _submit(self, call: JobCall, *, sync: bool) -> JobView:
        if self.accepting is not None:
            self.accepting()
        request = parse_job_request(call.body, self.limits)
        if request.webhook is not None:
            try:
                check_url(str(request.webhook), self.webhook_policy)
            except DestinationRefused as exc:
                raise BadRequestError(f"webhook: {exc}", param="webhook") from None
        if self.check is not None:
            self.check(request)
        return await self.service.submit(
            request,
            sync=sync,
            owner=call.caller,
            idempotency_key=None if sync else call.idempotency_key,
        )

    def _wait_ms(self, raw: str | None) -> int:
        if raw is None:
            return self.default_wait_ms
        if not (raw.isascii() and raw.isdigit()):
            raise BadRequestError(
                f"wait: must be a whole number of milliseconds, got {raw!r}", param="wait"
            )
        if int(raw) > self.max_wait_ms:
            raise BadRequestError(
                f"wait: at most {self.max_wait_ms} ms, got {raw}; use /run and /status for "
                "longer jobs",
                param="wait",
            )
        return int(raw)
