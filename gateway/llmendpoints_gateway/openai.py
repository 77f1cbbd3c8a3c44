"""The OpenAI routes across endpoints: ``/v1/models`` from what the gateway knows, everything
else proxied to a replica of the endpoint that serves the request's ``model``.

A request passes the layers once, in order: the model names the endpoint (registry) -> the key
may use it (access: 401 / 403) -> the key's limits (limiter: 429, x-ratelimit-* headers) -> a
replica, held while none is ready (registry.lease) -> forwarded, streaming, its usage read as
it passes (proxy, metering) -> one retry elsewhere if the replica failed before answering.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import aiohttp
from llmendpoints_common.errors import APIError, BadRequestError, NotFoundError
from llmendpoints_edge.asgi import Receive, Scope, Send, send_json
from llmendpoints_edge.body import ClientGone, parse_object

from llmendpoints_gateway.access import Access
from llmendpoints_gateway.keys import Key
from llmendpoints_gateway.limiter import Limiter
from llmendpoints_gateway.metering import (
    BodyUsage,
    StreamUsage,
    prepare_stream_request,
    with_usage_option,
)
from llmendpoints_gateway.metrics import GatewayMetrics
from llmendpoints_gateway.proxy import Meter, UpstreamFailed, bad_gateway, forward, upstream_headers
from llmendpoints_gateway.registry import Endpoint, NoReplicaLeft, Registry
from llmendpoints_gateway.request import Disconnect, RequestLog
from llmendpoints_gateway.routing import prefix_key

logger = logging.getLogger("llmendpoints.gateway")


def model_not_found(model: str) -> APIError:
    return NotFoundError(
        f"The model `{model}` does not exist.", param="model", code="model_not_found"
    )


class OpenAIRoutes:
    def __init__(
        self,
        registry: Registry,
        access: Access,
        limiter: Limiter,
        metrics: GatewayMetrics,
        session: Callable[[], aiohttp.ClientSession],
        hold_timeout_seconds: float,
    ):
        self.registry = registry
        self.access = access
        self.limiter = limiter
        self.metrics = metrics
        self.session = session
        self.hold_timeout_seconds = hold_timeout_seconds

    # ---------------------------------------------------------------- /v1/models

    def models(self, key: Key | None, only: Endpoint | None, state: RequestLog) -> dict[str, Any]:
        if key is None and only is None and self.access.keys.gateway_keys:
            raise self.access.missing_key(state)
        endpoints = [only] if only is not None else list(self.registry.endpoints.values())
        data = [
            {
                "id": model,
                "object": "model",
                "created": 0,
                "owned_by": "llmendpoints",
                "endpoint": ep.name,
                "ready_replicas": len(ep.ready),
            }
            for ep in sorted(self.access.visible(key, endpoints), key=lambda e: e.name)
            for model in ep.models
        ]
        return {"object": "list", "data": data}

    async def list_models(
        self, send: Send, key: Key | None, only: Endpoint | None, state: RequestLog
    ) -> None:
        await send_json(send, 200, self.models(key, only, state))

    async def one_model(
        self, model: str, send: Send, key: Key | None, only: Endpoint | None, state: RequestLog
    ) -> None:
        for item in self.models(key, only, state)["data"]:
            if item["id"] == model:
                return await send_json(send, 200, item)
        raise model_not_found(model)

    # ---------------------------------------------------------------- proxying

    async def proxy(
        self,
        scope: Scope,
        body: bytes,
        receive: Receive,
        send: Send,
        state: RequestLog,
        key: Key | None,
        ep: Endpoint | None,
        upstream_path: str,
    ) -> None:
        """A POST to ``upstream_path`` of a replica of ``ep`` (None: the endpoint serving the
        body's ``model``)."""
        if scope["method"] != "POST":
            raise APIError(405, f"{scope['method']} {scope['path']}: use POST with a JSON body")
        payload = parse_object(body)
        model = payload.get("model")
        if ep is None:
            if model is None:
                raise BadRequestError("`model` is required: name the model to use", param="model")
            if not isinstance(model, str):
                raise BadRequestError("`model` must be a string", param="model")
            state.model = model
            ep = self.registry.by_model(model)
            if ep is None:
                raise model_not_found(model)
        elif isinstance(model, str):
            state.model = model
        self.access.check(key, ep, state)
        state.endpoint = ep.name
        if key is not None and key.limits.any:
            state.ticket = await self.limiter.admit(key, hold=True)
        state.record_kind = "openai"  # admitted: it is a request of the key's, billed or not
        ask_usage, strip = prepare_stream_request(upstream_path, payload)
        if ask_usage:
            body = with_usage_option(payload)

        def meter(status: int, is_sse: bool) -> Meter | None:
            if status != 200:
                return None
            return StreamUsage(strip) if is_sse else BodyUsage()

        query = scope.get("query_string") or b""
        path_qs = upstream_path + ("?" + query.decode("latin-1") if query else "")
        headers = upstream_headers(scope["headers"], state.request_id)
        await self._forward(
            ep, prefix_key(upstream_path, payload), path_qs, headers, body, receive, send, state, meter
        )

    async def _forward(
        self,
        ep: Endpoint,
        prefix: bytes | None,
        path_qs: str,
        headers: dict[str, str],
        body: bytes,
        receive: Receive,
        send: Send,
        state: RequestLog,
        meter: Callable[[int, bool], Meter | None],
    ) -> None:
        disconnected = Disconnect(receive)
        failures: list[UpstreamFailed] = []
        tried: frozenset[str] = frozenset()
        try:
            while True:
                try:
                    async with self.registry.lease(
                        ep,
                        prefix,
                        hold_timeout=self.hold_timeout_seconds,
                        gone=disconnected.wait,
                        exclude=tried,
                    ) as lease:
                        state.replica, state.outcome = lease.replica, str(lease.outcome)
                        result = await disconnected.run(
                            forward(
                                self.session(),
                                lease.replica,
                                "POST",
                                path_qs,
                                headers,
                                body,
                                send,
                                retriable_503=len(ep.ready) > 1 and not tried,
                                meter=meter,
                            )
                        )
                except NoReplicaLeft:
                    raise bad_gateway(failures) from None
                except UpstreamFailed as exc:
                    failures.append(exc)
                    logger.warning("replica failed before answering, retrying elsewhere: %s", exc)
                    if exc.status is None:
                        self.registry.mark_failed(ep.name, exc.replica)
                    tried = tried | {exc.replica}
                    if len(tried) >= 2:
                        raise bad_gateway(failures) from None
                    continue
                state.status = result.status  # 502 for a stream cut mid-way
                if result.meter is not None:
                    state.usage = result.meter.usage
                if result.first_byte_s is not None:
                    self.metrics.ttft.labels(ep.name).observe(result.first_byte_s)
                self.metrics.duration.labels(ep.name).observe(result.duration_s)
                return
        except asyncio.CancelledError:
            if disconnected.gone:
                raise ClientGone() from None
            raise
        finally:
            disconnected.close()
