"""Calling an ASGI app in-process: how jobs and /invocations reach vLLM's OpenAI routes.

No socket, no proxy: the request is handed to the app's ``__call__`` and the response is read
from its ``send`` messages as they come, so streamed responses stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, MutableMapping
from dataclasses import dataclass
from typing import Any

from llmendpoints_edge.asgi import Receive, Scope, Send
from llmendpoints_edge.body import BODY, replay
from starlette.responses import Response

from llmendpoints_runtime.jobs.port import ASGIApp


@dataclass
class InProcessResponse:
    status: int
    headers: dict[str, str]
    body: AsyncIterator[bytes]

    async def read(self) -> bytes:
        return b"".join([chunk async for chunk in self.body])


def _request_scope(method: str, path: str, body: bytes, headers: dict[str, str]) -> dict:
    all_headers = {"content-type": "application/json", **headers}
    all_headers["content-length"] = str(len(body))
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": [(k.lower().encode(), v.encode()) for k, v in all_headers.items()],
        "client": ("127.0.0.1", 0),
        "server": ("127.0.0.1", 0),
        "state": {},
        BODY: body,  # what the edge would have read: the app counts its sequences from it
    }


async def call_app(
    app: ASGIApp,
    method: str,
    path: str,
    json_body: Any = None,
    headers: dict[str, str] | None = None,
) -> InProcessResponse:
    """Send one request to ``app``; return once the response has started.

    Closing ``body`` early (or cancelling its reader) tells the app the client disconnected
    and cancels the app's task, which is how an aborted job stops vLLM's generator.
    """
    body = b"" if json_body is None else json.dumps(json_body).encode()
    scope = _request_scope(method, path, body, headers or {})
    messages: asyncio.Queue[MutableMapping[str, Any] | BaseException | None] = asyncio.Queue()
    disconnected = asyncio.Event()

    async def until_disconnected() -> MutableMapping[str, Any]:
        await disconnected.wait()
        return {"type": "http.disconnect"}

    receive = replay(body, then=until_disconnected)

    async def send(message: MutableMapping[str, Any]) -> None:
        await messages.put(message)

    async def run() -> None:
        try:
            await app(scope, receive, send)
        except BaseException as exc:
            await messages.put(exc)
            if isinstance(exc, asyncio.CancelledError):
                raise
        else:
            await messages.put(None)

    task = asyncio.create_task(run())
    first = await messages.get()
    if isinstance(first, BaseException):
        raise first
    if first is None or first["type"] != "http.response.start":
        task.cancel()
        raise RuntimeError("the app ended without starting a response")
    response_headers = {k.decode().lower(): v.decode() for k, v in first.get("headers", [])}

    async def body_iter() -> AsyncIterator[bytes]:
        try:
            while True:
                message = await messages.get()
                if message is None:
                    return
                if isinstance(message, BaseException):
                    raise message
                if message["type"] == "http.response.body":
                    if chunk := message.get("body", b""):
                        yield chunk
                    if not message.get("more_body", False):
                        return
        finally:
            disconnected.set()
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task

    return InProcessResponse(first["status"], response_headers, body_iter())


class ForwardedRequest(Response):
    """A response that hands the current request to another ASGI app at another path.

    Used where a route of ours is an alias of one of vLLM's (``/invocations`` ->
    ``/v1/chat/completions``, ``/v2/{id}/openai/v1/...`` -> ``/v1/...``): the target app
    writes straight to our client, streaming included, and sees the client's disconnects.
    """

    def __init__(self, app: ASGIApp, path: str, body: bytes | None = None) -> None:
        super().__init__()
        self._app = app
        self._path = path
        self._body = body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        scope = dict(scope, path=self._path, raw_path=self._path.encode(), root_path="")
        for key in ("route", "endpoint", "path_params", "router", "app"):
            scope.pop(key, None)
        if self._body is None:
            await self._app(scope, receive, send)
            return
        body = self._body
        scope[BODY] = body
        # The replacement body is JSON whatever the client declared (SageMaker clients often
        # send none, or application/octet-stream).
        headers = [
            (k, v) for k, v in scope["headers"] if k not in (b"content-length", b"content-type")
        ]
        scope["headers"] = [
            *headers,
            (b"content-length", str(len(body)).encode()),
            (b"content-type", b"application/json"),
        ]
        await self._app(scope, replay(body, then=receive), send)
