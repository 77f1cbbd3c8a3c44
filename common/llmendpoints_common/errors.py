"""One error vocabulary for every contract we serve (OpenAI, RunPod jobs, SageMaker).

An error is an exception that knows its HTTP status; its ``type`` is the name the OpenAI SDK
gives that status (``BadRequestError``, ``AuthenticationError``, ``PermissionDeniedError``,
``NotFoundError``, ``ConflictError``, ``RateLimitError``, ``InternalServerError``, ...), so a
client sees one spelling whichever layer -- runtime, gateway, job API -- answered. The body is
OpenAI's ``{"error": {"message", "type", "param", "code"}}``; ``code`` is the HTTP status unless
a more specific machine-readable code is given (``rate_limit_exceeded``).

Pure: no web framework here. The runtime's and the gateway's HTTP layers render these.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from http import HTTPStatus
from typing import Any, ClassVar

# The OpenAI SDK's names where it has one; the rest follow the same pattern with the phrase
# fixed here (HTTPStatus phrases changed between Python versions: 413 is "Request Entity Too
# Large" on 3.11 and "Content Too Large" on 3.13).
_TYPES: dict[int, str] = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    408: "RequestTimeoutError",
    409: "ConflictError",
    413: "ContentTooLargeError",
    415: "UnsupportedMediaTypeError",
    422: "UnprocessableEntityError",
    429: "RateLimitError",
    431: "RequestHeaderFieldsTooLargeError",
    500: "InternalServerError",
    502: "BadGatewayError",
    503: "ServiceUnavailableError",
    504: "GatewayTimeoutError",
}


def error_type(status: int) -> str:
    """The error ``type`` for an HTTP status: 400 -> BadRequestError, 429 -> RateLimitError."""
    if status in _TYPES:
        return _TYPES[status]
    try:
        phrase = HTTPStatus(status).phrase
    except ValueError:
        return "InternalServerError" if status >= 500 else "BadRequestError"
    return "".join(word.capitalize() for word in phrase.replace("-", " ").split()) + "Error"


def error_object(
    status: int, message: str, *, param: str | None = None, code: str | int | None = None
) -> dict[str, Any]:
    """The ``error`` member: always the four fields."""
    return {
        "message": message,
        "type": error_type(status),
        "param": param,
        "code": status if code is None else code,
    }


class APIError(Exception):
    """Raise anywhere to answer with this status and an OpenAI-shaped error body.

    Subclasses fix the status; ``APIError(status, message)`` works for any other.
    """

    status: ClassVar[int] = 500

    def __init__(
        self,
        *args: Any,
        param: str | None = None,
        code: str | int | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        # APIError(message) on a subclass, APIError(status, message) on the base.
        if len(args) == 2 and isinstance(args[0], int):
            status, message = args
        elif len(args) == 1:
            status, message = type(self).status, args[0]
        else:
            raise TypeError("APIError(message) or APIError(status, message)")
        super().__init__(message)
        self.status_code: int = int(status)
        self.message: str = str(message)
        self.param = param
        self.code = code
        self.headers: dict[str, str] = dict(headers or {})

    @property
    def type(self) -> str:
        return error_type(self.status_code)

    def to_error(self) -> dict[str, Any]:
        return error_object(self.status_code, self.message, param=self.param, code=self.code)

    def body(self) -> dict[str, Any]:
        return {"error": self.to_error()}

    def body_bytes(self) -> bytes:
        return json.dumps(self.body()).encode()


class BadRequestError(APIError):
    status = 400


class AuthenticationError(APIError):
    status = 401


class PermissionDeniedError(APIError):
    status = 403


class NotFoundError(APIError):
    status = 404


class RequestTimeoutError(APIError):
    status = 408


class ConflictError(APIError):
    status = 409


class ContentTooLargeError(APIError):
    status = 413


class UnprocessableEntityError(APIError):
    status = 422


class RateLimitError(APIError):
    status = 429


class InternalServerError(APIError):
    status = 500


class ServiceUnavailableError(APIError):
    status = 503


def error_from_exception(exc: BaseException) -> dict[str, Any]:
    """The ``error`` object for any exception that ended a job: our errors as they are,
    anything else as a 500 naming the exception's class (never a repr of its arguments)."""
    if isinstance(exc, APIError):
        return exc.to_error()
    text = str(exc) or "no details"
    return error_object(500, f"{type(exc).__name__}: {text}")


def job_error_body(exc: APIError, *, job_id: str | None = None) -> dict[str, Any]:
    """The job API's error envelope: a job status body cut down to what is known.

    A job's own status is ``{"id", "status", "output"?, "error"?, ...}`` and a job that failed
    carries the error object there. A request the job API refuses carries the same ``error``
    object (the four fields), and the ``id`` when the request named a job (``/status/{id}``,
    ``/cancel/{id}``...), so a client reads errors one way whether a job failed or a request
    was refused. There is no ``status``: a refused request made no job to have one.
    """
    body: dict[str, Any] = {}
    if job_id is not None:
        body["id"] = job_id
    body["error"] = exc.to_error()
    return body


# Where pydantic/FastAPI put the request part in ``loc``; a client names the field without it.
_LOC_ROOTS = frozenset({"body", "query", "path", "header", "cookie"})
# pydantic names union members and validators in ``loc``; they are noise to a client.
_UNION_MEMBER_NAMES = frozenset({"str", "int", "float", "bool", "dict", "list", "none"})


def describe_validation_errors(
    errors: Iterable[Mapping[str, Any]], *, prefix: str = ""
) -> tuple[str, str | None]:
    """pydantic (or FastAPI) validation errors -> one readable message and the first field.

    Every problem is one ``field: message`` clause (``input.messages[1].role: Field
    required``); ``prefix`` roots the paths (``input.openai_input``). Takes the plain list of
    dicts that ``ValidationError.errors()`` returns, so no framework is needed here.
    """
    parts: list[str] = []
    first_field: str | None = None
    for error in errors:
        kind = error.get("type")
        if kind == "json_invalid":
            detail = (error.get("ctx") or {}).get("error", error.get("msg", "invalid JSON"))
            return f"request body is not valid JSON: {detail}", None
        field = _field_path(prefix, tuple(error.get("loc", ())))
        first_field = first_field or field
        message = str(error.get("msg", "invalid value")).removeprefix("Value error, ")
        if kind == "extra_forbidden":
            message = "unknown field"
        elif kind == "missing":
            message = "required field is missing"
        parts.append(f"{field}: {message}")
    if not parts:
        return "invalid request", None
    return "; ".join(dict.fromkeys(parts)), first_field


def _field_path(prefix: str, loc: tuple[Any, ...]) -> str:
    """``("body", "input", "messages", 1, "role")`` -> ``input.messages[1].role``."""
    path = prefix
    if loc and loc[0] in _LOC_ROOTS:
        loc = loc[1:]
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
            continue
        part = str(part)
        if "[" in part or part in _UNION_MEMBER_NAMES or part.startswith("function-"):
            continue
        path = f"{path}.{part}" if path else part
    return path or "body"
