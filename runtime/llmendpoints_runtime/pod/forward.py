"""Passing an HTTP request to another API process of the pod, over its private Unix socket.

Used for the routes one process serves for the whole pod: the batch APIs of a pod without the
shared queue (their store on local disk and their driver live in API process 0). The request
goes on as it came -- method, path, headers (the caller's key among them: the other process
authenticates it again), body streamed -- with ``x-llmep-peer`` holding the pod's secret, so
that the receiving process does not count it in its HTTP metrics a second time. The answer
streams back as it comes.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
from llmendpoints_common.errors import ServiceUnavailableError
from llmendpoints_edge.asgi import Receive, Scope, Send, send_error
from llmendpoints_edge.body import read_before

logger = logging.getLogger("llmendpoints.pod.forward")

PEER_HEADER = b"x-llmep-peer"
_HOP_BY_HOP = frozenset(
    {b"connection", b"keep-alive", b"transfer-encoding", b"te", b"upgrade", b"host", PEER_HEADER}
)


def http_socket_path(directory: Path, index: int) -> Path:
    return directory / f"http-{index}.sock"


def is_peer(scope: Scope, token: str) -> bool:
    """Whether the request came from another API process of this pod (pure)."""
    for name, value in scope.get("headers") or ():
        if name == PEER_HEADER:
            return hmac.compare_digest(value, token.encode())
    return False


class ForwardTo:
    """An ASGI app that answers by passing the request to the API process listening on
    ``path``."""

    def __init__(self, path: Path, token: str) -> None:
        self.path = path
        self.token = token
        self._client: httpx.AsyncClient | None = None

    def _http(self) -> httpx.AsyncClient:
        if self._client is None:
            transport = httpx.AsyncHTTPTransport(uds=str(self.path))
            self._client = httpx.AsyncClient(transport=transport, timeout=None)
        return self._client

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = [(k, v) for k, v in scope["headers"] if k.lower() not in _HOP_BY_HOP]
        headers.append((PEER_HEADER, self.token.encode()))
        target = scope.get("raw_path") or scope["path"].encode()
        if scope.get("query_string"):
            target += b"?" + scope["query_string"]
        client = self._http()
        request = client.build_request(
            scope["method"],
            "http://pod" + target.decode("latin-1"),
            headers=headers,
            content=_body(scope, receive),
        )
        try:
            response = await client.send(request, stream=True)
        except httpx.HTTPError as exc:
            logger.warning(
                "passing %s %s to API process 0 failed: %s", scope["method"], scope["path"], exc
            )
            await send_error(
                send,
                ServiceUnavailableError(
                    f"the API process serving this route does not answer ({exc}); retry shortly",
                    headers={"retry-after": "1"},
                ),
            )
            return
        try:
            await send(
                {
                    "type": "http.response.start",
                    "status": response.status_code,
                    "headers": [
                        (k, v) for k, v in response.headers.raw if k.lower() not in _HOP_BY_HOP
                    ],
                }
            )
            async for chunk in response.aiter_raw():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
        finally:
            await response.aclose()


async def _body(scope: Scope, receive: Receive) -> AsyncIterator[bytes]:
    """The body the edge already read, or the rest of it from the client (an upload)."""
    body = read_before(scope)
    if body is not None:
        yield body
        return
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return
        if chunk := message.get("body", b""):
            yield chunk
        if not message.get("more_body", False):
            return
