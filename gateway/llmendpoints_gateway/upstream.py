"""The gateway's HTTP/1.1 client to replicas: keep-alive connections, each an asyncio Protocol
that parses the replica's answer with httptools (the C parser uvicorn uses) as it arrives and
hands every body chunk, from its ``data_received`` callback, to a sink.

Why not aiohttp's client, which the gateway used before (bench/RESULTS.md, "A cheaper front
door"): every chunk read from a replica went through aiohttp's StreamReader, woke the request's
task, and went back out through an ASGI ``send`` -- about 22 µs of CPU per relayed SSE event,
and vLLM sends one event per token. Here a chunk goes from the replica's socket to the sink (the
metering reader, then the client's connection: ``llmendpoints_edge.server.RawBody``) in one
callback; the request's task wakes only for the answer's head, its first body bytes and its end.

Connections are reused for up to ``IDLE_SECONDS`` idle, below the runtime's keep-alive
(``KEEP_ALIVE_TIMEOUT_SECONDS``, 75 s), so
the pool rarely hands out a connection the replica is closing; when it does -- a request written
to a reused connection that closes before a byte of answer -- the caller sends it once more on a
fresh connection (``UpstreamError.stale``): such a request never reached the application.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from urllib.parse import urlsplit

import httptools

IDLE_SECONDS = 30.0
MAX_HEAD_BYTES = 64 * 1024  # a replica's response head; pods run the endpoint author's image


class UpstreamError(Exception):
    """The connection failed, or the replica's answer was not HTTP."""

    def __init__(self, reason: str, *, answered: bool = False, stale: bool = False):
        super().__init__(reason)
        self.reason = reason
        self.answered = answered  # some of the answer had arrived
        self.stale = stale  # a reused connection that closed before any answer byte


def describe(exc: BaseException | None) -> str:
    if exc is None:
        return "connection closed"
    if isinstance(exc, TimeoutError):
        return "timed out"
    text = str(exc) or type(exc).__name__
    return text if len(text) < 300 else text[:300] + "..."


class Connection(asyncio.Protocol):
    """One keep-alive connection to a replica, one exchange at a time."""

    def __init__(self, pool: UpstreamPool, replica: str) -> None:
        self.pool = pool
        self.replica = replica
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.reused = False
        self.idle_since = 0.0
        self._reading = True
        self._reset()

    def _reset(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.head_bytes = 0
        self.keep_alive = False
        self.until_eof = False  # neither content-length nor chunked: the body ends at EOF
        self.complete = False
        self.error: UpstreamError | None = None
        self.answered = False
        self._head: asyncio.Future[None] = self.loop.create_future()
        self._first: asyncio.Future[None] = self.loop.create_future()
        self._pending: list[bytes] = []
        self.sink: Callable[[bytes], None] | None = None
        self.on_read: Callable[[], None] | None = None  # after each read's chunks went to sink
        self.on_end: Callable[[], None] | None = None  # completion or failure after the head

    # -- the exchange (the request's task) --

    def send(self, data: bytes) -> None:
        assert self.transport is not None
        self.transport.write(data)

    async def head(self) -> None:
        """Until the answer's status line and headers are in."""
        await self._head

    async def first(self) -> None:
        """Until the first body bytes (or the end of a body-less answer) are in."""
        await self._first

    def attach(
        self,
        sink: Callable[[bytes], None],
        on_end: Callable[[], None],
        on_read: Callable[[], None] | None = None,
    ) -> None:
        """From now on every body chunk goes to ``sink`` as it arrives (what arrived before
        first); ``on_read`` is called after the chunks of each read from the socket (one read
        can carry several: they can leave in one write); ``on_end`` when the answer completes
        or the connection fails."""
        pending, self._pending = self._pending, []
        self.sink, self.on_end, self.on_read = sink, on_end, on_read
        for chunk in pending:
            sink(chunk)
        if pending and on_read is not None:
            on_read()

    def pause_reading(self) -> None:
        if self._reading and self.transport is not None and not self.closed:
            self._reading = False
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if not self._reading and self.transport is not None and not self.closed:
            self._reading = True
            self.transport.resume_reading()

    def finish(self) -> None:
        """The exchange is over: back to the pool if the answer was whole and the replica
        keeps the connection, else closed."""
        if self.complete and self.keep_alive and not self.closed and self.error is None:
            self.resume_reading()
            self._reset()
            self.pool.release(self)
        else:
            self.close()

    def close(self) -> None:
        """Closing the connection is how a replica learns the client went away (the runtime
        aborts the request in the engine)."""
        if not self.closed and self.transport is not None:
            self.transport.close()
        self.closed = True

    # -- asyncio.Protocol --

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.answered = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(UpstreamError(f"invalid HTTP answer: {exc}", answered=True))
            self.close()
        if self.on_read is not None:
            self.on_read()

    def eof_received(self) -> bool:
        return False  # close the transport: connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.pool.forget(self)
        if self.until_eof and exc is None and self._head.done() and not self.complete:
            self.on_message_complete()
            return
        if not self.complete:
            self._fail(
                UpstreamError(
                    describe(exc),
                    answered=self.answered,
                    stale=self.reused and not self.answered,
                )
            )

    # -- httptools callbacks --

    def on_header(self, name: bytes, value: bytes) -> None:
        self.head_bytes += len(name) + len(value) + 4
        if self.head_bytes > MAX_HEAD_BYTES:
            raise ValueError("response headers too large")  # httptools: HttpParserCallbackError
        self.headers.append((name.lower(), value))  # lowercase, as ASGI has them

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self.keep_alive = self.parser.should_keep_alive()
        names = {name for name, _ in self.headers}
        self.until_eof = (
            b"content-length" not in names
            and b"transfer-encoding" not in names
            and self.status not in (204, 304)
            and self.status >= 200
        )
        if not self._head.done():
            self._head.set_result(None)

    def on_body(self, body: bytes) -> None:
        if not self._first.done():
            self._first.set_result(None)
        if self.sink is not None:
            self.sink(body)
        else:
            self._pending.append(body)

    def on_message_complete(self) -> None:
        self.complete = True
        for future in (self._head, self._first):
            if not future.done():
                future.set_result(None)
        if self.on_end is not None:
            self.on_end()

    def _fail(self, error: UpstreamError) -> None:
        if self.error is not None or self.complete:
            return
        self.error = error
        for future in (self._head, self._first):
            if not future.done():
                future.set_exception(error)
                future.exception()  # retrieved: the waiter, if any, still gets it
        if self.on_end is not None:
            self.on_end()


class UpstreamPool:
    """Keep-alive connections per replica (base URL ``http://host:port``), no upper bound (as
    the aiohttp pool before it: the engines bound their own concurrency)."""

    def __init__(self, connect_timeout: float, idle_seconds: float = IDLE_SECONDS) -> None:
        self.connect_timeout = connect_timeout
        self.idle_seconds = idle_seconds
        self._idle: dict[str, list[Connection]] = {}
        self._hosts: dict[str, tuple[str, int, bytes]] = {}

    def address(self, replica: str) -> tuple[str, int, bytes]:
        """(host, port, Host header) of a replica's base URL."""
        known = self._hosts.get(replica)
        if known is None:
            parts = urlsplit(replica)
            if parts.scheme != "http" or not parts.hostname:
                raise UpstreamError(f"not an http:// replica URL: {replica!r}")
            port = parts.port or 80
            known = self._hosts[replica] = (parts.hostname, port, parts.netloc.encode("latin-1"))
        return known

    async def connect(self, replica: str) -> Connection:
        """An idle connection to ``replica``, or a new one (UpstreamError if it cannot be had)."""
        idle = self._idle.get(replica)
        loop = asyncio.get_running_loop()
        while idle:
            conn = idle.pop()
            if conn.closed:
                continue
            if loop.time() - conn.idle_since > self.idle_seconds:
                conn.close()
                continue
            conn.reused = True
            return conn
        host, port, _ = self.address(replica)
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(lambda: Connection(self, replica), host, port),
                self.connect_timeout,
            )
        except (OSError, TimeoutError) as exc:
            raise UpstreamError(describe(exc)) from exc
        return conn

    def release(self, conn: Connection) -> None:
        conn.idle_since = asyncio.get_running_loop().time()
        self._idle.setdefault(conn.replica, []).append(conn)

    def forget(self, conn: Connection) -> None:
        idle = self._idle.get(conn.replica)
        if idle and conn in idle:
            idle.remove(conn)
            if not idle:
                del self._idle[conn.replica]

    def idle(self) -> int:
        return sum(len(conns) for conns in self._idle.values())

    async def close(self) -> None:
        for conns in list(self._idle.values()):
            for conn in list(conns):
                conn.close()
        self._idle.clear()
