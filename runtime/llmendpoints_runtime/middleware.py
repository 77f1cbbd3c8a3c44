"""ASGI middleware around every request: request ids, HTTP metrics, active-request count, and
the request-body guard (size limit, UTF-8, JSON object).

Written as plain ASGI (not BaseHTTPMiddleware) so streamed responses pass through untouched,
token by token, at the cost of one extra function call per message.
"""

from __future__ import annotations

import contextvars
import json
import time
import uuid

from llmendpoints_common.errors import BadRequestError, ContentTooLargeError
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from llmendpoints_runtime.errors import send_error
from llmendpoints_runtime.metrics import RuntimeMetrics

request_id_var: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "request_id", default=None
)

# Paths that are not "work": they never count as in flight (drain does not wait for them).
PROBE_PATHS = frozenset({"/health", "/ready", "/ping", "/metrics"})
_REQUEST_ID = b"x-request-id"


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope["headers"]:
        if key == name:
            return value
    return None


def _route_label(scope: Scope) -> str:
    # Routers record the matched route in the (shared) scope; its template keeps the label's
    # cardinality bounded (/status/{job_id}, not one label per job).
    route = scope.get("route")
    path = getattr(route, "path", None)
    return path if path else "unmatched"


class RequestContext:
    def __init__(self, app: ASGIApp, metrics: RuntimeMetrics):
        self.app = app
        self.metrics = metrics
        self.active = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        incoming = _header(scope, _REQUEST_ID)
        if incoming and len(incoming) <= 128:
            request_id = incoming.decode("latin-1")
        else:
            request_id = uuid.uuid4().hex
            # vLLM reads X-Request-Id for its own request id: one id across every log line.
            scope["headers"] = [
                *(h for h in scope["headers"] if h[0] != _REQUEST_ID),
                (_REQUEST_ID, request_id.encode()),
            ]
        token = request_id_var.set(request_id)
        counted = scope["path"] not in PROBE_PATHS
        if counted:
            self.active += 1
        status = 500
        started = time.perf_counter()

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = [h for h in message.get("headers", []) if h[0].lower() != _REQUEST_ID]
                headers.append((_REQUEST_ID, request_id.encode()))
                message = {**message, "headers": headers}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            if counted:
                self.active -= 1
            route = _route_label(scope)
            method = scope["method"]
            self.metrics.http_requests.labels(route=route, method=method, status=str(status)).inc()
            self.metrics.http_latency.labels(route=route, method=method).observe(
                time.perf_counter() - started
            )
            request_id_var.reset(token)


def is_runsync_path(path: str) -> bool:
    """``/runsync`` or ``/v2/{endpoint_id}/runsync`` (pure)."""
    if path == "/runsync":
        return True
    parts = path.split("/")
    return len(parts) == 4 and parts[1] == "v2" and bool(parts[2]) and parts[3] == "runsync"


class BodyGuard:
    """413 for bodies over the limit; 400 for JSON bodies that are not UTF-8 or not an object.

    ``/runsync`` has a limit of its own (RunPod's: 10 MB for /run, 20 MB for /runsync, since a
    /runsync's input and its result travel in the one request); every other path has `limit`.

    The body is buffered (it is at most the limit) and replayed to the application; later
    receive() calls go to the server, so disconnects still reach vLLM and abort generation.
    """

    _BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})

    def __init__(
        self,
        app: ASGIApp,
        limit: int,
        metrics: RuntimeMetrics,
        *,
        runsync_limit: int | None = None,
    ):
        self.app = app
        self.limit = limit
        self.runsync_limit = limit if runsync_limit is None else runsync_limit
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in self._BODY_METHODS:
            await self.app(scope, receive, send)
            return
        if is_runsync_path(scope["path"]):
            limit, setting = self.runsync_limit, "MAX_RUNSYNC_BODY_BYTES"
        else:
            limit, setting = self.limit, "MAX_REQUEST_BODY_BYTES"
        declared = _header(scope, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await self._too_large(send, limit, setting)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                await self._too_large(send, limit, setting)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        content_type = (_header(scope, b"content-type") or b"").split(b";")[0].strip().lower()
        if body and content_type in (b"application/json", b""):
            problem = json_body_problem(body)
            if problem is not None:
                self.metrics.rejected.labels(reason="bad_body").inc()
                await send_error(send, BadRequestError(problem))
                return
        await self.app(scope, replay(body, then=receive), send)

    async def _too_large(self, send: Send, limit: int, setting: str) -> None:
        self.metrics.rejected.labels(reason="body_too_large").inc()
        await send_error(
            send,
            ContentTooLargeError(
                f"request body is larger than the limit of {limit} bytes ({setting})"
            ),
        )


def replay(body: bytes, *, then: Receive) -> Receive:
    """A ``receive`` that hands the app ``body`` as the whole request, once, then defers to
    ``then`` (usually the server's receive, so a client's disconnect still reaches the app)."""
    sent = False

    async def receive() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await then()

    return receive


def json_body_problem(body: bytes) -> str | None:
    """Why a JSON request body is unusable, or None (pure)."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        return f"request body is not valid UTF-8 (byte {exc.start})"
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        return f"request body is not valid JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})"
    if not isinstance(value, dict):
        return f"request body must be a JSON object, got {_JSON_TYPE_NAMES.get(type(value), 'a value')}"
    return None


_JSON_TYPE_NAMES = {
    list: "an array",
    str: "a string",
    int: "a number",
    float: "a number",
    bool: "a boolean",
    type(None): "null",
}
