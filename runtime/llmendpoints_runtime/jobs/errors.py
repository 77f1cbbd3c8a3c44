"""The job API's one error of its own; every other error is from ``llmendpoints_common.errors``.

Routes, the executor and the engine raise the shared types (``BadRequestError``,
``ConflictError``, ``RateLimitError``...); the runtime's one exception handler renders them, in
the job envelope on job routes (``llmendpoints_common.errors.job_error_body``).
"""

from __future__ import annotations

from llmendpoints_common.errors import NotFoundError


class JobNotFound(NotFoundError):
    """No job with this id: it never existed, or its result expired (404)."""

    def __init__(self, job_id: str) -> None:
        super().__init__(
            f"no job with id {job_id!r}: it never existed, or its result expired "
            "(policy.ttl) and was removed",
            param="id",
        )
        self.job_id = job_id
