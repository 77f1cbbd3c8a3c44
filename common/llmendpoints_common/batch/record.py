"""A batch's record, the pure rules for how it changes, and how each API shows it.

One record per batch, whichever API made it. Every change is read -> one function below ->
compare-and-set (the stores' ``write``), as job records change: two writers -- the driver and
a client's cancel -- never lose each other's change.

OpenAI's lifecycle::

    validating -> in_progress -> finalizing -> completed
         |             |--(cancel)--> cancelling ----------> cancelled
         |             '--(window ends)------------------> expired
         '-> failed  (the input file is invalid: ``errors`` names the lines)

A batch that is cancelled or runs out of its window keeps what finished: its output and error
files are written (``ending`` says why) before it becomes ``cancelled`` or ``expired``, and every
request without an answer gets a line in the error file (``batch_cancelled``, ``batch_expired``).

RunPod's batch jobs add ``draft`` before the rest (requests may still be added) and show the
states their way (``DRAFT``, ``FINALIZED``, ``FAILED``, ``CANCELLED``; ``runpod_summary``).

Times are epoch seconds.
"""

from __future__ import annotations

import enum
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class BatchStatus(enum.StrEnum):
    DRAFT = "draft"
    VALIDATING = "validating"
    FAILED = "failed"
    IN_PROGRESS = "in_progress"
    FINALIZING = "finalizing"
    COMPLETED = "completed"
    EXPIRED = "expired"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"

    @property
    def ended(self) -> bool:
        return self in ENDED


ENDED = frozenset(
    {BatchStatus.FAILED, BatchStatus.COMPLETED, BatchStatus.EXPIRED, BatchStatus.CANCELLED}
)
# What the driver moves along (a draft only waits for its finalize, or its window's end).
DRIVEN = frozenset(
    {
        BatchStatus.VALIDATING,
        BatchStatus.IN_PROGRESS,
        BatchStatus.FINALIZING,
        BatchStatus.CANCELLING,
        BatchStatus.DRAFT,
    }
)

# The state a renderer shows for each status (RunPod has four).
_RUNPOD_STATUS = {
    BatchStatus.DRAFT: "DRAFT",
    BatchStatus.VALIDATING: "FINALIZED",
    BatchStatus.IN_PROGRESS: "FINALIZED",
    BatchStatus.FINALIZING: "FINALIZED",
    BatchStatus.COMPLETED: "FINALIZED",
    BatchStatus.CANCELLING: "FINALIZED",  # RunPod: CANCELLED once in-progress work drained
    BatchStatus.CANCELLED: "CANCELLED",
    BatchStatus.FAILED: "FAILED",
    BatchStatus.EXPIRED: "FAILED",
}

# Keys this server adds to an OpenAI batch's metadata (documented in docs/batch.md).
ESTIMATE_KEY = "llmep_estimated_completion_at"
ON_SCHEDULE_KEY = "llmep_on_schedule"
MAX_METADATA_PAIRS = 16


class Conflict(Exception):
    """The change does not apply to the batch's current state (the API answers 409)."""


def new_batch_id() -> str:
    return f"batch_{uuid.uuid4().hex}"


def line_job_id(batch_id: str, index: int) -> str:
    """The job id of a batch's ``index``-th request (0-based): the same on every attempt and
    every driver, so handing a request to the queue twice stores it once."""
    return f"{batch_id.removeprefix('batch_')}-{index}"


class Estimate(BaseModel):
    """Will the batch finish inside its window, at the rate it goes (``estimate.py``)."""

    model_config = ConfigDict(extra="ignore")

    rate: float | None = None  # requests finished per second, lately
    finish_at: float | None = None  # when the rest would be done at that rate
    on_schedule: bool | None = None  # None: not known yet


class BatchRecord(BaseModel):
    # Extra fields are dropped, not refused: a newer replica may write fields an older one
    # does not know (a rolling upgrade).
    model_config = ConfigDict(extra="ignore")

    id: str
    api: Literal["openai", "runpod"]
    owner: str  # the API key's name (never the key); "" with no keys
    created_at: float
    expires_at: float  # the completion window ends: requests not done by then are not run
    completion_window: str
    status: BatchStatus
    # The endpoint ("<namespace>/<name>") and model its requests run on; an OpenAI batch
    # learns them from its input file, while validating.
    endpoint: str | None = None
    model: str | None = None
    # OpenAI: the route every request goes to, and the input file. RunPod: None (job inputs).
    openai_endpoint: str | None = None
    input_file_id: str | None = None
    metadata: dict[str, str] | None = None
    # RunPod: the batch's display name, and where its terminal state is posted.
    name: str | None = None
    webhook: str | None = None
    # Why a batch is being finished before all its requests ran.
    ending: Literal["expired", "cancelled"] | None = None
    in_progress_at: float | None = None
    finalizing_at: float | None = None
    completed_at: float | None = None
    failed_at: float | None = None
    expired_at: float | None = None
    cancelling_at: float | None = None
    cancelled_at: float | None = None
    total: int = 0
    completed: int = 0
    failed: int = 0
    running: int = 0  # requests running now, as the driver last counted them
    cursor: int = 0  # requests handed to the queue so far (in order)
    parts: list[int] = Field(default_factory=list)  # requests per stored input part, in order
    part_ids: list[str] = Field(default_factory=list)  # the stored parts' names, in order
    parts_bytes: int = 0  # what the parts hold (counts against the key's stored bytes)
    # RunPod: requests removed from the draft (their index among the stored ones).
    removed: list[int] = Field(default_factory=list)
    output_file_id: str | None = None
    error_file_id: str | None = None
    errors: list[dict[str, Any]] | None = None
    input_tokens: int = 0
    output_tokens: int = 0
    # What its requests may cost in tokens (prompt estimate + max_tokens): the key's
    # enqueued-token limit counts it until the batch ends.
    tokens: int = 0
    output_ttl_seconds: float = 30 * 86_400
    estimate: Estimate | None = None
    # The driver moving the batch along, until when (a replica that dies lets it go).
    driver: str | None = None
    lease_until: float | None = None

    def encode(self) -> bytes:
        return self.model_dump_json(exclude_none=True).encode()

    @classmethod
    def decode(cls, data: bytes) -> BatchRecord:
        return cls.model_validate_json(data)

    @property
    def active(self) -> bool:
        return not self.status.ended

    @property
    def remaining(self) -> int:
        return max(0, self.total - self.completed - self.failed)

    @property
    def kept_until(self) -> float | None:
        """When the record (and its results) may go: its output's expiry once it ended."""
        end = self.ended_at
        return None if end is None else end + self.output_ttl_seconds

    @property
    def ended_at(self) -> float | None:
        return self.completed_at or self.failed_at or self.expired_at or self.cancelled_at


# ---- transitions (pure: a record in, a new record out) ------------------------------------


def _change(record: BatchRecord, **update: Any) -> BatchRecord:
    return record.model_copy(update=update)


def finalize_draft(record: BatchRecord, *, now: float) -> BatchRecord:
    """RunPod's ``/finalize``: the draft's requests are locked and start running."""
    if record.status is not BatchStatus.DRAFT:
        raise Conflict(f"batch {record.id} is {_runpod_word(record)}, not DRAFT")
    if record.total == 0:
        raise Conflict(f"batch {record.id} has no request to run; add requests first")
    return _change(record, status=BatchStatus.IN_PROGRESS, in_progress_at=now)


def add_part(record: BatchRecord, part_id: str, lines: int, tokens: int, size: int) -> BatchRecord:
    """RunPod: a draft gains a stored part of ``lines`` requests (``size`` bytes)."""
    _draft_only(record, "requests can be added")
    return _change(
        record,
        parts=[*record.parts, lines],
        part_ids=[*record.part_ids, part_id],
        parts_bytes=record.parts_bytes + size,
        total=record.total + lines,
        tokens=record.tokens + tokens,
    )


def remove_request(record: BatchRecord, index: int) -> BatchRecord:
    """RunPod: one request leaves the draft (its index among the stored requests)."""
    _draft_only(record, "requests can be removed")
    if not 0 <= index < sum(record.parts) or index in record.removed:
        raise KeyError(index)
    return _change(record, removed=sorted([*record.removed, index]), total=record.total - 1)


def _draft_only(record: BatchRecord, what: str) -> None:
    if record.status is not BatchStatus.DRAFT:
        raise Conflict(
            f"batch {record.id} is {_runpod_word(record)}: {what} only while it is DRAFT"
        )


def validated(
    record: BatchRecord,
    *,
    now: float,
    total: int,
    parts: list[int],
    part_ids: list[str],
    parts_bytes: int,
    model: str,
    endpoint: str,
    tokens: int,
) -> BatchRecord:
    """The input file is valid: its requests start running."""
    if record.status is not BatchStatus.VALIDATING:
        raise Conflict(f"batch {record.id} is {record.status.value}, not validating")
    return _change(
        record,
        status=BatchStatus.IN_PROGRESS,
        in_progress_at=now,
        total=total,
        parts=parts,
        part_ids=part_ids,
        parts_bytes=parts_bytes,
        model=model,
        endpoint=endpoint,
        tokens=tokens,
    )


def validation_failed(
    record: BatchRecord, errors: list[dict[str, Any]], *, now: float, model: str | None = None
) -> BatchRecord:
    if record.status is not BatchStatus.VALIDATING:
        raise Conflict(f"batch {record.id} is {record.status.value}, not validating")
    return _change(
        record, status=BatchStatus.FAILED, failed_at=now, errors=errors, model=model, tokens=0
    )


def request_cancel(record: BatchRecord, *, now: float) -> BatchRecord:
    """A client's cancel: queued requests will not run, running ones finish (then
    ``cancelled``). A draft has nothing running: it is cancelled at once."""
    if record.status is BatchStatus.DRAFT:
        return _change(
            record,
            status=BatchStatus.CANCELLED,
            cancelling_at=now,
            cancelled_at=now,
            tokens=0,
            parts_bytes=0,
        )
    if record.status is BatchStatus.CANCELLING:
        return record
    if record.status not in (BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS):
        raise Conflict(
            f"batch {record.id} is {record.status.value}; only a batch that is validating or "
            "in_progress can be cancelled"
        )
    if record.ending == "expired":
        raise Conflict(f"batch {record.id} is expiring; its results are being written")
    return _change(record, status=BatchStatus.CANCELLING, cancelling_at=now, ending="cancelled")


def expire(record: BatchRecord, *, now: float) -> BatchRecord:
    """The window ended: what did not run will not. A draft (RunPod) or a batch still
    validating ends at once; one that runs is finished (``ending``) and then ``expired``."""
    if record.status in (BatchStatus.DRAFT, BatchStatus.VALIDATING):
        return _change(
            record,
            status=BatchStatus.EXPIRED,
            expired_at=now,
            tokens=0,
            parts_bytes=0,
            errors=[
                {
                    "code": "batch_expired",
                    "message": "the completion window ended before the batch started",
                    "param": None,
                    "line": None,
                }
            ],
        )
    if record.status is not BatchStatus.IN_PROGRESS or record.ending is not None:
        return record
    return _change(record, ending="expired")


def progress(
    record: BatchRecord,
    *,
    cursor: int,
    completed: int,
    failed: int,
    running: int,
    estimate: Estimate | None,
) -> BatchRecord:
    return _change(
        record,
        cursor=cursor,
        completed=completed,
        failed=failed,
        running=running,
        estimate=estimate,
    )


def begin_finalizing(
    record: BatchRecord, *, now: float, output_file_id: str, error_file_id: str
) -> BatchRecord:
    """Every request has its answer (or never will): the files are being written. Their ids
    are fixed first, so a driver that takes over writes the same files."""
    if record.status not in (BatchStatus.IN_PROGRESS, BatchStatus.CANCELLING):
        raise Conflict(f"batch {record.id} is {record.status.value}")
    update: dict[str, Any] = {"output_file_id": output_file_id, "error_file_id": error_file_id}
    if record.status is BatchStatus.IN_PROGRESS and record.ending is None:
        update.update(status=BatchStatus.FINALIZING, finalizing_at=now)
    elif record.finalizing_at is None:
        update["finalizing_at"] = now
    return _change(record, **update)


def finished(
    record: BatchRecord,
    *,
    now: float,
    completed: int,
    failed: int,
    input_tokens: int,
    output_tokens: int,
    output_file_id: str | None,
    error_file_id: str | None,
) -> BatchRecord:
    """The files are written: the batch ends ``completed``, ``cancelled`` or ``expired``."""
    update: dict[str, Any] = {
        "completed": completed,
        "failed": failed,
        "running": 0,
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "output_file_id": output_file_id,
        "error_file_id": error_file_id,
        "tokens": 0,
        "parts_bytes": 0,
        "driver": None,
        "lease_until": None,
    }
    if record.status is BatchStatus.CANCELLING:
        update.update(status=BatchStatus.CANCELLED, cancelled_at=now)
    elif record.ending == "expired":
        update.update(status=BatchStatus.EXPIRED, expired_at=now)
    elif record.status is BatchStatus.FINALIZING:
        update.update(status=BatchStatus.COMPLETED, completed_at=now)
    else:
        raise Conflict(f"batch {record.id} is {record.status.value}")
    return _change(record, **update)


def storage_failed(record: BatchRecord, message: str, *, now: float) -> BatchRecord:
    """The results could not be stored (the store is full): the batch fails, saying so."""
    return _change(
        record,
        status=BatchStatus.FAILED,
        failed_at=now,
        tokens=0,
        parts_bytes=0,
        driver=None,
        lease_until=None,
        errors=[{"code": "storage_full", "message": message, "param": None, "line": None}],
    )


def take_lease(record: BatchRecord, *, holder: str, now: float, seconds: float) -> BatchRecord:
    """``holder`` drives the batch for ``seconds`` more; Conflict while another holds it."""
    if record.driver not in (None, holder) and (record.lease_until or 0) > now:
        raise Conflict(f"batch {record.id} is driven by {record.driver}")
    return _change(record, driver=holder, lease_until=now + seconds)


# ---- how the APIs show a batch -----------------------------------------------------------


def _ts(value: float | None) -> int | None:
    return None if value is None else int(value)


def openai_status(record: BatchRecord) -> str:
    if record.status is BatchStatus.DRAFT:  # a RunPod draft seen through /v1/batches
        return BatchStatus.VALIDATING.value
    return record.status.value


def openai_object(record: BatchRecord) -> dict[str, Any]:
    """OpenAI's ``Batch`` object."""
    metadata = dict(record.metadata or {})
    estimate = record.estimate
    if record.active and estimate is not None and estimate.finish_at is not None:
        metadata[ESTIMATE_KEY] = str(int(estimate.finish_at))
    if record.active and estimate is not None and estimate.on_schedule is not None:
        metadata[ON_SCHEDULE_KEY] = "true" if estimate.on_schedule else "false"
    return {
        "id": record.id,
        "object": "batch",
        "endpoint": record.openai_endpoint or "",
        "model": record.model,
        "errors": {"object": "list", "data": record.errors} if record.errors else None,
        "input_file_id": record.input_file_id or "",
        "completion_window": record.completion_window,
        "status": openai_status(record),
        "output_file_id": record.output_file_id if record.status.ended else None,
        "error_file_id": record.error_file_id if record.status.ended else None,
        "created_at": int(record.created_at),
        "in_progress_at": _ts(record.in_progress_at),
        "expires_at": _ts(record.expires_at),
        "finalizing_at": _ts(record.finalizing_at),
        "completed_at": _ts(record.completed_at),
        "failed_at": _ts(record.failed_at),
        "expired_at": _ts(record.expired_at),
        "cancelling_at": _ts(record.cancelling_at),
        "cancelled_at": _ts(record.cancelled_at),
        "request_counts": {
            "total": record.total,
            "completed": record.completed,
            "failed": record.failed,
        },
        "usage": {
            "input_tokens": record.input_tokens,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": record.output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": record.input_tokens + record.output_tokens,
        },
        "metadata": metadata or None,
    }


def _runpod_word(record: BatchRecord) -> str:
    return _RUNPOD_STATUS[record.status]


def runpod_summary(record: BatchRecord, endpoint_name: str) -> dict[str, Any]:
    """RunPod's batch summary (``GET /v2/{endpoint}/batch/{id}``), plus the window's end and
    the estimate (names of ours, documented in docs/batch.md)."""
    summary: dict[str, Any] = {
        "id": record.id,
        "endpointId": endpoint_name,
        "status": _runpod_word(record),
        "requestTotal": record.total,
        "requestInProgress": record.running if record.active else 0,
        "requestCompleted": record.completed,
        "requestFailed": record.failed,
        "createdAt": int(record.created_at * 1000),
        "expiresAt": int(record.expires_at * 1000),
    }
    if record.name is not None:
        summary["name"] = record.name
    if record.errors:
        summary["error"] = "; ".join(str(e.get("message")) for e in record.errors)
    estimate = record.estimate
    if record.active and estimate is not None:
        if estimate.finish_at is not None:
            summary["estimatedCompletionAt"] = int(estimate.finish_at * 1000)
        if estimate.on_schedule is not None:
            summary["onSchedule"] = estimate.on_schedule
    return summary
