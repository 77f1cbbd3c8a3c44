"""Forward one request to a replica and stream the answer back, byte for byte as it arrives.

- No buffering: every chunk read from the replica is sent to the client at once -- from the
  upstream connection's own callback (upstream.py), straight to the client's connection
  (``llmendpoints_edge.server.RawBody``), with no task switch per chunk.
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
import contextlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import quote

from llmendpoints_common.errors import APIError, error_object
from llmendpoints_common.gateway_token import CALLER_HEADER as _CALLER

from llmendpoints_gateway.upstream import Connection, UpstreamError, UpstreamPool

CALLER_HEADER = _CALLER.encode()

logger = logging.getLogger("llmendpoints.gateway.proxy")

# Hop-by-hop headers (RFC 9110 7.6.1) and the framing each side sets itself.
_HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-connection",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
        b"content-length",
    }
)
_DROP_REQUEST = _HOP_BY_HOP | {
    b"host",
    b"expect",
    # credentials: the client's stay here
    b"authorization",
    b"proxy-authorization",
    b"x-api-key",
    b"cookie",
    CALLER_HEADER,
    b"x-request-id",  # replaced by the request's own (checked) id
}
_DROP_RESPONSE = _HOP_BY_HOP | {b"date", b"server"}


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
    ended: bool  # the answer's last event has passed (a stream's [DONE])

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
    pool: UpstreamPool,
    replica: str,
    method: str,
    path_qs: str,
    headers: dict[str, str],
    body: bytes,
    send,
    *,
    retriable_503: bool,
    meter: Callable[[int, bool], Meter | None] | None = None,
    raw: Any = None,
) -> UpstreamResult:
    """Send the request to ``replica`` and relay its answer through the ASGI ``send``.

    Raises UpstreamFailed when nothing has been sent to the client yet and the failure is one
    another replica may not have.

    ``meter(status, is_sse)``: a reader the answer's bytes pass through (metering.py), which
    may hold back or drop some (the usage chunk the client did not ask for). ``raw``: the
    client connection's ``llmendpoints_edge.server.RawBody``, through which body chunks are
    written from the upstream connection's callback (None: every chunk through ``send``).
    """
    started = time.perf_counter()
    conn = await _exchange(
        pool, replica, _request_head(pool, replica, method, path_qs, headers, body) + body
    )
    relay: _Relay | None = None
    try:
        if conn.status == 503 and retriable_503:
            conn.attach(lambda chunk: None, lambda: None)
            with contextlib.suppress(UpstreamError):
                await _until_end(conn)
            raise UpstreamFailed(replica, "answered 503", status=503)
        response_headers = [h for h in conn.headers if h[0] not in _DROP_RESPONSE]  # lowercase
        if not any(name == b"x-request-id" for name, _ in response_headers):
            response_headers.append((b"x-request-id", headers["x-request-id"].encode("latin-1")))
        is_sse = _content_type(response_headers) == b"text/event-stream"
        reader = meter(conn.status, is_sse) if meter is not None else None
        try:
            await conn.first()
        except UpstreamError as exc:
            raise UpstreamFailed(replica, exc.reason) from exc
        first_byte = time.perf_counter() - started
        await send(
            {"type": "http.response.start", "status": conn.status, "headers": response_headers}
        )
        relay = _Relay(conn, reader, raw if raw is not None and raw.ready else None)
        conn.attach(relay.feed, relay.poke, relay.flush)
        status = conn.status
        last = b""
        try:
            await relay.run(send)
        except UpstreamError as exc:
            logger.warning(
                "replica %s failed mid-response after %d bytes: %s", replica, relay.received, exc
            )
            if not is_sse:
                raise UpstreamCut(replica, exc.reason) from exc  # cut: an incomplete body
            event = {"error": error_object(502, f"the replica failed mid-stream: {exc.reason}")}
            await relay.out(send, b"data: " + json.dumps(event).encode() + b"\n\n")
            status = 502
        else:
            # The last read's bytes and the reader's tail leave with the end of the answer.
            last = relay.take() + (reader.flush() if reader is not None else b"")
        await send({"type": "http.response.body", "body": last, "more_body": False})
        return UpstreamResult(
            status, first_byte, time.perf_counter() - started, relay.received, reader
        )
    finally:
        # Back to the pool when the answer is whole; closed otherwise -- on cancellation (the
        # client left) closing is what makes the runtime abort the request in the engine.
        conn.finish()


class UpstreamCut(Exception):
    """A replica failed in the middle of a non-streamed answer: the client's connection is cut
    (an incomplete body, never a silently short one)."""

    def __init__(self, replica: str, reason: str):
        super().__init__(f"{replica}: {reason}")


async def _exchange(pool: UpstreamPool, replica: str, request: bytes) -> Connection:
    """A connection with the answer's head in; a reused connection the replica had closed is
    replaced by a fresh one once (the request never reached the application)."""
    for attempt in range(2):
        try:
            conn = await pool.connect(replica)
        except UpstreamError as exc:
            raise UpstreamFailed(replica, exc.reason) from exc
        conn.send(request)
        try:
            await conn.head()
            return conn
        except UpstreamError as exc:
            conn.close()
            if exc.stale and attempt == 0:
                continue
            raise UpstreamFailed(replica, exc.reason) from exc
        except BaseException:
            conn.close()  # cancelled (the client left): the replica must see it too
            raise
    raise AssertionError("unreachable")


async def _until_end(conn: Connection) -> None:
    done = asyncio.get_running_loop().create_future()

    def end() -> None:
        if not done.done():
            done.set_result(None)

    conn.attach(lambda chunk: None, end)
    if not (conn.complete or conn.error):
        await done
    if conn.error is not None:
        raise conn.error


def _request_head(
    pool: UpstreamPool,
    replica: str,
    method: str,
    path_qs: str,
    headers: dict[str, str],
    body: bytes,
) -> bytes:
    _, _, host = pool.address(replica)
    lines = [f"{method} {path_qs} HTTP/1.1\r\n".encode("latin-1"), b"host: " + host + b"\r\n"]
    if body or method in ("POST", "PUT", "PATCH"):
        lines.append(b"content-length: %d\r\n" % len(body))
    for name, value in headers.items():
        lines.append(f"{name}: {value}\r\n".encode("latin-1"))
    lines.append(b"\r\n")
    return b"".join(lines)


def _content_type(headers: list[tuple[bytes, bytes]]) -> bytes:
    for name, value in headers:
        if name == b"content-type":
            return value.split(b";", 1)[0].strip().lower()
    return b""


class _Relay:
    """Moves one answer's body from the replica's connection to the client's.

    ``feed`` and ``flush`` run in the upstream connection's callback: each chunk goes through
    the metering reader, and what one read from the replica brought goes, with a RawBody,
    straight to the client connection in one write -- no task switch. The request's task
    (``run``) sleeps until the answer ends, waking only to wait for a slow client (reading from
    the replica is paused meanwhile) or, without a RawBody, to send what was queued. The read
    that completes the answer is left for the task, which sends it with the answer's end (one
    write: the last chunk and the terminator)."""

    def __init__(self, conn: Connection, reader: Meter | None, raw: Any) -> None:
        self.conn = conn
        self.reader = reader
        self.raw = raw
        self.received = 0
        self._out: list[bytes] = []  # this read's chunks, as the reader passed them
        self._queue: list[bytes] = []
        self._wake: asyncio.Future[None] | None = None

    def feed(self, chunk: bytes) -> None:
        self.received += len(chunk)
        out = chunk if self.reader is None else self.reader.feed(chunk)
        if out:
            self._out.append(out)

    def flush(self) -> None:
        if not self._out or self.conn.complete:
            return
        data = self.take()
        raw = self.raw
        if raw is None:
            self._queue.append(data)
            self.poke()
        elif not raw.write(data):
            self.conn.pause_reading()  # the client is gone: the disconnect watcher cancels us
        elif raw.paused:
            self.conn.pause_reading()
            self.poke()

    def take(self) -> bytes:
        data = self._out[0] if len(self._out) == 1 else b"".join(self._out)
        self._out.clear()
        return data

    def poke(self) -> None:
        if self._wake is not None and not self._wake.done():
            self._wake.set_result(None)

    async def run(self, send) -> None:
        """Until the answer is complete (UpstreamError if the connection fails first)."""
        conn, raw = self.conn, self.raw
        loop = asyncio.get_running_loop()
        while True:
            while self._queue:
                chunk = self._queue.pop(0)
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            if raw is not None and raw.paused and not raw.closed:
                await raw.drain()
                conn.resume_reading()
                continue
            if conn.error is not None:
                raise conn.error
            if conn.complete:
                return
            self._wake = loop.create_future()
            await self._wake
            self._wake = None

    async def out(self, send, data: bytes) -> None:
        """A chunk of the task's own (the tail held by the reader, an error event)."""
        if self.raw is not None and self.raw.ready:
            self.raw.write(data)
        else:
            await send({"type": "http.response.body", "body": data, "more_body": True})


def bad_gateway(replica_failures: list[UpstreamFailed]) -> APIError:
    reasons = "; ".join(str(f) for f in replica_failures)
    return APIError(502, f"no replica answered: {reasons}", code="upstream_failed")
