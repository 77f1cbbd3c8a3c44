"""The job API's verbs, as the HTTP routes call them, whoever keeps the jobs.

Two implementations: the runtime's in-pod ``JobExecutor`` (jobs live in the pod that accepted
them) and ``llmendpoints_common.queue.client.QueueJobService`` (jobs live in the shared queue;
used by every runtime pod and by the gateway). The routes pick none: the runtime's wiring
chooses by ``JOBS_QUEUE_URL``.

Every verb but ``health`` takes the caller's ``owner``: the name of the API key that made the
request (a short hash of the key when keys have no names, "" when the server has no keys), or
None for an admin key, which reaches every job. A job of another owner is answered exactly like
a job that does not exist (404), so ids cannot be probed.
"""

from __future__ import annotations

import hashlib
from typing import Any, Protocol

from llmendpoints_common.jobs.models import JobRequest, JobStatus


class JobView(Protocol):
    """What the routes read of a job (both stores' job objects have these)."""

    id: str
    status: JobStatus
    output: Any
    error: dict[str, Any] | None
    submitted_at: float
    started_at: float | None
    finished_at: float | None


class JobService(Protocol):
    async def submit(
        self,
        request: JobRequest,
        *,
        sync: bool,
        owner: str,
        idempotency_key: str | None = None,
    ) -> JobView:
        """Accept a job; raise (429, 503, ...) rather than return an id for a job not stored."""
        ...

    async def wait(self, job_id: str, timeout_seconds: float, *, owner: str | None) -> JobView:
        """The job once it ends, or its latest state when the time runs out."""
        ...

    async def get(self, job_id: str, *, owner: str | None) -> JobView: ...

    async def take_stream(self, job_id: str, *, owner: str | None) -> tuple[JobView, list[Any]]:
        """The chunks produced since the last call (by any caller), in order."""
        ...

    async def cancel(self, job_id: str, *, owner: str | None) -> JobView: ...

    async def retry(self, job_id: str, *, owner: str | None) -> JobView: ...

    async def purge_queue(self, *, owner: str | None) -> int:
        """Cancel the owner's queued jobs (everyone's for None); how many."""
        ...

    async def health(self) -> dict[str, Any]: ...


def key_owner(key: str) -> str:
    """The owner name of a key that has no name: a short hash, never the key itself."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:12]


def status_body(job: JobView) -> dict[str, Any]:
    """What ``/status``, ``/runsync`` and the webhook report about a job (RunPod's shape)."""
    body: dict[str, Any] = {"id": job.id, "status": job.status.value}
    if job.status is JobStatus.COMPLETED:
        body["output"] = job.output
    if job.error is not None:
        body["error"] = job.error
    if job.started_at is not None:
        body["delayTime"] = _ms(job.submitted_at, job.started_at)
    if job.finished_at is not None and job.started_at is not None:
        body["executionTime"] = _ms(job.started_at, job.finished_at)
    # RunPod names the worker that ran (or runs) the job; the shared queue knows it.
    if (worker := getattr(job, "worker", None)) is not None:
        body["workerId"] = worker
    # A job stopped before its end (TIMED_OUT, CANCELLED while it ran) has no output; what it
    # used up to the stop is what it is billed (a COMPLETED job's usage is in its output).
    if (usage := getattr(job, "usage", None)) is not None:
        body["usage"] = {"input": usage.prompt_tokens, "output": usage.completion_tokens}
    return body


def _ms(start: float, end: float) -> int:
    return max(0, round((end - start) * 1000))
