"""ASGI middleware around every request of the runtime: the request's id and path (the edge's
rules), HTTP metrics, the active-request count, and the body guard.

The body guard runs after the API-key check (app.py), so nothing of a caller's body is read
before its key is known to be good; the reading itself is the edge's (``llmendpoints_edge.body``).

Written as plain ASGI (not BaseHTTPMiddleware) so streamed responses pass through untouched,
token by token, at the cost of one extra function call per message.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from llmendpoints_common.errors import APIError
from llmendpoints_edge import paths
from llmendpoints_edge.asgi import (
    ASGIApp,
    Receive,
    Scope,
    Send,
    closing_if_body,
    request_id,
    send_error,
    with_request_id,
)
from llmendpoints_edge.body import ClientGone, read_body, replay
from llmendpoints_edge.logs import request_id_var

from llmendpoints_runtime.metrics import RuntimeMetrics

# Paths that are not "work": they never count as in flight (drain does not wait for them).
PROBE_PATHS = frozenset({"/health", "/ready", "/ping", "/metrics"})


def _route_label(scope: Scope) -> str:
    # Routers record the matched route in the (shared) scope; its template keeps the label's
    # cardinality bounded (/status/{job_id}, not one label per job).
    route = scope.get("route")
    path = getattr(route, "path", None)
    return path if path else "unmatched"


class RequestContext:
    """``passed_on(scope)``: the request was passed on by another API process of the pod,
    which counted it already (pod/forward.py): it is not counted again here."""

    def __init__(
        self,
        app: ASGIApp,
        metrics: RuntimeMetrics,
        passed_on: Callable[[Scope], bool] = lambda _scope: False,
    ):
        self.app = app
        self.metrics = metrics
        self.passed_on = passed_on
        self.active = 0
        # (route, method, code) -> its request counter and latency histogram: labels() costs
        # a few µs a call with keyword arguments. Bounded: route templates, HTTP's methods
        # (the parser knows a fixed set), status codes.
        self._series: dict[tuple[str, str, int], tuple[Any, Any]] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        # One reading of the path for the key check, routing and vLLM alike.
        paths.normalize_scope(scope)
        # vLLM reads X-Request-Id for its own request id: one id across every log line.
        rid = request_id(scope)
        token = request_id_var.set(rid)
        counted = scope["path"] not in PROBE_PATHS
        if counted:
            self.active += 1
        status = 500

        def started(code: int) -> None:
            nonlocal status
            status = code

        begun = time.perf_counter()
        try:
            await self.app(scope, receive, with_request_id(send, rid, started))
        finally:
            if counted:
                self.active -= 1
            if not self.passed_on(scope):
                requests, latency = self._series_of(_route_label(scope), scope["method"], status)
                requests.inc()
                latency.observe(time.perf_counter() - begun)
            request_id_var.reset(token)

    def _series_of(self, route: str, method: str, status: int) -> tuple[Any, Any]:
        found = self._series.get((route, method, status))
        if found is None:
            metrics = self.metrics
            found = self._series[(route, method, status)] = (
                metrics.http_requests.labels(route=route, method=method, code=str(status)),
                metrics.http_latency.labels(route=route, method=method),
            )
        return found


def is_upload_path(method: str, path: str) -> bool:
    """``POST /v1/files``: the Batch API's upload, read (streamed, with its own bound) by its
    route, never here (pure)."""
    return method == "POST" and path == "/v1/files"


def takes_array(method: str, path: str) -> bool:
    """``POST /v2/{endpoint_id}/batch``: RunPod's batch create takes a JSON array (pure)."""
    parts = path.split("/")
    return method == "POST" and len(parts) == 4 and parts[1] == "v2" and parts[3] == "batch"


def is_runsync_path(path: str) -> bool:
    """``/runsync`` or ``/v2/{endpoint_id}/runsync`` (pure)."""
    if path == "/runsync":
        return True
    parts = path.split("/")
    return len(parts) == 4 and parts[1] == "v2" and bool(parts[2]) and parts[3] == "runsync"


class BodyGuard:
    """Reads the request body before the application does (``llmendpoints_edge.body``: 408
    past ``read_timeout``, 413 over the limit, 400 for a body no route could use), keeps it in
    the scope for whoever needs it next, and replays it to the application.

    ``/runsync`` has a limit of its own (RunPod's: 10 MB for /run, 20 MB for /runsync, since a
    /runsync's input and its result travel in the one request); every other path has ``limit``.
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
            await self.app(scope, receive, closing_if_body(scope, send))
            return
        method, path = scope["method"], scope["path"]
        if is_upload_path(method, path):
            await self.app(scope, receive, send)  # its route streams it, within its own bound
            return
        if is_runsync_path(path):
            limit, setting = self.runsync_limit, "MAX_RUNSYNC_BODY_BYTES"
        else:
            limit, setting = self.limit, "MAX_REQUEST_BODY_BYTES"
        try:
            body = await read_body(
                scope,
                receive,
                limit=limit,
                setting=setting,
                timeout=self.read_timeout,
                arrays=takes_array(method, path),
            )
        except ClientGone:
            return
        except APIError as exc:
            reason = {408: "read_timeout", 413: "body_too_large"}.get(exc.status_code, "bad_body")
            self.metrics.rejected.labels(reason=reason).inc()
            await send_error(send, exc)
            return
        await self.app(scope, replay(body, then=receive), send)
