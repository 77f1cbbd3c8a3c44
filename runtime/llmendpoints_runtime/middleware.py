"""ASGI middleware around every request: request ids, HTTP metrics, active-request count, and
the request-body guard (read deadline, size limit, UTF-8, JSON object, nesting depth).

The body guard runs after the API-key check (app.py), so nothing of a caller's body is read
before its key is known to be good.

Written as plain ASGI (not BaseHTTPMiddleware) so streamed responses pass through untouched,
token by token, at the cost of one extra function call per message.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import time
import uuid

import numpy as np
from llmendpoints_common.errors import (
    APIError,
    BadRequestError,
    ContentTooLargeError,
    RequestTimeoutError,
)
from llmendpoints_common.request_ids import valid_request_id
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
        if valid_request_id(incoming):
            request_id = incoming.decode("ascii")  # type: ignore[union-attr]
        else:
            # Missing or unsafe: a fresh id replaces it everywhere (the client sees it echoed).
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
            self.metrics.http_requests.labels(route=route, method=method, code=str(status)).inc()
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
    """Reads the request body before the application does, within limits of time and size:

    - 408, connection closed: the body has not fully arrived ``read_timeout`` seconds after the
      headers (a client that stops sending holds nothing for longer);
    - 413, connection closed: the body is over the limit (declared or counted as it arrives);
    - 400: a JSON body that is not UTF-8, not an object, or nested deeper than
      ``MAX_JSON_DEPTH`` (whatever its content type, forms aside: our routes parse the body
      whatever the client declares, and a 200,000-deep array would exhaust the parser's
      recursion).

    ``/runsync`` has a limit of its own (RunPod's: 10 MB for /run, 20 MB for /runsync, since a
    /runsync's input and its result travel in the one request); every other path has `limit`.

    Large bodies are checked without being parsed: the one parse that matters is the route's
    own (vLLM's, or ours), and a parse holds the event loop (the GIL, even in a thread) for
    about 0.3 s per 10 MB. Small ones are parsed here, for errors that name the exact spot.

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
        read_timeout: float = 30.0,
    ):
        self.app = app
        self.limit = limit
        self.runsync_limit = limit if runsync_limit is None else runsync_limit
        self.metrics = metrics
        self.read_timeout = read_timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in self._BODY_METHODS:
            await self.app(scope, receive, send)
            return
        if scope["path"] in PROBE_PATHS:
            # Open to everyone (POST /ping) and never reading a body: none is read here either,
            # and the connection closes after the answer instead of receiving one.
            await self.app(scope, receive, _closing_if_body(scope, send))
            return
        if is_runsync_path(scope["path"]):
            limit, setting = self.runsync_limit, "MAX_RUNSYNC_BODY_BYTES"
        else:
            limit, setting = self.limit, "MAX_REQUEST_BODY_BYTES"
        declared = _header(scope, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await self._too_large(send, limit, setting)
            return
        try:
            async with asyncio.timeout(self.read_timeout):
                body = await read_body(receive, limit)
        except TimeoutError:
            self.metrics.rejected.labels(reason="read_timeout").inc()
            await send_closing(
                send,
                RequestTimeoutError(
                    f"the request body did not arrive within {self.read_timeout:g} s "
                    "(REQUEST_READ_TIMEOUT_SECONDS)"
                ),
            )
            return
        if body is TOO_LARGE:
            await self._too_large(send, limit, setting)
            return
        if body is None:  # the client went away
            return
        content_type = (_header(scope, b"content-type") or b"").split(b";")[0].strip().lower()
        problem = body_problem(body, content_type)
        if problem is not None:
            self.metrics.rejected.labels(reason="bad_body").inc()
            await send_error(send, BadRequestError(problem))
            return
        await self.app(scope, replay(body, then=receive), send)

    async def _too_large(self, send: Send, limit: int, setting: str) -> None:
        self.metrics.rejected.labels(reason="body_too_large").inc()
        await send_closing(
            send,
            ContentTooLargeError(
                f"request body is larger than the limit of {limit} bytes ({setting})"
            ),
        )


def _closing_if_body(scope: Scope, send: Send) -> Send:
    """``send`` that adds ``Connection: close`` to the answer when the request announced a body."""
    length = _header(scope, b"content-length")
    chunked = _header(scope, b"transfer-encoding") is not None
    if not chunked and (length is None or length.strip() in (b"", b"0")):
        return send

    async def send_closing_answer(message: Message) -> None:
        if message["type"] == "http.response.start":
            headers = [h for h in message.get("headers", []) if h[0].lower() != b"connection"]
            message = {**message, "headers": [*headers, (b"connection", b"close")]}
        await send(message)

    return send_closing_answer


TOO_LARGE = b"<too large>"  # a sentinel (compared by identity)


async def read_body(receive: Receive, limit: int) -> bytes | None:
    """The whole body; ``TOO_LARGE`` once it passes ``limit``; None if the client left."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return TOO_LARGE
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


async def send_closing(send: Send, exc: APIError) -> None:
    """Answer with ``exc`` and close the connection (uvicorn closes it on ``Connection:
    close``): for answers sent before the body was read, so the server does not go on
    receiving (and discarding) the rest of it."""
    exc.headers["connection"] = "close"
    await send_error(send, exc)


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


# Deeper bodies are refused before any parser sees them. Python's parser gives up (RecursionError)
# near 1,000 levels, and what vLLM does with the parsed value may recurse again; no request
# body needs more than a few dozen (a JSON schema nests two levels per object level).
MAX_JSON_DEPTH = 128
# Bodies up to this size are parsed here, for messages that point at the error; larger ones
# only get the cheap structural checks (json_depth_exceeds costs ~60 ms per 10 MB at worst).
FULL_PARSE_MAX_BYTES = 256 * 1024
_FORM_TYPES = frozenset({b"multipart/form-data", b"application/x-www-form-urlencoded"})


def is_json_type(content_type: bytes) -> bool:
    """Content types that FastAPI (so vLLM) parses as JSON: none, application/json, +json."""
    return content_type in (b"", b"application/json") or (
        content_type.startswith(b"application/") and content_type.endswith(b"+json")
    )


def body_problem(body: bytes, content_type: bytes) -> str | None:
    """Why a request body is refused before any route sees it, or None (pure)."""
    if not body or content_type in _FORM_TYPES:
        return None
    if is_json_type(content_type):
        if len(body) <= FULL_PARSE_MAX_BYTES:
            return json_body_problem(body)
        return large_json_body_problem(body)
    # Our routes parse a body as JSON whatever its declared type: the depth bound holds too.
    if json_depth_exceeds(body, MAX_JSON_DEPTH):
        return _too_deep()
    return None


def _too_deep() -> str:
    return f"request body is nested too deeply: more than {MAX_JSON_DEPTH} levels of arrays and objects"


def json_body_problem(body: bytes) -> str | None:
    """Why a JSON request body is unusable, or None (pure; parses the body)."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        return f"request body is not valid UTF-8 (byte {exc.start})"
    if json_depth_exceeds(body, MAX_JSON_DEPTH):
        return _too_deep()
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        return f"request body is not valid JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})"
    except RecursionError:  # unreachable after the depth check; never a 500 all the same
        return _too_deep()
    if not isinstance(value, dict):
        return f"request body must be a JSON object, got {_JSON_TYPE_NAMES.get(type(value), 'a value')}"
    return None


def large_json_body_problem(body: bytes) -> str | None:
    """The checks of ``json_body_problem`` that need no parse: UTF-8, an object, the depth
    (pure). Malformed JSON further in is left to the route's parser, which answers 400."""
    try:
        body.decode("utf-8")
    except UnicodeDecodeError as exc:
        return f"request body is not valid UTF-8 (byte {exc.start})"
    first = body.lstrip(b" \t\r\n")[:1]
    if first != b"{":
        what = _FIRST_BYTE_NAMES.get(first, "a value" if first else "only whitespace")
        if first[:1].isdigit():
            what = "a number"
        return f"request body must be a JSON object, got {what}"
    if json_depth_exceeds(body, MAX_JSON_DEPTH):
        return _too_deep()
    return None


_FIRST_BYTE_NAMES = {
    b"[": "an array",
    b'"': "a string",
    b"-": "a number",
    b"t": "a boolean",
    b"f": "a boolean",
    b"n": "null",
}

_JSON_TYPE_NAMES = {
    list: "an array",
    str: "a string",
    int: "a number",
    float: "a number",
    bool: "a boolean",
    type(None): "null",
}

# +1 for [ and {, -1 for ] and }, 0 for every other byte.
_DEPTH_STEP = np.zeros(256, dtype=np.int8)
_DEPTH_STEP[[ord("["), ord("{")]] = 1
_DEPTH_STEP[[ord("]"), ord("}")]] = -1
_QUOTE = ord('"')
_SCAN_CHUNK = 1 << 20


def json_depth_exceeds(body: bytes, limit: int) -> bool:
    """Whether ``body``, read as JSON, nests arrays and objects more than ``limit`` deep
    (pure, no parse: vectorised over the bytes, so a 10 MB body costs tens of milliseconds).

    Brackets inside strings do not count. Escaped backslashes and quotes are dropped first, so
    every quote left opens or closes a string. On malformed input the count may be off, but
    never below what a parser would reach before it stops at the first error.
    """
    if body.count(b"[") + body.count(b"{") <= limit:
        return False
    text = body.replace(b"\\\\", b"").replace(b'\\"', b"")
    data = np.frombuffer(text, dtype=np.uint8)
    depth = quotes = 0
    for start in range(0, len(data), _SCAN_CHUNK):  # chunks bound the scan's memory
        chunk = data[start : start + _SCAN_CHUNK]
        quote_count = np.cumsum(chunk == _QUOTE, dtype=np.int64) + quotes
        steps = _DEPTH_STEP[chunk].astype(np.int64)
        steps[(quote_count & 1).astype(bool)] = 0  # inside a string
        depths = np.cumsum(steps) + depth
        if int(depths.max()) > limit:
            return True
        depth, quotes = int(depths[-1]), int(quote_count[-1])
    return False
