"""Rendering errors over HTTP: the one exception handler of the runtime.

The error types and their bodies are ``llmendpoints_common.errors`` (shared with the gateway);
this module only puts them on the wire. Routes raise, the handler answers: OpenAI's
``{"error": {"message", "type", "param", "code"}}`` everywhere, and on job routes (tagged
``JOBS_TAG``) the job envelope, the same error object with the ``id`` of the job the request
named. ASGI middleware that runs before any framework answers with ``send_error``.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from llmendpoints_common.errors import (
    APIError,
    BadRequestError,
    InternalServerError,
    describe_validation_errors,
    job_error_body,
)
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Send

logger = logging.getLogger("llmendpoints.errors")

# The OpenAPI tag of the job API's routes; errors on them are answered in the job envelope.
JOBS_TAG = "jobs"


# -- the error bodies, as OpenAPI documents them -----------------------------------------------


class ErrorObject(BaseModel):
    message: str
    type: str = Field(description="The OpenAI SDK's name for the status: BadRequestError...")
    param: str | None = Field(description="The request field to blame, if one is")
    code: int | str = Field(description="The HTTP status, or a more specific code")


class ErrorBody(BaseModel):
    """OpenAI's error body."""

    error: ErrorObject


class JobErrorBody(BaseModel):
    """The job API's error envelope: the error, and the id of the job the request named."""

    id: str | None = None
    error: ErrorObject


_WHEN = {
    400: "The request is malformed or a field is invalid (`param` names it)",
    401: "Missing or wrong API key (when keys are configured)",
    404: "No such job (never existed, or its result expired)",
    409: "The job's state does not allow this",
    413: "The request body is over MAX_REQUEST_BODY_BYTES",
    429: "The queue is full; retry later",
    503: "The engine is loading or unavailable, or the pod is shutting down",
}


def error_responses(*statuses: int, job: bool = False) -> dict[int | str, dict[str, Any]]:
    """``responses=`` for a route: the error statuses it answers, with their body."""
    model = JobErrorBody if job else ErrorBody
    return {status: {"model": model, "description": _WHEN[status]} for status in statuses}


def error_body(exc: APIError, request: Request | None = None) -> dict[str, Any]:
    """The body for ``exc`` on the route ``request`` matched (OpenAI's shape by default)."""
    route = request.scope.get("route") if request is not None else None
    if route is not None and JOBS_TAG in (getattr(route, "tags", None) or ()):
        job_id = request.path_params.get("job_id") if request is not None else None
        return job_error_body(exc, job_id=job_id)
    return exc.body()


def error_response(exc: APIError, request: Request | None = None) -> JSONResponse:
    return JSONResponse(
        error_body(exc, request), status_code=exc.status_code, headers=exc.headers or None
    )


async def send_error(send: Send, exc: APIError) -> None:
    """Answer at the ASGI level (middleware that runs before any framework)."""
    payload = exc.body_bytes()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(payload)).encode()),
    ]
    headers += [(k.lower().encode(), v.encode()) for k, v in exc.headers.items()]
    await send({"type": "http.response.start", "status": exc.status_code, "headers": headers})
    await send({"type": "http.response.body", "body": payload})


def install_exception_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return error_response(exc, request)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        message, param = describe_validation_errors(exc.errors())
        return error_response(BadRequestError(message, param=param), request)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        detail = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        return error_response(
            APIError(exc.status_code, detail, headers=dict(exc.headers or {})), request
        )

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        # The stack goes to the log, never to the client.
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(
            InternalServerError("internal server error; see the server log"), request
        )
