"""Where jobs live: a small async interface and the in-pod implementation.

The in-memory store keeps at most ``max_jobs`` jobs and forgets finished ones ``ttl`` after
they finish. It lives in one pod: with several replicas behind one Service, a ``/status`` may
land on a replica that never saw the job. Until a shared store (Redis, a database) implements
``JobStore``, use the job API with one replica or with sticky routing.
"""

from __future__ import annotations

import heapq
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from llmendpoints_common.errors import RateLimitError

from llmendpoints_runtime.jobs.models import JobRequest, JobStatus


@dataclass
class Job:
    """One job and everything a client can ask about it. Times are epoch seconds."""

    id: str
    request: JobRequest
    sync: bool
    ttl_seconds: float
    status: JobStatus = JobStatus.IN_QUEUE
    # The name of the API key that submitted it ("" without keys); never the key itself.
    owner: str = ""
    submitted_at: float = 0.0
    started_at: float | None = None
    finished_at: float | None = None
    attempts: int = 0
    output: Any = None
    error: dict[str, Any] | None = None
    # What /stream hands out; ``stream_cursor`` is how far the last poll read.
    chunks: list[Any] = field(default_factory=list)
    stream_cursor: int = 0

    @property
    def engine_request_id(self) -> str:
        # A new id per attempt, so a retry never collides with the aborted attempt.
        return f"job-{self.id}-{self.attempts}"

    def expires_at(self) -> float | None:
        return None if self.finished_at is None else self.finished_at + self.ttl_seconds

    def reset_for_retry(self) -> None:
        self.status = JobStatus.IN_QUEUE
        self.started_at = self.finished_at = None
        self.output = self.error = None
        self.chunks = []
        self.stream_cursor = 0


class JobStore(Protocol):
    async def add(self, job: Job) -> None:
        """Store a new job; raise RateLimitError when the store cannot take more."""
        ...

    async def get(self, job_id: str) -> Job | None:
        """The job, or None if unknown or expired."""
        ...

    async def save(self, job: Job) -> None:
        """Persist changes made to a job (a no-op in memory; a shared store writes it)."""
        ...

    async def in_state(self, status: JobStatus) -> list[Job]: ...

    async def counts(self) -> Counter[JobStatus]: ...


class InMemoryJobStore:
    def __init__(self, max_jobs: int, clock: Callable[[], float] = time.time) -> None:
        self._max_jobs = max_jobs
        self._clock = clock
        self._jobs: OrderedDict[str, Job] = OrderedDict()  # insertion order = age
        # (expires_at, job id) of finished jobs; stale entries are skipped when popped.
        self._expiry: list[tuple[float, str]] = []

    async def add(self, job: Job) -> None:
        self._expire()
        if len(self._jobs) >= self._max_jobs:
            self._evict_oldest_finished()
        if len(self._jobs) >= self._max_jobs:
            raise RateLimitError(
                f"this replica holds {self._max_jobs} unfinished jobs, its limit; "
                "retry later (MAX_STORED_JOBS raises the limit)"
            )
        self._jobs[job.id] = job

    async def get(self, job_id: str) -> Job | None:
        self._expire()
        return self._jobs.get(job_id)

    async def save(self, job: Job) -> None:
        if job.id in self._jobs:
            self._jobs[job.id] = job
            if (expires := job.expires_at()) is not None:
                heapq.heappush(self._expiry, (expires, job.id))

    async def in_state(self, status: JobStatus) -> list[Job]:
        self._expire()
        return [job for job in self._jobs.values() if job.status is status]

    async def counts(self) -> Counter[JobStatus]:
        self._expire()
        return Counter(job.status for job in self._jobs.values())

    def __len__(self) -> int:
        return len(self._jobs)

    def _expire(self) -> None:
        now = self._clock()
        while self._expiry and self._expiry[0][0] <= now:
            _, job_id = heapq.heappop(self._expiry)
            job = self._jobs.get(job_id)
            if job is not None and (expires := job.expires_at()) is not None and expires <= now:
                del self._jobs[job_id]

    def _evict_oldest_finished(self) -> None:
        for job_id, job in self._jobs.items():
            if job.status.is_final:
                del self._jobs[job_id]
                return
