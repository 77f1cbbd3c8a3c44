"""Where jobs live: a small async interface and the in-pod implementation.

The in-memory store keeps at most ``max_jobs`` jobs and ``max_bytes`` bytes of them (the JSON
size of each job's request while it is kept, and of its result), and forgets a finished job
when its retention ends (30 min after a /run, 1 min after a /runsync), never past its
``policy.ttl`` from submission. When full it drops the oldest finished jobs first; with only
unfinished jobs left, a new job is refused (429). It lives in one pod: with several replicas behind one Service, a ``/status`` may
land on a replica that never saw the job. Until a shared store (Redis, a database) implements
``JobStore``, use the job API with one replica or with sticky routing.
"""

from __future__ import annotations

import heapq
import json
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from llmendpoints_common.errors import RateLimitError
from llmendpoints_common.jobs.record import JobUsage

from llmendpoints_runtime.jobs.models import JobRequest, JobStatus


@dataclass
class Job:
    """One job and everything a client can ask about it. Times are epoch seconds."""

    id: str
    # Once the job ends for good (COMPLETED, CANCELLED) the executor drops the request's
    # input (``input`` is None then): the result is kept, not the request.
    request: JobRequest
    sync: bool
    # policy.ttl: the job's whole life from submission.
    ttl_seconds: float
    # How long the result is kept after the job ends (never past ``ttl_seconds``).
    retention_seconds: float = 30 * 60.0
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
    # TIMED_OUT, or CANCELLED while it ran: what it used until the stop (status reports it).
    usage: JobUsage | None = None

    @property
    def engine_request_id(self) -> str:
        # A new id per attempt, so a retry never collides with the aborted attempt.
        return f"job-{self.id}-{self.attempts}"

    def expires_at(self) -> float | None:
        """Unfinished jobs stay (the executor ends them by their ttl); finished ones go when
        their retention ends, or their ttl, whichever is first."""
        if self.finished_at is None:
            return None
        return min(self.finished_at + self.retention_seconds, self.submitted_at + self.ttl_seconds)

    @property
    def life_ends_at(self) -> float:
        return self.submitted_at + self.ttl_seconds

    def reset_for_retry(self) -> None:
        self.status = JobStatus.IN_QUEUE
        self.started_at = self.finished_at = None
        self.output = self.error = self.usage = None
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


def job_size(job: Job) -> int:
    """Bytes a job holds, as JSON: its request (what is left of it) and its result. Stream
    chunks are the result's own pieces (the same objects), so they are not counted twice."""
    size = len(job.request.model_dump_json())
    if job.output is not None:
        size += len(json.dumps(job.output, default=str))
    if job.error is not None:
        size += len(json.dumps(job.error, default=str))
    return size


class InMemoryJobStore:
    def __init__(
        self,
        max_jobs: int,
        clock: Callable[[], float] = time.time,
        *,
        max_bytes: int | None = None,
    ) -> None:
        self._max_jobs = max_jobs
        self._max_bytes = max_bytes
        self._clock = clock
        self._jobs: OrderedDict[str, Job] = OrderedDict()  # insertion order = age
        # (expires_at, job id) of finished jobs; stale entries are skipped when popped.
        self._expiry: list[tuple[float, str]] = []
        self._sizes: dict[str, int] = {}
        self.bytes = 0

    async def add(self, job: Job) -> None:
        self._expire()
        size = job_size(job) if self._max_bytes is not None else 0
        while self._over(extra_jobs=1, extra_bytes=size) and self._evict_oldest_finished():
            pass
        if len(self._jobs) >= self._max_jobs:
            raise RateLimitError(
                f"this replica holds {self._max_jobs} unfinished jobs, its limit; "
                "retry later (MAX_STORED_JOBS raises the limit)"
            )
        if self._max_bytes is not None and self.bytes + size > self._max_bytes:
            raise RateLimitError(
                f"this replica's unfinished jobs hold {self.bytes} bytes and this one {size}; "
                f"the limit is {self._max_bytes} bytes (MAX_STORED_JOB_BYTES); retry later"
            )
        self._jobs[job.id] = job
        self._account(job.id, size)

    async def get(self, job_id: str) -> Job | None:
        self._expire()
        return self._jobs.get(job_id)

    async def save(self, job: Job) -> None:
        if job.id in self._jobs:
            self._jobs[job.id] = job
            if (expires := job.expires_at()) is not None:
                heapq.heappush(self._expiry, (expires, job.id))
            if self._max_bytes is not None and job.status.is_final:
                # The input may be gone and the result has come: count what is kept now,
                # and make room for it among the older finished jobs.
                self._account(job.id, job_size(job))
                while self._over() and self._evict_oldest_finished(keep=job.id):
                    pass

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
                self._remove(job_id)

    def _over(self, *, extra_jobs: int = 0, extra_bytes: int = 0) -> bool:
        if len(self._jobs) + extra_jobs > self._max_jobs:
            return True
        return self._max_bytes is not None and self.bytes + extra_bytes > self._max_bytes

    def _evict_oldest_finished(self, keep: str | None = None) -> bool:
        for job_id, job in self._jobs.items():
            if job.status.is_final and job_id != keep:
                self._remove(job_id)
                return True
        return False

    def _account(self, job_id: str, size: int) -> None:
        self.bytes += size - self._sizes.get(job_id, 0)
        self._sizes[job_id] = size

    def _remove(self, job_id: str) -> None:
        del self._jobs[job_id]
        self.bytes -= self._sizes.pop(job_id, 0)
