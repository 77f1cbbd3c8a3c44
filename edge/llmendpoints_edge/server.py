"""uvicorn with a graceful drain and bounded request headers.

**Drain.** On SIGTERM (or SIGINT) the served component is told at once (readiness turns 503,
held requests are answered) but the listener stays open: Kubernetes takes a moment to remove
the pod from its Service, and requests that still arrive are served. The server stops listening
as soon as the component has nothing in flight, or when DRAIN_TIMEOUT_SECONDS have passed,
whichever comes first. A second signal exits at once. What "in flight" means is the component's
(``Drainable.busy``): requests, streams, jobs, webhooks being delivered, limiter updates...

**Headers.** uvicorn bounds neither slow nor huge request headers (measured with uvicorn 0.54: a
connection that sends nothing, or one header byte a second, is held for as long as the client
likes, and httptools accepts a 1 MiB header). Here the headers must be complete
REQUEST_READ_TIMEOUT_SECONDS after the connection opens or the request's first byte arrives
(408, closed), and end within the first MAX_HEADER_BYTES received (431, closed). The body has the
same deadline again, counted from the headers (``body.read_body``).

**Raw body writes.** A relay that streams thousands of small chunks (the gateway's SSE events)
pays for an ASGI ``send`` per chunk and the task switch that feeds it. ``RawBody`` (in the scope
at ``asgi.RAW_BODY``) writes a chunk straight to the connection, framed as uvicorn frames a chunked
body, from a plain callback: the response head and its end still go through ASGI, so uvicorn's
keep-alive and completion logic is untouched. It relies on uvicorn's httptools cycle
(``chunked_encoding``, ``flow``, ``transport``, ``disconnected``), as the header bound relies on
``cycle``.

**Bodies end with their request.** uvicorn's protocol keeps a connection's last request scope
(and the edge keeps the body it read in that scope) until the next request or the keep-alive
timeout; when the client resets the connection (it hung up before reading the whole answer),
uvicorn leaves the keep-alive timer armed, and the timer keeps the protocol, the scope and the
body for the whole timeout (75 s). Measured: 40 x 10 MB requests a round took a gateway from
126 to 3,605 MiB in 9 rounds. Here the body leaves the scope when the application returns
(``body.release``), and a lost connection cancels its keep-alive timer whatever the reason.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
import socket
from typing import Any, Protocol

import uvicorn
from llmendpoints_common.errors import APIError, RequestTimeoutError

from llmendpoints_edge.asgi import RAW_BODY, ASGIApp, Receive, Scope, Send
from llmendpoints_edge.body import release
from llmendpoints_edge.memory import HeapTrimmer
from llmendpoints_edge.settings import DEFAULT_MAX_HEADER_BYTES, EdgeSettings

try:  # what uvicorn's "auto" picks when httptools is installed (it is, with both components)
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as _HTTPProtocol

    _RAW_BODY = True
except ImportError:  # pragma: no cover
    from uvicorn.protocols.http.h11_impl import H11Protocol as _HTTPProtocol  # type: ignore[assignment]

    _RAW_BODY = False

logger = logging.getLogger("llmendpoints.edge.server")


class Drainable(Protocol):
    """What the server asks of the component it serves."""

    def start_draining(self) -> None:
        """SIGTERM arrived: stop being ready, take no new work that can go elsewhere."""
        ...

    def busy(self) -> int:
        """Work still in flight; the drain ends when it reaches 0."""
        ...

    def set_drain_deadline(self, deadline: float) -> None:
        """Event-loop time by which the component's own shutdown should be over."""
        ...


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, component: Drainable, drain_timeout: float):
        super().__init__(config)
        self.component = component
        self.drain_timeout = drain_timeout
        self._drain_task: asyncio.Task | None = None
        self._tick: asyncio.Future[None] | None = None

    async def main_loop(self) -> None:
        """uvicorn's loop, ticking once a second instead of ten times a second: its periodic
        work (the Date header) is once a second anyway, and an idle process should not wake
        ten times a second for nothing (measured: 1.2 ms of CPU a second in an idle gateway,
        issue 33). A signal or the drain's end wakes it at once."""
        loop = asyncio.get_running_loop()
        counter = 0
        should_exit = await self.on_tick(counter)
        while not should_exit:
            counter = (counter + 10) % 864000  # a multiple of 10: uvicorn's once-a-second work
            self._tick = tick = loop.create_future()
            timer = loop.call_later(1.0, self._wake_main_loop)
            await tick
            timer.cancel()
            should_exit = await self.on_tick(counter)

    def _wake_main_loop(self) -> None:
        if self._tick is not None and not self._tick.done():
            self._tick.set_result(None)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        # What start-up made (modules, settings, the app) lives as long as the process: out of
        # the collector's sight, so its full collections, triggered by the objects requests
        # allocate, no longer walk the ~100 MB of it each time (gc.freeze's documented use).
        gc.freeze()

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self._drain_task is not None:
            logger.warning("second %s: exiting now", signal.Signals(sig).name)
            self.force_exit = True
            self.should_exit = True
            self._wake_main_loop()
            return
        logger.info("%s received: draining (readiness is now 503)", signal.Signals(sig).name)
        self.component.start_draining()
        self._drain_task = asyncio.get_event_loop().create_task(self._drain())

    async def _drain(self) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.drain_timeout
        self.component.set_drain_deadline(deadline)
        while loop.time() < deadline:
            if self.component.busy() == 0:
                logger.info("drained: nothing in flight")
                break
            await asyncio.sleep(0.1)
        else:
            logger.warning(
                "drain timeout (%.0f s) reached with %d unit(s) of work still in flight",
                self.drain_timeout,
                self.component.busy(),
            )
        self.should_exit = True
        self._wake_main_loop()


class RawBody:
    """One response's body written straight to its connection (see the module docstring):
    only between ``http.response.start`` (no content-length: chunked) and the final empty
    ``http.response.body``, both sent through ASGI."""

    __slots__ = ("_cycle",)

    def __init__(self, cycle: Any) -> None:
        self._cycle = cycle

    @property
    def ready(self) -> bool:
        """The head went out, chunked, and the body is not complete."""
        c = self._cycle
        return bool(c.response_started and c.chunked_encoding and not c.response_complete)

    @property
    def closed(self) -> bool:
        return bool(self._cycle.disconnected or self._cycle.transport.is_closing())

    @property
    def paused(self) -> bool:
        """The connection's write buffer is full (the client reads slower than we write)."""
        return bool(self._cycle.flow.write_paused)

    def write(self, data: bytes) -> bool:
        """One chunk of the body; False when the connection is gone."""
        if self.closed:
            return False
        self._cycle.transport.write(b"%x\r\n%b\r\n" % (len(data), data))
        return True

    async def drain(self) -> None:
        await self._cycle.flow.drain()


class BoundedHeadersProtocol(_HTTPProtocol):  # type: ignore[misc, valid-type]
    """uvicorn's HTTP protocol with a deadline and a size bound on request headers.

    It relies on what both of uvicorn's protocols do: ``self.cycle`` is replaced when a
    request's headers are complete, and is None or ``response_complete`` while the connection
    waits for the next request. Idle time between requests stays uvicorn's keep-alive timeout.
    """

    header_timeout = 30.0  # set by protocol_class()
    max_header_bytes = DEFAULT_MAX_HEADER_BYTES

    def connection_made(self, transport) -> None:  # type: ignore[no-untyped-def]
        super().connection_made(transport)
        self._header_bytes = 0
        self._header_tail = b""  # the last bytes seen, for an end of headers split across reads
        self._header_timer: asyncio.TimerHandle | None = None
        self._arm_header_timer()

    def data_received(self, data: bytes) -> None:
        before = self.cycle
        reading_headers = before is None or before.response_complete
        if reading_headers:
            if self._header_timer is None:
                self._arm_header_timer()
            # Measured before the parser sees the bytes: headers that end in this read but
            # are too large never become a request (the application would already be running
            # by the time the parser had said so).
            seen = self._header_bytes
            end = (self._header_tail + data).find(b"\r\n\r\n")
            size = seen + len(data) if end < 0 else seen - len(self._header_tail) + end + 4
            if size > self.max_header_bytes:
                # What the parser holds is bounded by this limit plus one read (asyncio reads
                # at most 256 KiB at a time).
                self._refuse(
                    APIError(431, f"request headers are larger than {self.max_header_bytes} bytes")
                )
                return
            self._header_bytes += len(data)
            self._header_tail = (self._header_tail + data)[-3:]
        super().data_received(data)
        if self.cycle is not before:  # the headers are complete (the rest of data is body)
            self._header_bytes = 0
            self._header_tail = b""
            self._cancel_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)
        # uvicorn cancels it only on a clean close (exc None): after a reset the armed timer
        # would keep this protocol, its last scope and everything in it for the whole timeout.
        self._unset_keepalive_if_required()

    def on_headers_complete(self) -> None:
        super().on_headers_complete()
        cycle = self.cycle
        if _RAW_BODY and cycle is not None and cycle.scope is self.scope:
            self.scope.setdefault("extensions", {})[RAW_BODY] = RawBody(cycle)

    def _arm_header_timer(self) -> None:
        self._header_timer = self.loop.call_later(self.header_timeout, self._headers_late)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_late(self) -> None:
        self._header_timer = None
        if self.cycle is None or self.cycle.response_complete:
            self._refuse(
                RequestTimeoutError(
                    f"the request headers did not arrive within {self.header_timeout:g} s "
                    "(REQUEST_READ_TIMEOUT_SECONDS)"
                )
            )

    def _refuse(self, exc: APIError) -> None:
        """Answer in OpenAI's error shape, outside any request cycle, and close."""
        self._cancel_header_timer()
        if self.transport.is_closing():
            return
        body = exc.body_bytes()
        phrase = {408: "Request Timeout", 431: "Request Header Fields Too Large"}[exc.status_code]
        head = (
            f"HTTP/1.1 {exc.status_code} {phrase}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
        )
        self.transport.write(head.encode() + body)
        self.transport.close()


def protocol_class(
    header_timeout: float, max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES
) -> type[asyncio.Protocol]:
    return type(
        "BoundedHeaders",
        (BoundedHeadersProtocol,),
        {"header_timeout": header_timeout, "max_header_bytes": max_header_bytes},
    )


def releasing_bodies(app: ASGIApp, trimmer: HeapTrimmer | None = None) -> ASGIApp:
    """``app`` whose requests drop the body the edge kept for them when they end, however they
    end (the scope outlives them: see the module docstring); ``trimmer`` is told each size."""

    async def app_releasing_bodies(scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await app(scope, receive, send)
        finally:
            size = release(scope)
            if trimmer is not None and size:
                trimmer.released(size)

    return app_releasing_bodies


def uvicorn_config(
    app: Any,
    settings: EdgeSettings,
    trimmer: HeapTrimmer | None = None,
    **uvicorn_options: Any,
) -> uvicorn.Config:
    """uvicorn's configuration on the edge's settings; ``uvicorn_options`` are what differs
    between the two servers; ``trimmer``: give the heap back after large bodies (memory.py)."""
    options: dict[str, Any] = {
        "host": settings.host,
        "port": settings.port,
        "log_config": None,  # logging is configured by logs.configure
        "http": protocol_class(settings.request_read_timeout_seconds, settings.max_header_bytes),
        "timeout_keep_alive": settings.keep_alive_timeout_seconds,
        # By the time uvicorn shuts down, the drain has already waited; only stragglers remain.
        "timeout_graceful_shutdown": 5,
        "lifespan": "on",
    }
    return uvicorn.Config(releasing_bodies(app, trimmer), **(options | uvicorn_options))


def serve(
    app: Any,
    component: Drainable,
    settings: EdgeSettings,
    *,
    sockets: list[socket.socket] | None = None,
    trimmer: HeapTrimmer | None = None,
    **uvicorn_options: Any,
) -> None:
    """Serve ``app`` on the edge's settings (address, header bounds, keep-alive, drain) until a
    signal ends the drain of ``component``; on ``sockets`` (listening already, e.g. one of
    several SO_REUSEPORT sockets on one port) instead of binding the settings' address;
    ``trimmer``: give the heap back after large bodies (memory.py)."""
    config = uvicorn_config(app, settings, trimmer, **uvicorn_options)
    DrainingServer(config, component, settings.drain_timeout_seconds).run(sockets=sockets)
