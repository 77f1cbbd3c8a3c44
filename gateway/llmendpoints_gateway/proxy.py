"""Forward one request to a replica and stream the answer back, byte for byte as it arrives.

- No buffering: every chunk read from the replica is sent to the client at once.
- A replica that fails before answering (connection refused or reset, or a 503 from a replica
  that is draining or full) is retried once on another replica.
- After the first byte a failure cannot be hidden: an SSE stream ends with an OpenAI-shaped
  ``error`` event (the openai SDK raises it); any other body is cut by closing the connection,
  so the client sees an incomplete response, never a silently truncated one.
- The caller cancels this coroutine when the client disconnects; closing the upstream
  connection makes the runtime abort the request in the engine.
- No client credential goes upstream: pods run the endpoint author's image. The gateway
  presents the endpoint's own gateway token and names the caller (``x-llmep-caller``), which
  the runtime believes only with that token (``llmendpoints_common.gateway_token``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import quote

import aiohttp
from llmendpoints_common.errors import APIError, error_object
from llmendpoints_common.gateway_token import CALLER_HEADER as _CALLER

CALLER_HEADER = _CALLER.encode()

logger = logging.getLogger("llmendpoints.gateway.proxy")

# Hop-by-hop headers (RFC 9110 7.6.1) and the ones the client library sets itself.
_DROP_REQUEST = frozenset(
    {
        b"host",
        b"connection",
        b"keep-alive",
        b"proxy-connection",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
        b"content-length",
        b"expect",
        # credentials: the client's stay here
        b"authorization",
        b"proxy-authorization",
        b"x-api-key",
        b"cookie",
        CALLER_HEADER,
        b"x-request-id",  # replaced by the request's own (checked) id
    }
)
_DROP_RESPONSE = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "content-length",
        "date",
        "server",
    }
)


class UpstreamFailed(Exception):
    """The replica failed before sending a byte; another may be tried."""

    def __init__(self, replica: str, reason: str, status: int | None = None):
        super().__init__(f"{replica}: {reason}")
        self.replica = replica
        self.reason = reason
        self.status = status


@dataclass
class UpstreamResult:
    status: int
    first_byte_s: float | None
    duration_s: float
    body_bytes: int
    meter: Meter | None = None


class Meter(Protocol):
    usage: Any

    def feed(self, chunk: bytes) -> bytes: ...

    def flush(self) -> bytes: ...


def upstream_headers(
    headers: list[tuple[bytes, bytes]], request_id: str, *, token: str | None, caller: str
) -> dict[str, str]:
    """What goes upstream: the client's headers less hop-by-hop ones and credentials, the
    request's id, and -- with a gateway token -- the gateway's credential and the caller."""
    out: dict[str, str] = {}
    for name, value in headers:
        if name not in _DROP_REQUEST:
            key = name.decode("latin-1")
            text = value.decode("latin-1")
            out[key] = f"{out[key]}, {text}" if key in out else text
    out["x-request-id"] = request_id
    if token is not None:
        out["authorization"] = f"Bearer {token}"
        out[CALLER_HEADER.decode()] = quote(caller, safe="")  # any key name, as header-safe text
    return out


async def forward(
    session: aiohttp.ClientSession,
    replica: str,
    method: str,
    path_qs: str,
    headers: dict[str, str],
    body: bytes,
    send,
    *,
    retriable_503: bool,
    meter: Callable[[int, bool], Meter | None] | None = None,
) -> UpstreamResult:
    """Send the request to ``replica`` and relay its answer through the ASGI ``send``.

    Raises UpstreamFailed when nothing has been sent to the client yet and the failure is one
    another replica may not have.

    ``meter(status, is_sse)``: a reader the answer's bytes pass through (metering.py), which
    may hold back or drop some (the usage chunk the client did not ask for).
    """
    started = time.perf_counter()
    try:
        response = await session.request(
            method, replica + path_qs, data=body or None, headers=headers, allow_redirects=False
        )
    except (TimeoutError, aiohttp.ClientConnectionError) as exc:
        raise UpstreamFailed(replica, _describe(exc)) from exc
    try:
        if response.status == 503 and retriable_503:
            await response.read()
            raise UpstreamFailed(replica, "answered 503", status=503)
        response_headers = [
            (k.lower().encode("latin-1"), v.encode("latin-1"))
            for k, v in response.headers.items()
            if k.lower() not in _DROP_RESPONSE
        ]
        if "x-request-id" not in response.headers:
            response_headers.append((b"x-request-id", headers["x-request-id"].encode("latin-1")))
        is_sse = response.content_type == "text/event-stream"
        reader = meter(response.status, is_sse) if meter is not None else None
        result_meter = reader
        first_byte: float | None = None
        sent = 0
        try:
            chunk = await response.content.readany()
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise UpstreamFailed(replica, _describe(exc)) from exc
        first_byte = time.perf_counter() - started
        await send(
            {"type": "http.response.start", "status": response.status, "headers": response_headers}
        )
        try:
            while chunk:
                sent += len(chunk)
                out = chunk if reader is None else reader.feed(chunk)
                if out:
                    await send({"type": "http.response.body", "body": out, "more_body": True})
                chunk = await response.content.readany()
            if reader is not None and (tail := reader.flush()):
                await send({"type": "http.response.body", "body": tail, "more_body": True})
        except (TimeoutError, aiohttp.ClientError) as exc:
            logger.warning(
                "replica %s failed mid-response after %d bytes: %s", replica, sent, _describe(exc)
            )
            if not is_sse:
                raise  # the server closes the connection: an incomplete body, not a short one
            event = {"error": error_object(502, f"the replica failed mid-stream: {_describe(exc)}")}
            await send(
                {
                    "type": "http.response.body",
                    "body": b"data: " + json.dumps(event).encode() + b"\n\n",
                    "more_body": True,
                }
            )
            status = 502
        else:
            status = response.status
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        return UpstreamResult(status, first_byte, time.perf_counter() - started, sent, result_meter)
    finally:
        # On cancellation (client gone) this closes the connection: the runtime sees the
        # disconnect and aborts the request in the engine.
        response.close()


def _describe(exc: BaseException) -> str:
    if isinstance(exc, asyncio.TimeoutError):
        return "timed out"
    text = str(exc) or type(exc).__name__
    return text if len(text) < 300 else text[:300] + "..."


def bad_gateway(replica_failures: list[UpstreamFailed]) -> APIError:
    reasons = "; ".join(str(f) for f in replica_failures)
    return APIError(502, f"no replica answered: {reasons}", code="upstream_failed")
