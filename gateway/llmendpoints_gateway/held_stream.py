"""A streamed request held while its endpoint wakes: kept alive through proxies, ended cleanly.

Behind nginx, a cloud load balancer or a service mesh (60 s idle timeout by default), a streamed
request that gets no byte while an endpoint scales from zero turns into a 504 the client cannot
tell from an outage. So once such a request has been held for ``FIRST_COMMENT_SECONDS``, the
gateway commits to the answer: it sends the response head (200, ``text/event-stream``) and an
SSE comment, ``: waiting for a replica``, then one every ``interval`` until the replica's answer
starts. SSE clients, the openai SDK among them, skip comments.

The commit point has a price: the status line is gone. What the replica answers afterwards
reaches the client inside the stream --

* a 200 event stream: relayed as it is (its own head dropped, ours already went);
* anything else (a 400 for a bad parameter, a 429, a 5xx): one OpenAI-shaped error event,
  ``data: {"error": {...}}``, carrying the replica's error object and status code, then the end
  of the stream; the openai SDK raises it as ``APIError``;

and a hold that ends without a replica (its timeout, the gateway shutting down) ends the stream
with the same error event (the 503's message). The access log, metrics and usage record keep
the real outcome (503, 400...), not the 200 the client saw. A request released within the first
second never commits: it gets the replica's own status and headers, as without holding.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

from llmendpoints_common.errors import APIError, error_object
from llmendpoints_edge.asgi import Message, Send

FIRST_COMMENT_SECONDS = 1.0
COMMENT = b": waiting for a replica\n\n"
_HEAD = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    # nginx buffers proxied answers unless told otherwise: the comments must pass through.
    (b"x-accel-buffering", b"no"),
]


def error_event(error: dict[str, Any]) -> bytes:
    """The stream's last event for an error (vLLM's own shape for errors mid-stream)."""
    return b"data: " + json.dumps({"error": error}).encode() + b"\n\n"


def upstream_error(status: int, body: bytes) -> dict[str, Any]:
    """The error object of a replica's non-200 answer: its own fields when it sent an OpenAI
    error, always the four of ours, ``code`` the replica's status unless it named one."""
    with contextlib.suppress(ValueError, AttributeError):
        error = json.loads(body).get("error")
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            ours = error_object(status, error["message"])
            return {**ours, **{k: v for k, v in error.items() if k in ours and v is not None}}
    text = body.decode("utf-8", "replace").strip()[:500] or "no body"
    return error_object(status, f"the replica answered {status}: {text}")


class HeldStream:
    """The keep-alive of one streamed request (``send``: the request's ASGI send).

    ``arm()`` when the request starts being held, ``released()`` when a replica is found;
    ``send`` is what the answer is sent through; ``fail(exc)`` ends a committed stream with
    ``exc``; ``close()`` always."""

    def __init__(self, send: Send, interval: float):
        self._send = send
        self.interval = interval
        self.committed = False
        self._ticker: asyncio.Task[None] | None = None
        self._status = 200  # the replica's, once its head is seen
        self._error_body: list[bytes] = []

    def arm(self) -> None:
        if self._ticker is None and self.interval > 0:
            self._ticker = asyncio.ensure_future(self._keep_alive())

    async def _keep_alive(self) -> None:
        await asyncio.sleep(FIRST_COMMENT_SECONDS)
        self.committed = True  # before the await: a head half sent is a head sent
        await self._send({"type": "http.response.start", "status": 200, "headers": list(_HEAD)})
        while True:
            await self._send({"type": "http.response.body", "body": COMMENT, "more_body": True})
            await asyncio.sleep(self.interval)

    async def released(self) -> None:
        """A replica was found: no more comments. Called before the request goes to it, so that
        whether the stream is committed is settled before the replica's answer starts."""
        await self._stop()

    async def _stop(self) -> None:
        ticker, self._ticker = self._ticker, None
        if ticker is None:
            return
        ticker.cancel()
        # A comment that could not be sent (the client gone) ends the keep-alive, nothing else:
        # the disconnect watcher ends the request.
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await ticker

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            await self._stop()  # the answer starts: no more comments
            if not self.committed:
                return await self._send(message)  # released in time: the replica's own head
            self._status = message["status"]
            return  # the head went out with the first comment
        if self._status == 200:
            return await self._send(message)
        self._error_body.append(message.get("body", b""))
        if not message.get("more_body", False):
            error = upstream_error(self._status, b"".join(self._error_body))
            await self._end(error_event(error))

    async def fail(self, exc: APIError) -> bool:
        """End a committed stream with ``exc`` as its error event; False when nothing was
        committed (the caller answers ``exc`` as usual)."""
        await self._stop()
        if not self.committed:
            return False
        await self._end(error_event(exc.to_error()))
        return True

    async def _end(self, data: bytes) -> None:
        await self._send({"type": "http.response.body", "body": data, "more_body": False})

    async def close(self) -> None:
        await self._stop()
