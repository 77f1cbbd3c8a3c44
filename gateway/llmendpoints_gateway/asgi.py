"""Small ASGI pieces the gateway's request path is built from: the request record that the
access log and metrics read, the client-disconnect watcher, JSON bodies in and out."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from llmendpoints_common.errors import APIError, BadRequestError

from llmendpoints_gateway.holding import ClientGone

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


class Disconnect:
    """Watches the client's side of the connection while the request is held or proxied.

    The whole body has been read, so the next ``receive()`` returns only when the client
    disconnects (or the response is complete). A disconnect cancels the running upstream call.
    """

    def __init__(self, receive: Receive):
        self.gone = False
        self._event = asyncio.Event()
        self._task = asyncio.ensure_future(self._watch(receive))
        self._running: asyncio.Task | None = None

    async def _watch(self, receive: Receive) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                self.gone = True
                self._event.set()
                if self._running is not None:
                    self._running.cancel()
                return

    async def wait(self) -> None:
        await self._event.wait()

    async def run(self, coro):
        if self.gone:
            coro.close()
            raise ClientGone()
        self._running = asyncio.ensure_future(coro)
        try:
            return await self._running
        finally:
            self._running = None

    def close(self) -> None:
        self._task.cancel()


@dataclass
class RequestLog:
    request_id: str
    status: int = 0
    responded: bool = False
    endpoint: str | None = None
    endpoint_id: str | None = None  # "<namespace>/<name>": the queue's and usage's identity
    model: str | None = None
    replica: str | None = None
    outcome: str | None = None
    key_name: str | None = None
    invalid_key: bool = False
    # Metering: the engine's usage, the limiter's ticket, the usage record to write (kind None:
    # none, e.g. /status, /metrics, requests refused before reaching an endpoint).
    usage: Any = None
    ticket: Any = None
    record_kind: str | None = None
    record_id: str | None = None
    record_requests: int = 1
    send: Any = None  # the send that adds x-ratelimit-* headers (keys with limits)


def header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return value.decode("latin-1")
    return None


def parse_json(body: bytes) -> dict[str, Any]:
    if not body:
        raise BadRequestError("the request body is empty: send a JSON object")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadRequestError(f"the request body is not UTF-8 (byte {exc.start})") from None
    try:
        payload = json.loads(text)
    except json.JSONDecodeError as exc:
        raise BadRequestError(
            f"the request body is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}"
        ) from None
    if not isinstance(payload, dict):
        raise BadRequestError("the request body must be a JSON object")
    return payload


async def send_json(send: Send, status: int, body: Any, state: RequestLog) -> None:
    state.status = status
    state.responded = True
    data = json.dumps(body).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"x-request-id", state.request_id.encode("latin-1")),
            ],
        }
    )
    await send({"type": "http.response.body", "body": data})


async def send_error(send: Send, exc: APIError, request_id: str) -> None:
    headers = [
        (b"content-type", b"application/json"),
        (b"x-request-id", request_id.encode("latin-1")),
    ]
    headers += [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in exc.headers.items()]
    await send({"type": "http.response.start", "status": exc.status_code, "headers": headers})
    await send({"type": "http.response.body", "body": exc.body_bytes()})
