"""What each request of a batch came to, as the output and error files say it (pure).

Every line of the input gets exactly one line, in one of the two files, whatever happened to it
(OpenAI's ``BatchRequestOutput``)::

    {"id": "batch_req_...", "custom_id": "...", "response": {"status_code": 200,
     "request_id": "...", "body": {...}}, "error": null}

- answered 2xx: the output file, with the endpoint's answer as ``body``;
- answered with an error (the engine refused it: 400, a limit: 413, it failed: 500): the error
  file, ``response.status_code`` the error's status and ``body`` ``{"error": {...}}``, as the
  route would have answered it;
- never answered: the error file, ``response`` null and ``error`` one of OpenAI's codes --
  ``batch_expired`` (the window ended first), ``batch_cancelled`` (the batch was cancelled
  first), ``request_timeout`` (the request ran out of its time).

RunPod's view of the same requests: ``runpod_request``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from llmendpoints_common.errors import error_type
from llmendpoints_common.jobs.models import JobStatus

_STATUS_OF_TYPE: dict[str, int] = {}
for _code in (400, 401, 403, 404, 405, 408, 409, 413, 415, 422, 429, 500, 502, 503, 504):
    _STATUS_OF_TYPE[error_type(_code)] = _code


@dataclass(frozen=True)
class LineOutcome:
    """A request's state: its job's, or None for a request never handed to the queue."""

    status: JobStatus | None
    output: Any = None
    error: dict[str, Any] | None = None
    started_at: float | None = None
    finished_at: float | None = None

    @property
    def final(self) -> bool:
        return self.status is not None and self.status.is_final

    @property
    def succeeded(self) -> bool:
        return self.status is JobStatus.COMPLETED


NOT_QUEUED = LineOutcome(None)


def error_status(error: dict[str, Any] | None) -> int:
    """The HTTP status an error object stands for (its ``code`` when that is one)."""
    if not error:
        return 500
    code = error.get("code")
    if isinstance(code, int) and 400 <= code <= 599:
        return code
    return _STATUS_OF_TYPE.get(str(error.get("type")), 500)


def _request_id(job_id: str) -> str:
    return f"req_{job_id.replace('-', '_')}"


def openai_line(
    job_id: str, custom_id: str, outcome: LineOutcome, ending: str | None
) -> tuple[bool, dict[str, Any]]:
    """(True: the output file / False: the error file, the line)."""
    line: dict[str, Any] = {"id": f"batch_req_{job_id.replace('-', '_')}", "custom_id": custom_id}
    status = outcome.status
    if status is JobStatus.COMPLETED:
        line["response"] = {
            "status_code": 200,
            "request_id": _request_id(job_id),
            "body": outcome.output,
        }
        line["error"] = None
        return True, line
    if status is JobStatus.FAILED and outcome.error is not None:
        line["response"] = {
            "status_code": error_status(outcome.error),
            "request_id": _request_id(job_id),
            "body": {"error": outcome.error},
        }
        line["error"] = None
        return False, line
    line["response"] = None
    if status is JobStatus.TIMED_OUT:
        message = (outcome.error or {}).get("message") or "the request ran out of time"
        line["error"] = {"code": "request_timeout", "message": message}
    elif ending == "expired":
        line["error"] = {
            "code": "batch_expired",
            "message": "This request could not be executed before the completion window expired.",
        }
    else:
        line["error"] = {
            "code": "batch_cancelled",
            "message": "This request was not executed because the batch was cancelled.",
        }
    return False, line


def encode_line(line: dict[str, Any]) -> bytes:
    return json.dumps(line, separators=(",", ":")).encode() + b"\n"


def usage_of(output: Any) -> tuple[int, int]:
    """(prompt, completion) tokens of an answer that reports its usage, else (0, 0)."""
    if isinstance(output, dict) and isinstance(output.get("usage"), dict):
        usage = output["usage"]
        prompt = usage.get("prompt_tokens")
        completion = usage.get("completion_tokens")
        return (
            prompt if isinstance(prompt, int) else 0,
            completion if isinstance(completion, int) else 0,
        )
    if isinstance(output, list):  # a prompt job's batches: the last usage is cumulative
        for item in reversed(output):
            usage = item.get("usage") if isinstance(item, dict) else None
            if isinstance(usage, dict) and isinstance(usage.get("input"), int):
                return usage["input"], int(usage.get("output") or 0)
    return 0, 0


def _iso(value: float | None) -> str | None:
    if value is None:
        return None
    return datetime.fromtimestamp(value, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def runpod_request(job_id: str, outcome: LineOutcome, ending: str | None) -> dict[str, Any]:
    """One entry of RunPod's ``GET /v2/{endpoint}/batch/{id}/requests``."""
    status = outcome.status
    if status is None:
        status_text = "CANCELLED" if ending is not None else "IN_QUEUE"
    else:
        status_text = status.value
    entry: dict[str, Any] = {"id": job_id, "status": status_text}
    if status is JobStatus.COMPLETED:
        entry["output"] = outcome.output
    elif outcome.error is not None:
        entry["error"] = str(outcome.error.get("message") or outcome.error)
    elif status is None and ending is not None:
        entry["error"] = (
            "the batch's completion window ended before this request ran"
            if ending == "expired"
            else "the batch was cancelled before this request ran"
        )
    if (started := _iso(outcome.started_at)) is not None:
        entry["startedAt"] = started
    if (done := _iso(outcome.finished_at)) is not None:
        entry["completedAt"] = done
    return entry
