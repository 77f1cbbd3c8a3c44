"""One request as the gateway's layers see it: the record each layer fills in (who asked, which
endpoint, which replica, what the engine reported, what the limiter admitted) and the access
log, metrics and usage record read when it ends; and the watcher of the client's side of the
connection."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from llmendpoints_edge.asgi import Receive, Send
from llmendpoints_edge.body import ClientGone

# nginx's code for "client closed request", in metrics and logs
CLIENT_GONE = 499


@dataclass
class RequestLog:
    request_id: str
    status: int = 0
    responded: bool = False
    endpoint: str | None = None  # "<namespace>/<name>": the metric label, the usage record's
    model: str | None = None
    replica: str | None = None
    outcome: str | None = None
    key_name: str | None = None
    invalid_key: bool = False
    # Metering: the engine's usage, the limiter's ticket, the usage record to write (kind None:
    # none, e.g. /status, /metrics, requests refused before reaching an endpoint).
    usage: Any = None
    meter: Any = None  # what reads the answer's usage as it passes (a cut answer has one too)
    ticket: Any = None
    record_kind: str | None = None
    record_id: str | None = None
    record_requests: int = 1
    prompt_chars: int = 0  # the rendered prompt's length (prefix-aware routing), for chars/token
    send: Send | None = None  # the send that adds x-ratelimit-* headers (keys with limits)

    def started(self, status: int) -> None:
        """The answer's status line went out (``llmendpoints_edge.asgi.with_request_id``)."""
        self.status = status
        self.responded = True


class Disconnect:
    """Watches the client's side of the connection while the request is held or proxied.

    The whole body has been read, so the next ``receive()`` returns only when the client
    disconnects (or the response is complete). A disconnect cancels the running upstream call.
    """

    def __init__(self, receive: Receive):
        self.gone = False
        self._event: asyncio.Event | None = None  # made by wait(): only a held request waits
        self._task = asyncio.ensure_future(self._watch(receive))
        self._running: asyncio.Task | None = None  # the request's task, while it runs coro

    async def _watch(self, receive: Receive) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                self.gone = True
                if self._event is not None:
                    self._event.set()
                if self._running is not None:
                    self._running.cancel()
                return

    async def wait(self) -> None:
        if self.gone:
            return
        if self._event is None:
            self._event = asyncio.Event()
        await self._event.wait()

    async def run(self, coro):
        """``coro`` in the request's own task (no task of its own per request), cancelled
        there if the client disconnects meanwhile (the caller sees CancelledError with
        ``gone`` set)."""
        if self.gone:
            coro.close()
            raise ClientGone()
        self._running = asyncio.current_task()
        try:
            return await coro
        finally:
            self._running = None

    def close(self) -> None:
        self._task.cancel()
