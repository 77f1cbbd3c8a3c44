"""The gateway's ASGI application: a bare ASGI callable, no web framework.

Measured (bench/gateway_streams.py, bench/RESULTS.md): the per-request work here is a path
match, a JSON parse and one upstream call, and every framework layer costs CPU on each of
thousands of concurrent streams. uvicorn (httptools, uvloop) serves it; upstream.py's
keep-alive pool talks to the replicas.

This module is the shell: the edge's rules first (``llmendpoints_edge``: the path normalised,
the request id, the caller's key from the headers, the body read once within its deadline and
limits), then the route table (``_route_table``: method + path pattern -> handler, and what the
caller must show first) decides which layer answers -- probes here, ``/v1/...`` the OpenAI
routes (openai.py) and the Batch API (batches.py), ``/v2/{endpoint}/...`` the job API (jobs.py)
-- and when the request ends, metering (usage.py) and the access line. Each layer calls the
next; none calls back here.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

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
from llmendpoints_gateway.keys import Key
from llmendpoints_gateway.limiter import Limiter
from llmendpoints_gateway.metrics import GatewayMetrics
from llmendpoints_gateway.openai import OpenAIRoutes
from llmendpoints_gateway.registry import Endpoint, Registry
from llmendpoints_gateway.request import CLIENT_GONE, RequestLog
from llmendpoints_gateway.route_table import Guard, Route, RouteTable
from llmendpoints_gateway.upstream import UpstreamPool
from llmendpoints_gateway.usage import Metering

logger = logging.getLogger("llmendpoints.gateway")
access_log = logging.getLogger("llmendpoints.gateway.access")

GET = frozenset({"GET"})


class Part(Protocol):
    """A part of the gateway with a life of its own (the queue, discovery, the limiter...):
    started at the gateway's start-up, in the order given, stopped in the reverse order."""

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


@dataclass
class Call:
    """One request on its way to its route's handler."""

    scope: Scope
    receive: Receive
    send: Send
    state: RequestLog
    params: Mapping[str, str]
    key: Key | None = None
    ep: Endpoint | None = None


class Gateway:
    """The parts a request passes through, given when it is built (server.py, the composition
    root, builds them in dependency order); ``parts`` are started and stopped by the lifespan."""

    def __init__(
        self,
        settings: GatewaySettings,
        access: Access,
        registry: Registry,
        metrics: GatewayMetrics,
        limiter: Limiter,
        metering: Metering,
        *,
        jobs: JobGateway | None = None,  # the job API, with JOBS_QUEUE_URL
        batches: BatchGateway | None = None,  # the batch APIs, with JOBS_QUEUE_URL
        parts: Sequence[Part] = (),
        token_secret: bytes | None = None,  # GATEWAY_TOKEN_SECRET_FILE's: the pods' credentials
    ) -> None:
        self.settings = settings
        self.access = access
        self.registry = registry
        self.metrics = metrics
        self.limiter = limiter
        self.metering = metering
        self.jobs = jobs
        self.batches = batches
        self.parts = tuple(parts)
        self.draining = False
        self.active = 0  # requests being answered (held, proxied or local)
        self.openai = OpenAIRoutes(
            registry,
            access,
            limiter,
            metrics,
            UpstreamPool(settings.upstream_connect_timeout_seconds),
            settings.hold_timeout_seconds,
            token_secret=token_secret,
            default_max_tokens=settings.default_token_reservation,
            hold_keepalive_seconds=settings.hold_keepalive_seconds,
        )
        self.routes = self._route_table()

    def _route_table(self) -> RouteTable[Call]:
        """Every route of the gateway, first match wins (method + path -> handler)."""
        public, endpoint = Guard.PUBLIC, Guard.ENDPOINT
        return RouteTable(
            [
                Route("/health", self._health, guard=public),
                Route("/healthz", self._health, guard=public),
                Route("/ready", self._ready, guard=public),
                # OpenAI's Batch API (batches.py), the model list, then every other OpenAI
                # route, proxied to the endpoint serving the body's model (openai.py).
                Route("/v1/files", self._openai_batches),
                Route("/v1/files/{rest:path}", self._openai_batches),
                Route("/v1/batches", self._openai_batches),
                Route("/v1/batches/{rest:path}", self._openai_batches),
                Route("/v1/models", self._models, GET),
                Route("/v1/models/{model:path}", self._model, GET),
                Route("/v1/{rest:path}", self._proxy),
                # One endpoint's: its OpenAI routes, RunPod's batch jobs, the job API (jobs.py).
                Route("/v2/{endpoint}/openai/v1/models", self._models, GET, endpoint),
                Route("/v2/{endpoint}/openai/v1/models/{model:path}", self._model, GET, endpoint),
                Route("/v2/{endpoint}/openai/v1/{rest:path}", self._proxy, guard=endpoint),
                Route("/v2/{endpoint}/batch", self._runpod_batches, guard=endpoint),
                Route("/v2/{endpoint}/batch/{rest:path}", self._runpod_batches, guard=endpoint),
                Route("/v2/{endpoint}", self._jobs, guard=endpoint),
                Route("/v2/{endpoint}/{rest:path}", self._jobs, guard=endpoint),
            ]
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
                    for part in self.parts:
                        await part.start()
                except Exception as exc:
                    logger.exception("start-up failed")
                    await send({"type": "lifespan.startup.failed", "message": str(exc)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                for part in reversed(self.parts):
                    try:
                        await part.stop()
                    except Exception:
                        logger.exception("shutdown of %s failed", type(part).__name__)
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
        found = self.routes.match(method, path)
        if found is None:
            raise NotFoundError(f"{method} {path} is not a route of this gateway")
        route, params = found
        call = Call(scope, receive, send, state, params)
        if route.guard is not Guard.PUBLIC:
            call.key = self.access.identify(scope, state)
            if call.key is not None and call.key.limits.any:
                call.send = self.limiter.reporting(call.key, send, state)
            self.access.require(call.key, state)  # from the headers, before any of the body
        if route.guard is Guard.ENDPOINT:
            name = params["endpoint"]
            missing = NotFoundError(f"endpoint {name!r} does not exist", param="endpoint")
            call.ep = self.registry.get(name)
            if call.ep is None:
                raise missing
            self.access.check(call.key, call.ep, state, hidden=missing)
        await route.handler(call)

    # ---------------------------------------------------------------- the routes' handlers

    async def _health(self, call: Call) -> None:
        await send_json(call.send, 200, {"status": "ok"})

    async def _ready(self, call: Call) -> None:
        if self.draining:
            await send_json(call.send, 503, {"status": "draining"})
        else:
            await send_json(call.send, 200, {"status": "ready"})

    async def _models(self, call: Call) -> None:
        await self.openai.list_models(call.send, call.key, call.ep, call.state)

    async def _model(self, call: Call) -> None:
        await self.openai.one_model(call.params["model"], call.send, call.key, call.ep, call.state)

    async def _proxy(self, call: Call) -> None:
        body = await self._body(call.scope, call.receive, runsync=False, parse=True)
        upstream = "/v1/" + call.params["rest"]
        await self.openai.proxy(
            call.scope, body, call.receive, call.send, call.state, call.key, call.ep, upstream
        )

    async def _openai_batches(self, call: Call) -> None:
        path = call.scope["path"]
        if self.batches is None:
            raise batch_routes.unavailable(path)
        await self.batches.openai(call.scope, call.receive, call.send, call.state, call.key, path)

    async def _runpod_batches(self, call: Call) -> None:
        if self.batches is None:
            raise batch_routes.unavailable(call.scope["path"])
        assert call.ep is not None
        rest = "batch" + (f"/{call.params['rest']}" if "rest" in call.params else "")
        await self.batches.runpod(
            call.scope, call.receive, call.send, call.state, call.key, call.ep, rest
        )

    async def _jobs(self, call: Call) -> None:
        method, path = call.scope["method"], call.scope["path"]
        if self.jobs is None:
            raise NotFoundError(
                f"{method} {path}: the job API needs the shared job queue "
                "(JOBS_QUEUE_URL), which this gateway does not have",
                code="jobs_unavailable",
            )
        assert call.ep is not None
        rest = call.params.get("rest", "")
        body = b""
        if method == "POST":
            body = await self._body(call.scope, call.receive, runsync=rest == "runsync")
        await self.jobs.answer(call.scope, body, call.send, call.state, call.key, call.ep, rest)

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
