"""Rendering errors over HTTP: the one exception handler of the runtime.

The error types and their bodies are ``llmendpoints_common.errors`` (shared with the gateway);
this module only puts them on the wire. Routes raise, the handler answers: OpenAI's
``{"error": {"message", "type", "param", "code"}}`` everywhere, and on job routes (tagged
``JOBS_TAG``) the job envelope, the same error object with the ``id`` of the job the request
named. ASGI middleware that runs before any framework answers with the edge's ``send_error``
(``llmendpoints_edge.asgi``), and
``OpenAIShapedErrors`` brings the error answers of vLLM's own app (an unknown /v1 path: 404
``{"type": "Not Found"}``) to the same shape.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from llmendpoints_common.errors import (
    APIError,
    BadRequestError,
    InternalServerError,
    describe_validation_errors,
    error_object,
    job_error_body,
)
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

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


def error_responses(
    *statuses: int, job: bool = False, when: Mapping[int, str] | None = None
) -> dict[int | str, dict[str, Any]]:
    """``responses=`` for a route: the error statuses it answers, with their body (``when``:
    what a status means on this route, where it is not the usual)."""
    model = JobErrorBody if job else ErrorBody
    said = {**_WHEN, **(when or {})}
    return {status: {"model": model, "description": said[status]} for status in statuses}


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


# -- vLLM's own error answers, in our shape -----------------------------------------------------


def reshape_error_body(status: int, body: bytes, method: str, path: str) -> bytes:
    """An error body of vLLM's app in OpenAI's shape with the OpenAI SDK's type names (pure).

    vLLM answers what its routes raise in OpenAI's shape already, but an HTTPException (an
    unknown path, a wrong method) comes out with the status phrase as its type ("Not Found")
    and the bare phrase as its message; Starlette's own answers are ``{"detail": ...}``.
    """
    try:
        value = json.loads(body)
    except ValueError:
        value = None
    if isinstance(value, dict) and isinstance(value.get("error"), dict):
        error = value["error"]
        message, param, code = error.get("message"), error.get("param"), error.get("code")
    elif isinstance(value, dict) and "detail" in value:
        detail = value["detail"]
        message, param, code = (
            (detail if isinstance(detail, str) else json.dumps(detail)),
            None,
            None,
        )
    else:
        return body
    if not isinstance(message, str) or not message:
        message = "error"
    if status == 404 and message == "Not Found":
        message = f"no such route: {method} {path}"
    elif status == 405 and message == "Method Not Allowed":
        message = f"{path} does not take {method}"
    # A specific machine-readable code survives; a number is the status anyway.
    reshaped = error_object(
        status,
        message,
        param=param if isinstance(param, str) else None,
        code=code if isinstance(code, str) and code else None,
    )
    return json.dumps({"error": reshaped}).encode()


class OpenAIShapedErrors:
    """Wraps vLLM's app: its JSON error answers (status >= 400) are buffered -- they are small
    -- and rewritten by ``reshape_error_body``; everything else, streams included, passes
    through untouched."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        held: Message | None = None
        chunks: list[bytes] = []

        async def send_shaped(message: Message) -> None:
            nonlocal held
            if message["type"] == "http.response.start":
                if message["status"] >= 400 and _is_json(message):
                    held = message
                    return
            elif held is not None and message["type"] == "http.response.body":
                chunks.append(message.get("body", b""))
                if message.get("more_body", False):
                    return
                body = reshape_error_body(
                    held["status"], b"".join(chunks), scope["method"], scope["path"]
                )
                headers = [(k, v) for k, v in held["headers"] if k.lower() != b"content-length"]
                headers.append((b"content-length", str(len(body)).encode()))
                await send({**held, "headers": headers})
                await send({"type": "http.response.body", "body": body})
                return
            await send(message)

        await self.app(scope, receive, send_shaped)


def _is_json(start: Message) -> bool:
    for name, value in start.get("headers", ()):
        if name.lower() == b"content-type":
            return value.split(b";")[0].strip().lower() == b"application/json"
    return False
