"""The gateway's ASGI application: a bare ASGI callable, no web framework.

Measured (bench/gateway_streams.py, bench/RESULTS.md): the per-request work here is a path
match, a JSON parse and one upstream call, and every framework layer costs CPU on each of
thousands of concurrent streams. uvicorn (httptools, uvloop) serves it; upstream.py's
keep-alive pool talks to the replicas.

This module is the shell: the edge's rules first (``llmendpoints_edge``: the path normalised,
the request id, the caller's key from the headers, the body read once within its deadline and
limits), then the route decides which layer answers -- probes here, ``/v1/...`` the OpenAI
routes (openai.py), ``/v2/{endpoint}/...`` the job API (jobs.py) -- and when the request ends,
metering (usage.py) and the access line. Each layer calls the next; none calls back here.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from llmendpoints_common.errors import APIError, InternalServerError, NotFoundError
from llmendpoints_edge import paths
from llmendpoints_edge.asgi import (
    Receive,
    Scope,
    Send,
    closing_if_body,
    request_id,
    send_error,
    send_json,
    with_request_id,
)
from llmendpoints_edge.body import BODY, ClientGone, read_body
from llmendpoints_edge.logs import request_id_var

from llmendpoints_gateway import batches as batch_routes
from llmendpoints_gateway.access import Access
from llmendpoints_gateway.batches import BatchGateway
from llmendpoints_gateway.config import GatewaySettings
from llmendpoints_gateway.jobs import JobGateway
from llmendpoints_gateway.limiter import Limiter
from llmendpoints_gateway.metrics import GatewayMetrics
from llmendpoints_gateway.openai import OpenAIRoutes
from llmendpoints_gateway.registry import Registry
from llmendpoints_gateway.request import CLIENT_GONE, RequestLog
from llmendpoints_gateway.upstream import UpstreamPool
from llmendpoints_gateway.usage import Metering

logger = logging.getLogger("llmendpoints.gateway")
access_log = logging.getLogger("llmendpoints.gateway.access")

Hook = Callable[[], Awaitable[None]]


@dataclass
class Gateway:
    """The parts a request passes through; discovery, the queue and its users are started and
    stopped by the lifespan hooks, in the order the composition root (server.py) gives."""

    settings: GatewaySettings
    access: Access
    registry: Registry
    metrics: GatewayMetrics
    limiter: Limiter
    metering: Metering
    jobs: JobGateway | None = None  # the job API, with JOBS_QUEUE_URL
    batches: BatchGateway | None = None  # the batch APIs, with JOBS_QUEUE_URL
    started: list[Hook] = field(default_factory=list)
    stopped: list[Hook] = field(default_factory=list)
    draining: bool = False
    active: int = 0  # requests being answered (held, proxied or local)

    token_secret: bytes | None = None  # GATEWAY_TOKEN_SECRET_FILE's: the pods' credentials

    def __post_init__(self) -> None:
        self.openai = OpenAIRoutes(
            self.registry,
            self.access,
            self.limiter,
            self.metrics,
            UpstreamPool(self.settings.upstream_connect_timeout_seconds),
            self.settings.hold_timeout_seconds,
            token_secret=self.token_secret,
            default_max_tokens=self.settings.default_token_reservation,
        )

    # ---------------------------------------------------------------- ASGI

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            await self.http(scope, receive, send)
        elif scope["type"] == "lifespan":
            await self.lifespan(receive, send)

    async def lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    for hook in self.started:
                        await hook()
                except Exception as exc:
                    logger.exception("start-up failed")
                    await send({"type": "lifespan.startup.failed", "message": str(exc)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                for hook in self.stopped:
                    try:
                        await hook()
                    except Exception:
                        logger.exception("shutdown hook failed")
                await self.openai.pool.close()
                await send({"type": "lifespan.shutdown.complete"})
                return

    # ---------------------------------------------------------------- drain (edge server)

    def busy(self) -> int:
        """What a draining gateway waits for: requests in flight, job webhooks being sent,
        limiter updates (released leases, charged tokens) not written yet."""
        return (
            self.active
            + (self.jobs.pending_webhooks if self.jobs is not None else 0)
            + (self.batches.pending_webhooks if self.batches is not None else 0)
            + self.limiter.pending
        )

    def start_draining(self) -> None:
        self.draining = True
        self.registry.close()

    def set_drain_deadline(self, deadline: float) -> None:
        pass  # the lifespan's hooks are quick: nothing of the gateway's own outlasts the drain

    # ---------------------------------------------------------------- HTTP

    async def http(self, scope: Scope, receive: Receive, send: Send) -> None:
        paths.normalize_scope(scope)
        rid = request_id(scope)
        token = request_id_var.set(rid)
        state = RequestLog(rid)
        send = with_request_id(send, rid, state.started)
        begun = time.perf_counter()
        self.active += 1
        try:
            await self._route(scope, receive, send, state)
        except APIError as exc:
            state.status = exc.status_code
            if not state.responded:
                reply = state.send or send
                if BODY not in scope:  # answered before the body was read: never read it
                    reply = closing_if_body(scope, reply)
                await send_error(reply, exc)
        except ClientGone:
            state.status = CLIENT_GONE
        except Exception:
            logger.exception("unexpected error answering %s %s", scope["method"], scope["path"])
            state.status = 500
            if not state.responded:
                await send_error(state.send or send, InternalServerError("internal gateway error"))
            else:
                raise  # cut the connection: the body must not look complete
        finally:
            self.active -= 1
            self.metering.finish(state)
            if access_log.isEnabledFor(logging.INFO):  # its fields are built only to be logged
                access_log.info(
                    "%s %s %d",
                    scope["method"],
                    scope["path"],
                    state.status,
                    extra={
                        "endpoint": state.endpoint,
                        "model": state.model,
                        "replica": state.replica,
                        "routing": state.outcome,
                        "key": state.key_name,
                        "duration_ms": round((time.perf_counter() - begun) * 1000, 2),
                    },
                )
            request_id_var.reset(token)

    async def _route(self, scope: Scope, receive: Receive, send: Send, state: RequestLog) -> None:
        path: str = scope["path"]
        method: str = scope["method"]
        if path in ("/health", "/healthz"):
            return await send_json(send, 200, {"status": "ok"})
        if path == "/ready":
            if self.draining:
                return await send_json(send, 503, {"status": "draining"})
            return await send_json(send, 200, {"status": "ready"})
        if not path.startswith(("/v1/", "/v2/")):
            raise NotFoundError(f"{method} {path} is not a route of this gateway")

        key = self.access.identify(scope, state)
        if key is not None and key.limits.any:
            send = self.limiter.reporting(key, send, state)
        self.access.require(key, state)  # from the headers, before any of the body
        if path.startswith("/v1/"):
            if batch_routes.is_openai_batch_path(path):  # OpenAI's Batch API: batches.py
                if self.batches is None:
                    raise batch_routes.unavailable(path)
                return await self.batches.openai(scope, receive, send, state, key, path)
            if path == "/v1/models" and method == "GET":
                return await self.openai.list_models(send, key, None, state)
            if path.startswith("/v1/models/") and method == "GET":
                return await self.openai.one_model(
                    path[len("/v1/models/") :], send, key, None, state
                )
            body = await self._body(scope, receive, runsync=False, parse=True)
            return await self.openai.proxy(scope, body, receive, send, state, key, None, path)
        if path.startswith("/v2/"):
            name, _, rest = path[len("/v2/") :].partition("/")
            missing = NotFoundError(f"endpoint {name!r} does not exist", param="endpoint")
            ep = self.registry.get(name)
            if ep is None:
                raise missing
            self.access.check(key, ep, state, hidden=missing)
            if rest.startswith("openai/v1/"):
                upstream = rest[len("openai") :]
                if upstream == "/v1/models" and method == "GET":
                    return await self.openai.list_models(send, key, ep, state)
                if upstream.startswith("/v1/models/") and method == "GET":
                    model = upstream[len("/v1/models/") :]
                    return await self.openai.one_model(model, send, key, ep, state)
                body = await self._body(scope, receive, runsync=False, parse=True)
                return await self.openai.proxy(scope, body, receive, send, state, key, ep, upstream)
            if batch_routes.is_runpod_batch_path(rest):  # RunPod's batch jobs: batches.py
                if self.batches is None:
                    raise batch_routes.unavailable(path)
                return await self.batches.runpod(scope, receive, send, state, key, ep, rest)
            if self.jobs is None:
                raise NotFoundError(
                    f"{method} {path}: the job API needs the shared job queue "
                    "(JOBS_QUEUE_URL), which this gateway does not have",
                    code="jobs_unavailable",
                )
            body = b""
            if method == "POST":
                body = await self._body(scope, receive, runsync=rest == "runsync")
            return await self.jobs.answer(scope, body, send, state, key, ep, rest)

    async def _body(
        self, scope: Scope, receive: Receive, *, runsync: bool, parse: bool = False
    ) -> bytes:
        settings = self.settings
        if runsync:
            limit, setting = settings.max_runsync_body_bytes, "MAX_RUNSYNC_BODY_BYTES"
        else:
            limit, setting = settings.max_request_body_bytes, "MAX_REQUEST_BODY_BYTES"
        return await read_body(
            scope,
            receive,
            limit=limit,
            setting=setting,
            timeout=settings.request_read_timeout_seconds,
            keep_parsed=parse,  # the OpenAI routes parse it: once
        )
