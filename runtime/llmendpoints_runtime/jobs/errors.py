"""Errors of the job API, each carrying the HTTP status and the JSON body a client sees.

Every failure a client can observe -- a rejected request or a job that ends ``FAILED`` -- is
described by the same object, ``{"error": {"message": ..., "type": ...}}`` (plus ``param``
when one field is to blame), so clients need one error path, never a Python repr.
"""

from __future__ import annotations

from typing import Any


class JobAPIError(Exception):
    """A request the job API refuses, or a job that cannot complete."""

    status_code: int = 500
    error_type: str = "InternalServerError"

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param

    def to_error(self) -> dict[str, Any]:
        """The ``error`` object: ``{"message", "type"}`` and ``param`` when known."""
        error: dict[str, Any] = {"message": self.message, "type": self.error_type}
        if self.param is not None:
            error["param"] = self.param
        return error

    def to_body(self) -> dict[str, Any]:
        return {"error": self.to_error()}


class InvalidRequest(JobAPIError):
    """The request body or a field in it is wrong (400)."""

    status_code = 400
    error_type = "BadRequestError"


class PayloadTooLarge(JobAPIError):
    status_code = 413
    error_type = "PayloadTooLargeError"


class JobNotFound(JobAPIError):
    status_code = 404
    error_type = "NotFoundError"

    def __init__(self, job_id: str) -> None:
        super().__init__(
            f"no job with id {job_id!r}: it never existed, or its result expired "
            "(policy.ttl) and was removed",
            param="id",
        )


class WrongJobState(JobAPIError):
    """Cancel or retry asked of a job in a state that does not allow it (409)."""

    status_code = 409
    error_type = "ConflictError"


class QueueFull(JobAPIError):
    status_code = 429
    error_type = "RateLimitError"


class EngineUnavailable(JobAPIError):
    """The engine failed to start or died; jobs cannot run on this replica (503)."""

    status_code = 503
    error_type = "ServiceUnavailableError"


class JobFailed(JobAPIError):
    """A job that ran and failed: the engine or the OpenAI route reported an error."""

    def __init__(self, message: str, *, error_type: str, status_code: int = 500) -> None:
        super().__init__(message)
        self.error_type = error_type
        self.status_code = status_code


def error_from_exception(exc: BaseException) -> dict[str, Any]:
    """The ``error`` object for any exception that ended a job."""
    if isinstance(exc, JobAPIError):
        return exc.to_error()
    text = str(exc) or "no details"
    return {"message": f"{type(exc).__name__}: {text}", "type": "InternalServerError"}
