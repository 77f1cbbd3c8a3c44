"""ASGI at its plainest: the types, reading a header, request ids, and answers in OpenAI's
error shape written straight to ``send`` (both front doors answer before any framework runs).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from llmendpoints_common.errors import APIError
from llmendpoints_common.request_ids import valid_request_id

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

REQUEST_ID = b"x-request-id"
# scope["extensions"][RAW_BODY]: the edge server's RawBody (server.py), for relays that write
# a streamed body straight to the connection.
RAW_BODY = "llmep.raw_body"


def raw_body(scope: Scope) -> Any:
    """The request's ``server.RawBody``, or None (another server, or not an HTTP/1.1 cycle)."""
    extensions = scope.get("extensions")
    return extensions.get(RAW_BODY) if extensions else None


def header(scope: Scope, name: bytes) -> bytes | None:
    """The first value of header ``name`` (lowercase bytes, as ASGI gives names)."""
    for key, value in scope["headers"]:
        if key == name:
            return value
    return None


def header_text(scope: Scope, name: bytes) -> str | None:
    value = header(scope, name)
    return None if value is None else value.decode("latin-1")


def request_id(scope: Scope) -> str:
    """The request's id: the client's ``x-request-id`` when it is safe to log and pass on
    (``llmendpoints_common.request_ids``), else a fresh one, which then replaces the client's
    header in ``scope`` so everything downstream (vLLM reads it too) sees one id."""
    incoming = header(scope, REQUEST_ID)
    if valid_request_id(incoming):
        return incoming.decode("ascii")  # type: ignore[union-attr]
    fresh = uuid.uuid4().hex
    scope["headers"] = [
        *(h for h in scope["headers"] if h[0] != REQUEST_ID),
        (REQUEST_ID, fresh.encode()),
    ]
    return fresh


def with_request_id(send: Send, rid: str, on_start: Callable[[int], None] | None = None) -> Send:
    """``send`` that puts ``x-request-id: rid`` on the answer (replacing any other) and tells
    ``on_start`` the status."""
    value = rid.encode("latin-1")

    async def send_with_id(message: Message) -> None:
        if message["type"] == "http.response.start":
            if on_start is not None:
                on_start(message["status"])
            headers = [h for h in message.get("headers", ()) if h[0].lower() != REQUEST_ID]
            headers.append((REQUEST_ID, value))
            message = {**message, "headers": headers}
        await send(message)

    return send_with_id


async def send_json(
    send: Send, status: int, body: Any, headers: dict[str, str] | None = None
) -> None:
    payload = json.dumps(body).encode()
    out = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(payload)).encode()),
    ]
    out += [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": out})
    await send({"type": "http.response.body", "body": payload})


async def send_error(send: Send, exc: APIError, body: dict[str, Any] | None = None) -> None:
    """Answer with ``exc`` in OpenAI's shape (or ``body``: the job API's envelope), with the
    headers it carries (Retry-After, WWW-Authenticate, Connection: close...)."""
    await send_json(send, exc.status_code, exc.body() if body is None else body, exc.headers)


def declares_body(scope: Scope) -> bool:
    """Whether the request says a body follows (a non-zero Content-Length, or chunked)."""
    for name, value in scope["headers"]:
        if name == b"transfer-encoding":
            return True
        if name == b"content-length" and value.strip() not in (b"", b"0"):
            return True
    return False


def closing_if_body(scope: Scope, send: Send) -> Send:
    """``send`` that adds ``Connection: close`` to the answer when the request announced a
    body it will not have read (an answer from the headers alone)."""
    if not declares_body(scope):
        return send

    async def send_closing_answer(message: Message) -> None:
        if message["type"] == "http.response.start":
            headers = [h for h in message.get("headers", ()) if h[0].lower() != b"connection"]
            message = {**message, "headers": [*headers, (b"connection", b"close")]}
        await send(message)

    return send_closing_answer
