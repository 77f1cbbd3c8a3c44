"""A job as the shared queue keeps it, and the pure rules for how its state may change.

One record per job (the value of ``rec.<job id>`` in the endpoint's ``LLMEP_RECORDS_<ns>_<name>``).
Every writer
-- the pod or gateway that accepted the job, the worker running it, whoever cancels, retries or
reads its stream -- reads the record, applies one of the functions below, and writes the result
back only if nobody wrote in between (compare-and-set on the key's revision). So each change is
decided on the latest state, and exactly one writer moves a job into a final state: that writer
alone sends the webhook.

Times are epoch seconds.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

from llmendpoints_common.jobs.models import FINAL_STATUSES, JobStatus

RETRYABLE = frozenset({JobStatus.FAILED, JobStatus.TIMED_OUT})


class JobUsage(BaseModel):
    """What the engine produced for a job that ended without an output (TIMED_OUT, or
    CANCELLED while it ran): the prompt's tokens and the tokens generated up to the stop, as
    vLLM counts them. A COMPLETED job's usage is in its output."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    prompt_tokens: int = 0
    completion_tokens: int = 0

    @property
    def total(self) -> int:
        return self.prompt_tokens + self.completion_tokens


class RunEnd(BaseModel):
    """How a run that /retry started again had ended, and what it used."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    run: int
    status: JobStatus
    usage: JobUsage


class JobRecord(BaseModel):
    # Extra fields are kept out, not refused: during a rolling upgrade a newer pod may write
    # fields an older one does not know.
    model_config = ConfigDict(extra="ignore")

    id: str
    # The endpoint's id, "<namespace>/<name>".
    endpoint: str
    # The name of the API key that submitted the job (never the key); "" with no keys.
    owner: str
    # The validated job request as JSON (input, webhook, policy). Once the job ends for good
    # (COMPLETED, CANCELLED) its ``input`` is dropped: the result is kept, not the request.
    # FAILED and TIMED_OUT jobs keep it while their result is kept, for /retry.
    request: dict[str, Any]
    sync: bool
    status: JobStatus = JobStatus.IN_QUEUE
    submitted_at: float
    started_at: float | None = None
    finished_at: float | None = None
    # How long the result is kept after the job ends (30 min after /run, 1 min after /runsync,
    # as RunPod keeps them) -- never past ``ttl_seconds``.
    retention_seconds: float
    # policy.ttl: the job's whole life from submission; queued, running or finished, its record
    # is gone after it. None in records written before the field existed.
    ttl_seconds: float | None = None
    # Engine attempts ever made; names the engine request and tags stream chunks, so a chunk of
    # an abandoned attempt is never mistaken for one of the current attempt.
    attempt: int = 0
    # Attempts in the current run (bounded by the queue's max attempts); /retry starts a new run.
    tries: int = 0
    runs: int = 1
    # How many chunks of the current attempt /stream has handed out (a new attempt starts at 0:
    # its chunks are its own subjects, llmep.chunks.<ns>.<name>.<id>.<attempt>.<n>).
    stream_cursor: int = 0
    worker: str | None = None
    output: Any = None
    error: dict[str, Any] | None = None
    # The batch whose request this job is (``batch_<hex>``): it runs in the batch lane, below
    # every other job, and with a lower priority inside the engine.
    batch: str | None = None
    # TIMED_OUT, or CANCELLED while it ran: what the run's last attempt used up to the stop,
    # written by its worker (with the TIMED_OUT itself; after the CANCELLED, which whoever
    # cancelled wrote). None: nothing ran, or a pod older than the field ended it. The
    # gateway's JobUsageMeter bills it once per run.
    usage: JobUsage | None = None
    # The run before this one, when /retry started it again after a billable end (TIMED_OUT):
    # kept so that the meter bills it even when it reads the record only after the retry
    # replaced the end it was to bill.
    ended_run: RunEnd | None = None

    @property
    def low_priority(self) -> bool:
        return bool(self.request.get("policy", {}).get("lowPriority", False))

    @property
    def lane(self) -> str:
        """The queue lane (``names.PRIORITIES``) its messages go to."""
        if self.batch is not None:
            return "batch"
        return "low" if self.low_priority else "normal"

    @property
    def webhook(self) -> str | None:
        return self.request.get("webhook")

    @property
    def execution_timeout_ms(self) -> int | None:
        return self.request.get("policy", {}).get("executionTimeout")

    @property
    def engine_request_id(self) -> str:
        return f"job-{self.id}-{self.attempt}"

    def encode(self) -> bytes:
        return self.model_dump_json().encode()

    @classmethod
    def decode(cls, data: bytes) -> JobRecord:
        return cls.model_validate_json(data)


def expires_at(record: JobRecord) -> float | None:
    """When the record goes: its retention after it ends, never past its ttl (None: not
    before it ends)."""
    ends = []
    if record.ttl_seconds is not None:
        ends.append(record.submitted_at + record.ttl_seconds)
    if record.finished_at is not None:
        ends.append(record.finished_at + record.retention_seconds)
    return min(ends) if ends else None


def record_ttl(record: JobRecord, now: float) -> float | None:
    """How long a record is still kept from ``now`` (at least 1 s; None: unbounded)."""
    end = expires_at(record)
    return None if end is None else max(1.0, end - now)


def without_input(request: dict[str, Any], status: JobStatus) -> dict[str, Any]:
    """The request a finished job keeps: no ``input`` unless /retry may still need it."""
    if status in RETRYABLE or "input" not in request:
        return request
    return {key: value for key, value in request.items() if key != "input"}


class Conflict(Exception):
    """The change does not apply to the job's current state (the caller answers 409)."""


# ---- transitions (pure: a record in, a new record out) ------------------------------------


def claim(record: JobRecord, *, now: float, worker: str) -> JobRecord:
    """A worker starts an attempt of a queued job, or takes over one whose worker vanished
    (the queue redelivered it after a heartbeat timeout: the record still says IN_PROGRESS)."""
    if record.status not in (JobStatus.IN_QUEUE, JobStatus.IN_PROGRESS):
        raise Conflict(f"job {record.id} is {record.status.value}")
    return record.model_copy(
        update={
            "status": JobStatus.IN_PROGRESS,
            "started_at": record.started_at if record.started_at is not None else now,
            "attempt": record.attempt + 1,
            "tries": record.tries + 1,
            "worker": worker,
            "stream_cursor": 0,
        }
    )


def out_of_attempts(record: JobRecord, max_attempts: int) -> bool:
    """True when a redelivered job has used all its attempts and must end ``FAILED``."""
    return record.tries >= max_attempts


def gave_up_error(record: JobRecord, max_attempts: int) -> dict[str, Any]:
    last = f" (the last one on {record.worker})" if record.worker else ""
    return {
        "message": (
            f"the job was attempted {record.tries} times and no attempt finished{last}: each "
            f"worker stopped answering (killed or cut off from the queue) while running it; "
            f"at most {max_attempts} attempts are made (LLMEP_JOBS_MAX_ATTEMPTS)"
        ),
        "type": "InternalServerError",
        "param": None,
        "code": "attempts_exhausted",
    }


def finish(
    record: JobRecord,
    status: JobStatus,
    *,
    now: float,
    attempt: int | None = None,
    output: Any = None,
    error: dict[str, Any] | None = None,
    usage: JobUsage | None = None,
) -> JobRecord:
    """End the job. ``attempt`` (a worker's own attempt number) makes a worker whose attempt
    was superseded -- cancelled, or taken over after it looked dead -- change nothing."""
    if record.status in FINAL_STATUSES:
        raise Conflict(f"job {record.id} already ended {record.status.value}")
    if attempt is not None and (
        record.attempt != attempt or record.status != JobStatus.IN_PROGRESS
    ):
        raise Conflict(f"attempt {attempt} of job {record.id} is no longer the current one")
    return record.model_copy(
        update={
            "status": status,
            "finished_at": now,
            "started_at": record.started_at
            if record.started_at is not None or status is JobStatus.CANCELLED
            else now,
            "output": output if status is JobStatus.COMPLETED else None,
            "error": error,
            "usage": usage if status in (JobStatus.TIMED_OUT, JobStatus.CANCELLED) else None,
            "request": without_input(record.request, status),
        }
    )


def cancel(record: JobRecord, *, now: float) -> JobRecord:
    if record.status not in (JobStatus.IN_QUEUE, JobStatus.IN_PROGRESS):
        raise Conflict(
            f"job {record.id} is {record.status.value}; only IN_QUEUE or IN_PROGRESS jobs can "
            "be cancelled"
        )
    return finish(record, JobStatus.CANCELLED, now=now)


def with_usage(record: JobRecord, usage: JobUsage, *, attempt: int) -> JobRecord:
    """The worker of a cancelled attempt adds what it used to the CANCELLED record (whoever
    cancelled wrote the end, not knowing it). Once, and only for its own attempt."""
    if (
        record.status is not JobStatus.CANCELLED
        or record.attempt != attempt
        or record.usage is not None
    ):
        raise Conflict(f"job {record.id}: attempt {attempt}'s usage does not apply")
    return record.model_copy(update={"usage": usage})


def requeue_for_retry(record: JobRecord) -> JobRecord:
    """``/retry``: a FAILED or TIMED_OUT job runs again from the start, as a new run."""
    if record.status not in RETRYABLE:
        raise Conflict(
            f"job {record.id} is {record.status.value}; only FAILED or TIMED_OUT jobs can be "
            "retried"
        )
    return record.model_copy(
        update={
            "status": JobStatus.IN_QUEUE,
            "started_at": None,
            "finished_at": None,
            "output": None,
            "error": None,
            "usage": None,
            "tries": 0,
            "runs": record.runs + 1,
            "worker": None,
            "ended_run": (
                RunEnd(run=record.runs, status=record.status, usage=record.usage)
                if record.usage is not None
                else None
            ),
        }
    )
