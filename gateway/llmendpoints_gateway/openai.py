"""The OpenAI routes across endpoints: ``/v1/models`` from what the gateway knows, the
inference routes (``FORWARDED``) proxied to a replica of the endpoint that serves the request's
``model``, nothing else: vLLM's engine-control and server routes are not reachable through
the gateway.

A request passes the layers once, in order: the model names the endpoint (registry; a model of
an endpoint the key may not use is answered as a model that does not exist) -> the key's limits
(limiter: 429, x-ratelimit-* headers; the tokens it may use reserved) -> a replica, held while
none is ready (registry.lease) -> forwarded with the gateway's own credential for that endpoint,
streaming, its usage read as it passes (proxy, metering) -> one retry elsewhere if the replica
failed before answering.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from llmendpoints_common import gateway_token
from llmendpoints_common.errors import APIError, BadRequestError, NotFoundError
from llmendpoints_edge.asgi import Receive, Scope, Send, raw_body, send_json
from llmendpoints_edge.body import ClientGone, parsed_object
from llmendpoints_edge.paths import encode

from llmendpoints_gateway.access import Access
from llmendpoints_gateway.held_stream import HeldStream
from llmendpoints_gateway.keys import Key
from llmendpoints_gateway.limiter import Limiter
from llmendpoints_gateway.metering import BodyUsage, metered_request, with_usage_option
from llmendpoints_gateway.metrics import GatewayMetrics
from llmendpoints_gateway.proxy import Meter, UpstreamFailed, bad_gateway, forward, upstream_headers
from llmendpoints_gateway.registry import Endpoint, NoReplicaLeft, Registry, RouteKey
from llmendpoints_gateway.request import Disconnect, RequestLog
from llmendpoints_gateway.stream_meter import StreamUsage
from llmendpoints_gateway.upstream import UpstreamPool

logger = logging.getLogger("llmendpoints.gateway")


# The OpenAI routes the gateway forwards (POST, JSON bodies it meters). vLLM's other routes --
# engine control, tokenisation, server information -- belong to the pod, not to tenants.
FORWARDED = frozenset(
    {
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/embeddings",
        "/v1/responses",
        "/v1/messages",
        "/v1/score",
        "/v1/rerank",
    }
)


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
        pool: UpstreamPool,
        hold_timeout_seconds: float,
        *,
        token_secret: bytes | None = None,
        default_max_tokens: int = 1024,
        hold_keepalive_seconds: float = 0.0,
    ):
        self.registry = registry
        self.access = access
        self.limiter = limiter
        self.metrics = metrics
        self.pool = pool
        self.hold_timeout_seconds = hold_timeout_seconds
        self.token_secret = token_secret
        self.default_max_tokens = default_max_tokens
        self.hold_keepalive_seconds = hold_keepalive_seconds
        self._tokens: dict[str, str] = {}

    def token(self, endpoint: str) -> str | None:
        """The gateway's credential at ``endpoint``'s pods (None: no secret configured)."""
        if self.token_secret is None:
            return None
        token = self._tokens.get(endpoint)
        if token is None:
            token = self._tokens[endpoint] = gateway_token.derive(self.token_secret, endpoint)
        return token

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
                "endpoint": self.registry.address(ep),  # what /v2/{endpoint}/... takes
                "namespace": ep.namespace,
                "ready_replicas": len(ep.ready),
            }
            for ep in sorted(self.access.visible(key, endpoints), key=lambda e: e.id)
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
        if upstream_path not in FORWARDED:
            raise NotFoundError(f"{scope['method']} {scope['path']} is not a route of this gateway")
        if scope["method"] != "POST":
            raise APIError(405, f"{scope['method']} {scope['path']}: use POST with a JSON body")
        payload = parsed_object(scope, body)
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
            # A key never learns what models other tenants' endpoints serve (the refusal is
            # built only for a refused request).
            if not self.access.allows(key, ep):
                self.access.check(key, ep, state, hidden=model_not_found(model))
        elif isinstance(model, str):
            state.model = model
        state.endpoint = ep.id
        metered = metered_request(upstream_path, payload, len(body), self.default_max_tokens)
        if key is not None and key.limits.any:
            state.ticket = await self.limiter.admit(
                key,
                hold=True,
                tokens=metered.reserve_tokens,
                asked=metered.asked_tokens,
                asked_field=metered.asked_field,
            )
        state.record_kind = "openai"  # admitted: it is a request of the key's, billed or not
        if metered.ask_usage:
            body = with_usage_option(body, payload)
        route = self.registry.route_key(ep, upstream_path, payload)
        if route is not None:
            state.prompt_chars = route.chars
        del payload  # a held request keeps its body, not a parsed copy of it

        def meter(status: int, is_sse: bool) -> Meter | None:
            if status != 200:
                return None
            reader = StreamUsage(metered.strip, metered.prompt_estimate) if is_sse else BodyUsage()
            state.meter = reader  # read at the end however the answer ends, cut ones too
            return reader

        query = scope.get("query_string") or b""
        path_qs = encode(upstream_path) + ("?" + query.decode("latin-1") if query else "")
        caller, _ = self.access.caller(key)
        headers = upstream_headers(
            scope["headers"], state.request_id, token=self.token(ep.id), caller=caller
        )
        held = HeldStream(send, self.hold_keepalive_seconds) if metered.stream else None
        try:
            await self._forward(
                ep, route, path_qs, headers, body, receive, send, state, meter, caller,
                raw_body(scope), held,
            )  # fmt: skip
        except APIError as exc:
            # Past the commit point the status line is gone: the error ends the stream. The
            # access log and metrics still get exc's status (the app's handler sets it).
            if held is None or not await held.fail(exc):
                raise
            state.status = exc.status_code
        finally:
            if held is not None:
                await held.close()

    async def _forward(
        self,
        ep: Endpoint,
        route: RouteKey | None,
        path_qs: str,
        headers: dict[str, str],
        body: bytes,
        receive: Receive,
        send: Send,
        state: RequestLog,
        meter: Callable[[int, bool], Meter | None],
        caller: str,
        raw: Any = None,
        held: HeldStream | None = None,
    ) -> None:
        disconnected = Disconnect(receive)
        if held is not None:
            send = held.send
        failures: list[UpstreamFailed] = []
        tried: frozenset[str] = frozenset()
        try:
            while True:
                try:
                    async with self.registry.lease(
                        ep,
                        route,
                        hold_timeout=self.hold_timeout_seconds,
                        gone=disconnected.wait,
                        exclude=tried,
                        key=caller,
                        size=len(body),
                        on_hold=held.arm if held is not None else None,
                    ) as lease:
                        state.replica, state.outcome = lease.replica, str(lease.outcome)
                        if held is not None:
                            await held.released()
                        result = await disconnected.run(
                            forward(
                                self.pool,
                                lease.replica,
                                "POST",
                                path_qs,
                                headers,
                                body,
                                send,
                                retriable_503=len(ep.ready) > 1 and not tried,
                                meter=meter,
                                # A committed stream's answer passes through held.send.
                                raw=None if held is not None and held.committed else raw,
                            )
                        )
                except NoReplicaLeft:
                    raise bad_gateway(failures) from None
                except UpstreamFailed as exc:
                    failures.append(exc)
                    logger.warning("replica failed before answering, retrying elsewhere: %s", exc)
                    if exc.status is None:
                        self.registry.mark_failed(ep.id, exc.replica)
                    tried = tried | {exc.replica}
                    if len(tried) >= 2:
                        raise bad_gateway(failures) from None
                    continue
                state.status = result.status  # 502 for a stream cut mid-way
                self.metrics.upstream_times(ep.id, result.first_byte_s, result.duration_s)
                return
        except asyncio.CancelledError:
            if disconnected.gone:
                task = asyncio.current_task()
                if task is not None:
                    task.uncancel()  # the disconnect's own cancellation, answered here
                if state.meter is not None and state.meter.ended:
                    return  # it left after the stream's last event: answered (state.status)
                raise ClientGone() from None
            raise
        finally:
            disconnected.close()
