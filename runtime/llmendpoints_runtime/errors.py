"""The one place that turns failures into error bodies.

OpenAI-shaped: ``{"error": {"message", "type", "param", "code"}}`` with the HTTP status as `code`
and a `type` spelled the way vLLM spells it (``BadRequestError``, ``NotFoundError``, ...) so
clients see one convention whichever layer answered. Job-shaped errors (RunPod API) are the
same object without `param`/`code`: ``{"error": {"message", "type"}}``.
"""

from __future__ import annotations

import json
import logging
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Send

logger = logging.getLogger("llmendpoints.errors")


def error_type(status: int) -> str:
    """400 -> BadRequestError, 401 -> UnauthorizedError, 413 -> ContentTooLargeError, ..."""
    try:
        phrase = HTTPStatus(status).phrase
    except ValueError:
        return "Error"
    return "".join(word.capitalize() for word in phrase.replace("-", " ").split()) + "Error"


def openai_error(
    status: int, message: str, *, param: str | None = None, type_: str | None = None
) -> dict:
    return {
        "error": {
            "message": message,
            "type": type_ or error_type(status),
            "param": param,
            "code": status,
        }
    }


def job_error(message: str, type_: str) -> dict:
    return {"error": {"message": message, "type": type_}}


class APIError(Exception):
    """Raised anywhere in our code to answer with an OpenAI-shaped error."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = headers or {}

    def body(self) -> dict:
        return openai_error(self.status, self.message, param=self.param)


def error_response(exc: APIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


async def send_error(send: Send, exc: APIError) -> None:
    """Answer at the ASGI level (middleware that runs before any framework)."""
    payload = json.dumps(exc.body()).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(payload)).encode()),
    ]
    headers += [(k.lower().encode(), v.encode()) for k, v in exc.headers.items()]
    await send({"type": "http.response.start", "status": exc.status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})


def describe_validation_error(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """FastAPI/pydantic validation errors -> one readable sentence and the field it names."""
    if not errors:
        return "invalid request", None
    first = errors[0]
    loc = [str(part) for part in first.get("loc", ()) if part not in ("body", "query", "path")]
    param = ".".join(loc) or None
    message = first.get("msg", "invalid value")
    if first.get("type") == "json_invalid":
        return f"request body is not valid JSON: {first.get('ctx', {}).get('error', message)}", None
    where = f"`{param}`: " if param else ""
    more = f" (and {len(errors) - 1} more problem(s))" if len(errors) > 1 else ""
    return f"{where}{message}{more}", param


def install_exception_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError):
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError):
        message, param = describe_validation_error(list(exc.errors()))
        return error_response(APIError(400, message, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException):
        detail = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        return error_response(APIError(exc.status_code, detail, headers=dict(exc.headers or {})))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        # The stack goes to the log, never to the client.
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(APIError(500, "internal server error; see the server log"))
