"""The gateway's ASGI application: a bare ASGI callable, no web framework.

Measured (bench/gateway_streams.py, bench/RESULTS.md): the per-request work here is a path
match, a JSON parse and one upstream call, and every framework layer costs CPU on each of
thousands of concurrent streams. uvicorn (httptools, uvloop) serves it; aiohttp's client
pool talks to the replicas.

Request path for ``/v1/...`` and ``/v2/{endpoint}/openai/v1/...``:
key -> body (bounded) -> JSON -> model -> endpoint -> allowed for this key? (403) -> the key's
limits (limiter.py: 429, and x-ratelimit-* headers on the answer) -> a ready replica (held
while none) -> route (prefix-aware / least-loaded / round-robin) -> forward, streaming, reading
the engine's usage as it passes (metering.py) -> metrics and a usage record.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl

import aiohttp
from llmendpoints_common.errors import (
    APIError,
    AuthenticationError,
    BadRequestError,
    ContentTooLargeError,
    NotFoundError,
    PermissionDeniedError,
)
from llmendpoints_common.request_ids import valid_request_id

from llmendpoints_gateway.asgi import (
    Disconnect,
    Receive,
    RequestLog,
    Scope,
    Send,
    header,
    parse_json,
    send_error,
    send_json,
)
from llmendpoints_gateway.config import GatewaySettings
from llmendpoints_gateway.holding import ClientGone
from llmendpoints_gateway.jobs import JobGateway
from llmendpoints_gateway.keys import Key, KeyRing, key_from_headers
from llmendpoints_gateway.limiter import Limiter
from llmendpoints_gateway.metering import (
    BodyUsage,
    StreamUsage,
    Usage,
    UsagePublisher,
    UsageRecord,
    prepare_stream_request,
    with_usage_option,
)
from llmendpoints_gateway.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from llmendpoints_gateway.metrics import GatewayMetrics
from llmendpoints_gateway.proxy import UpstreamFailed, bad_gateway, forward, upstream_headers
from llmendpoints_gateway.registry import Endpoint, Registry
from llmendpoints_gateway.routing import Outcome, prefix_key

logger = logging.getLogger("llmendpoints.gateway")
access = logging.getLogger("llmendpoints.gateway.access")

CLIENT_GONE = 499  # nginx's code for "client closed request", in metrics and logs


@dataclass
class Gateway:
    """Everything a request needs; discovery and signals are started by the lifespan hooks."""

    settings: GatewaySettings
    keys: KeyRing
    registry: Registry
    metrics: GatewayMetrics
    session: aiohttp.ClientSession | None = None
    draining: bool = False
    started: list[Callable[[], Awaitable[None]]] = field(default_factory=list)
    stopped: list[Callable[[], Awaitable[None]]] = field(default_factory=list)
    active: int = 0  # requests being answered (held, proxied or local)
    jobs: JobGateway | None = None  # the job API, with JOBS_QUEUE_URL
    nudge: Callable[[str], None] | None = None  # "work for an endpoint with no ready replica"
    limiter: Limiter | None = None  # per-key limits (a local one when None)
    usage: UsagePublisher | None = None  # durable usage records, with JOBS_QUEUE_URL

    def __post_init__(self) -> None:
        if self.limiter is None:
            self.limiter = Limiter(self.settings.gateway_id)

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
                    self.session = aiohttp.ClientSession(
                        connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=30),
                        timeout=aiohttp.ClientTimeout(
                            total=None, sock_connect=self.settings.upstream_connect_timeout_seconds
                        ),
                        auto_decompress=False,
                        skip_auto_headers=("User-Agent", "Accept-Encoding", "Content-Type"),
                    )
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
                if self.session is not None:
                    await self.session.close()
                await send({"type": "lifespan.shutdown.complete"})
                return

    @property
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

    # ---------------------------------------------------------------- HTTP

    async def http(self, scope: Scope, receive: Receive, send: Send) -> None:
        incoming = header(scope, b"x-request-id")
        request_id = incoming if valid_request_id(incoming) else uuid.uuid4().hex
        started = time.perf_counter()
        state = RequestLog(request_id)
        self.active += 1
        try:
            await self._dispatch(scope, receive, send, state)
        except APIError as exc:
            state.status = exc.status_code
            if not state.responded:
                await send_error(state.send or send, exc, request_id)
        except ClientGone:
            state.status = CLIENT_GONE
        except Exception:
            logger.exception("unexpected error answering %s %s", scope["method"], scope["path"])
            state.status = 500
            if not state.responded:
                await send_error(
                    state.send or send, APIError(500, "internal gateway error"), request_id
                )
            else:
                raise  # cut the connection: the body must not look complete
        finally:
            self.active -= 1
            if state.endpoint is not None:
                self._meter(state)
            access.info(
                "%s %s %d",
                scope["method"],
                scope["path"],
                state.status,
                extra={
                    "request_id": request_id,
                    "endpoint": state.endpoint,
                    "model": state.model,
                    "replica": state.replica,
                    "routing": state.outcome,
                    "key": state.key_name,
                    "duration_ms": round((time.perf_counter() - started) * 1000, 2),
                },
            )

    async def _dispatch(
        self, scope: Scope, receive: Receive, send: Send, state: RequestLog
    ) -> None:
        path: str = scope["path"]
        method: str = scope["method"]
        if sum(len(k) + len(v) for k, v in scope["headers"]) > self.settings.max_header_bytes:
            raise APIError(431, f"request headers exceed {self.settings.max_header_bytes} bytes")
        if path in ("/health", "/healthz"):
            return await send_json(send, 200, {"status": "ok"}, state)
        if path == "/ready":
            if self.draining:
                return await send_json(send, 503, {"status": "draining"}, state)
            return await send_json(send, 200, {"status": "ready"}, state)
        if path == "/metrics":
            state.status = 200
            state.responded = True
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [(b"content-type", METRICS_CONTENT_TYPE.encode())],
                }
            )
            await send({"type": "http.response.body", "body": self.metrics.render()})
            return None

        key = self._identify(scope, state)
        if key is not None and key.limits.any:
            send = self._with_rate_headers(key, send, state)
        if path.startswith("/v1/"):
            if path == "/v1/models" and method == "GET":
                return await send_json(send, 200, self._models(key, None, state), state)
            if path.startswith("/v1/models/") and method == "GET":
                return await self._model(path[len("/v1/models/") :], key, None, send, state)
            return await self._openai(scope, receive, send, state, key, None, path)
        if path.startswith("/v2/"):
            name, _, rest = path[len("/v2/") :].partition("/")
            ep = self.registry.get(name)
            if ep is None:
                raise NotFoundError(f"endpoint {name!r} does not exist", param="endpoint")
            if not self.keys.allows(key, name):
                raise self._refused(key, ep, state)
            if rest.startswith("openai/v1/"):
                upstream = rest[len("openai") :]
                if upstream == "/v1/models" and method == "GET":
                    return await send_json(send, 200, self._models(key, ep, state), state)
                if upstream.startswith("/v1/models/") and method == "GET":
                    return await self._model(upstream[len("/v1/models/") :], key, ep, send, state)
                return await self._openai(scope, receive, send, state, key, ep, upstream)
            return await self._job(scope, receive, send, state, key, ep, rest)
        raise NotFoundError(f"{method} {path} is not a route of this gateway")

    def _meter(self, state: RequestLog) -> None:
        """Count the answer (metrics, usage record) and end its limiter ticket."""
        key = state.key_name or ""
        usage = state.usage or Usage()
        endpoint = state.endpoint or ""
        self.metrics.answered(endpoint, state.status, key)
        self.metrics.tokens_used(endpoint, "prompt", usage.prompt_tokens, key)
        self.metrics.tokens_used(endpoint, "completion", usage.completion_tokens, key)
        self.limiter.finish(state.ticket, usage.total)
        if self.usage is not None and state.record_kind is not None:
            self.usage.record(
                UsageRecord(
                    # Unique per answer (a client may reuse an x-request-id); a job's is its id,
                    # so a job seen finished through two replicas is stored once.
                    id=state.record_id or f"{state.request_id}.{uuid.uuid4().hex[:16]}",
                    time=time.time(),
                    key=key,
                    endpoint=state.endpoint,
                    model=state.model or "",
                    status=state.status,
                    prompt_tokens=usage.prompt_tokens,
                    completion_tokens=usage.completion_tokens,
                    gateway=self.settings.gateway_id,
                    kind=state.record_kind,
                    requests=state.record_requests,
                )
            )

    async def _admit(self, key: Key | None, state: RequestLog, *, hold: bool) -> None:
        """The key's limits: 429 over one; else a ticket whose headers the answer carries."""
        if key is not None and key.limits.any:
            state.ticket = await self.limiter.admit(key, hold=hold)

    def _with_rate_headers(self, key: Key, send: Send, state: RequestLog) -> Send:
        """Every answer to a key with limits carries x-ratelimit-*: the admission's view, or
        (answers that count nothing: /status, /v1/models, errors) the limiter's current one."""

        async def send_with_headers(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                headers = message["headers"]
                if not any(name.startswith(b"x-ratelimit-") for name, _ in headers):
                    ticket = state.ticket
                    extra = ticket.headers if ticket is not None else self.limiter.peek(key)
                    message = {**message, "headers": [*headers, *extra]}
            await send(message)

        state.send = send_with_headers
        return send_with_headers

    # ---------------------------------------------------------------- keys and models

    def _identify(self, scope: Scope, state: RequestLog) -> Key | None:
        """The caller's key, or None. An unknown key is as good as none: it is refused (401)
        only where a key is needed, so open endpoints stay open to clients that always send
        one (the openai SDK insists on an api_key)."""
        secret = key_from_headers(scope["headers"])
        if secret is None:
            return None
        key = self.keys.identify(secret)
        if key is None:
            state.invalid_key = True
            return None
        state.key_name = key.name
        return key

    def _refused(self, key: Key | None, ep: Endpoint, state: RequestLog) -> APIError:
        """401 without a (valid) key; 403 for a key that may not use this endpoint."""
        if key is None:
            return self._missing_key(state)
        return PermissionDeniedError(
            f"API key {key.name!r} may not use endpoint {ep.name!r}", code="endpoint_not_allowed"
        )

    def _missing_key(self, state: RequestLog) -> APIError:
        reason = "invalid API key" if state.invalid_key else "missing API key"
        return AuthenticationError(
            f"{reason}: send `Authorization: Bearer <key>` or `x-api-key: <key>`",
            headers={"www-authenticate": "Bearer"},
        )

    def _visible(self, key: Key | None, only: Endpoint | None) -> list[Endpoint]:
        endpoints = [only] if only is not None else list(self.registry.endpoints.values())
        return [ep for ep in endpoints if self.keys.allows(key, ep.name)]

    def _models(self, key: Key | None, only: Endpoint | None, state: RequestLog) -> dict[str, Any]:
        if key is None and only is None and self.keys.gateway_keys:
            raise self._missing_key(state)
        data = [
            {
                "id": model,
                "object": "model",
                "created": 0,
                "owned_by": "llmendpoints",
                "endpoint": ep.name,
                "ready_replicas": len(ep.ready),
            }
            for ep in sorted(self._visible(key, only), key=lambda e: e.name)
            for model in ep.models
        ]
        return {"object": "list", "data": data}

    async def _model(self, model: str, key, only, send, state) -> None:
        for item in self._models(key, only, state)["data"]:
            if item["id"] == model:
                return await send_json(send, 200, item, state)
        raise NotFoundError(
            f"The model `{model}` does not exist.", param="model", code="model_not_found"
        )

    # ---------------------------------------------------------------- jobs

    async def _job(
        self, scope, receive, send, state, key: Key | None, ep: Endpoint, verb: str
    ) -> None:
        if self.jobs is None:
            raise NotFoundError(
                f"{scope['method']} {scope['path']}: the job API needs the shared job queue "
                "(JOBS_QUEUE_URL), which this gateway does not have",
                code="jobs_unavailable",
            )
        state.endpoint = ep.id
        limit = self.settings.max_runsync_body_bytes if verb == "runsync" else None
        body = await self._read_body(scope, receive, limit) if scope["method"] == "POST" else None
        query = dict(parse_qsl((scope.get("query_string") or b"").decode("latin-1")))
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        owner = None if key is not None and key.admin else (key.name if key is not None else "")
        submit = scope["method"] == "POST" and verb in ("run", "runsync")
        if submit:
            # Jobs count against the key's limits: a request each; a /runsync holds a
            # concurrency slot while it waits.
            await self._admit(key, state, hold=verb == "runsync")
        reply = await self.jobs.handle(ep.name, scope["method"], verb, query, headers, body, owner)
        if submit and not ep.ready and self.nudge is not None:
            self.nudge(ep.name)
        if submit and isinstance(reply.get("id"), str):
            state.model = ep.models[0] if ep.models else ""
            state.record_kind = "job"
            state.record_id = f"job-{reply['id']}"
        await send_json(send, 200, reply, state)

    def job_usage(self, record, usage: Usage):
        """JobUsageMeter's callback: a completed job's usage record, and what to count once
        the usage stream stored it for the first time."""
        ep = self.registry.get(record.endpoint)
        entry = UsageRecord(
            id=f"job-{record.id}-usage",
            time=record.finished_at or time.time(),
            key=record.owner,
            endpoint=record.endpoint,
            model=ep.models[0] if ep is not None and ep.models else "",
            status=200,
            prompt_tokens=usage.prompt_tokens,
            completion_tokens=usage.completion_tokens,
            gateway=self.settings.gateway_id,
            kind="job",
            requests=0,  # the job was counted when it was accepted
        )

        def count() -> None:
            endpoint = ep.id if ep is not None else record.endpoint
            self.metrics.tokens_used(endpoint, "prompt", usage.prompt_tokens, record.owner)
            self.metrics.tokens_used(endpoint, "completion", usage.completion_tokens, record.owner)
            key = self.keys.by_name(record.owner)
            if key is not None:
                self.limiter.charge(key, usage.total)

        return entry, count

    # ---------------------------------------------------------------- OpenAI proxying

    async def _openai(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        state: RequestLog,
        key: Key | None,
        ep: Endpoint | None,
        upstream_path: str,
    ) -> None:
        if scope["method"] != "POST":
            raise APIError(405, f"{scope['method']} {scope['path']}: use POST with a JSON body")
        body = await self._read_body(scope, receive)
        payload = parse_json(body)
        model = payload.get("model")
        if ep is None:
            if model is None:
                raise BadRequestError("`model` is required: name the model to use", param="model")
            if not isinstance(model, str):
                raise BadRequestError("`model` must be a string", param="model")
            state.model = model
            ep = self.registry.by_model(model)
            if ep is None:
                raise NotFoundError(
                    f"The model `{model}` does not exist.", param="model", code="model_not_found"
                )
            if not self.keys.allows(key, ep.name):
                raise self._refused(key, ep, state)
        elif not self.keys.allows(key, ep.name):
            raise self._refused(key, ep, state)
        elif isinstance(model, str):
            state.model = model
        state.endpoint = ep.id
        await self._admit(key, state, hold=True)
        state.record_kind = "openai"  # admitted: it is a request of the key's, billed or not
        ask_usage, strip = prepare_stream_request(upstream_path, payload)
        if ask_usage:
            body = with_usage_option(payload)

        def meter(status: int, is_sse: bool):
            if status != 200:
                return None
            return StreamUsage(strip) if is_sse else BodyUsage()

        query = scope.get("query_string") or b""
        path_qs = upstream_path + ("?" + query.decode("latin-1") if query else "")
        headers = upstream_headers(scope["headers"], state.request_id)
        prefix = prefix_key(upstream_path, payload)
        await self._route_and_forward(
            ep, prefix, scope["method"], path_qs, headers, body, receive, send, state, meter
        )

    async def _route_and_forward(
        self,
        ep: Endpoint,
        prefix: bytes | None,
        method: str,
        path_qs: str,
        headers: dict[str, str],
        body: bytes,
        receive: Receive,
        send: Send,
        state: RequestLog,
        meter=None,
    ) -> None:
        disconnected = Disconnect(receive)
        try:
            failures: list[UpstreamFailed] = []
            tried: frozenset[str] = frozenset()
            while True:
                choice = ep.choose(prefix, exclude=tried)
                if choice is None:
                    if tried:  # every ready replica failed before answering
                        raise bad_gateway(failures)
                    await ep.hold.wait(
                        ep.hold_seconds(self.settings.hold_timeout_seconds), disconnected.wait()
                    )
                    continue
                replica, outcome = choice
                if tried:
                    outcome = Outcome.RETRY
                state.replica, state.outcome = replica, str(outcome)
                self.metrics.routing.labels(ep.id, outcome).inc()
                self.registry.acquire(ep, replica)
                try:
                    result = await disconnected.run(
                        forward(
                            self.session,
                            replica,
                            method,
                            path_qs,
                            headers,
                            body,
                            send,
                            retriable_503=len(ep.ready) > 1 and not tried,
                            meter=meter,
                        )
                    )
                except UpstreamFailed as exc:
                    failures.append(exc)
                    logger.warning("replica failed before answering, retrying elsewhere: %s", exc)
                    if exc.status is None:
                        self.registry.mark_failed(ep.name, replica)
                    tried = tried | {replica}
                    if len(tried) >= 2:
                        raise bad_gateway(failures) from None
                    continue
                finally:
                    self.registry.release(ep, replica)
                state.responded = True
                state.status = result.status
                if result.meter is not None:
                    state.usage = result.meter.usage
                if result.first_byte_s is not None:
                    self.metrics.ttft.labels(ep.id).observe(result.first_byte_s)
                self.metrics.duration.labels(ep.id).observe(result.duration_s)
                return
        except asyncio.CancelledError:
            if disconnected.gone:
                raise ClientGone() from None
            raise
        finally:
            disconnected.close()

    async def _read_body(self, scope: Scope, receive: Receive, limit: int | None = None) -> bytes:
        limit = self.settings.max_request_body_bytes if limit is None else limit
        declared = header(scope, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise ContentTooLargeError(f"request body is {declared} bytes; the limit is {limit}")
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise ClientGone()
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise ContentTooLargeError(f"request body exceeds the limit of {limit} bytes")
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)
