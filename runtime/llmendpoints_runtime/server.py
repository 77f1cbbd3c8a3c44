"""Run the app under uvicorn with a graceful drain.

On SIGTERM (or SIGINT) readiness turns 503 at once, but the listener stays open: Kubernetes
takes a moment to remove the pod from its Service, and requests that still arrive are served.
The server stops listening as soon as nothing is in flight (HTTP requests, streams, queued and
running jobs, webhooks still being delivered) or when DRAIN_TIMEOUT_SECONDS have passed,
whichever comes first; then the app's lifespan drains the features within what is left of that
time (jobs still running end FAILED, their webhooks are sent) and stops the engine. A second
signal exits at once.

Slow or huge request headers are bounded here, below the ASGI app (uvicorn bounds neither:
measured with uvicorn 0.54, a connection that sends nothing, or one header byte a second, is
held for as long as the client likes, and httptools accepts a 1 MiB header): the headers must
be complete ``REQUEST_READ_TIMEOUT_SECONDS`` after the connection opens or the request's first
byte arrives (408, closed), and end within the first ``MAX_HEADER_BYTES`` received (431, closed). The body has
the same deadline again, counted from the headers (middleware.BodyGuard).
"""

from __future__ import annotations

import asyncio
import logging
import signal

import uvicorn
from llmendpoints_common.errors import APIError, RequestTimeoutError
from starlette.types import ASGIApp

from llmendpoints_runtime.app import Runtime

try:  # what uvicorn's "auto" picks
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as _AutoHTTPProtocol
except ImportError:  # pragma: no cover
    from uvicorn.protocols.http.h11_impl import H11Protocol as _AutoHTTPProtocol  # type: ignore[assignment]

logger = logging.getLogger("llmendpoints.server")


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, runtime: Runtime):
        super().__init__(config)
        self.runtime = runtime
        self._drain_task: asyncio.Task | None = None

    def handle_exit(self, sig: int, frame) -> None:
        if self._drain_task is not None:
            logger.warning("second %s: exiting now", signal.Signals(sig).name)
            self.force_exit = True
            self.should_exit = True
            return
        logger.info("%s received: draining (readiness is now 503)", signal.Signals(sig).name)
        self.runtime.health.start_draining()
        self._drain_task = asyncio.get_event_loop().create_task(self._drain())

    async def _drain(self) -> None:
        timeout = self.runtime.config.settings.drain_timeout_seconds
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        self.runtime.drain_deadline = deadline  # the lifespan's shutdown keeps to it too
        while loop.time() < deadline:
            busy = self.runtime.busy()
            if busy == 0:
                logger.info("drained: nothing in flight")
                break
            await asyncio.sleep(0.1)
        else:
            logger.warning(
                "drain timeout (%.0f s) reached with %d request(s) still in flight",
                timeout,
                self.runtime.busy(),
            )
        self.should_exit = True


# The request line and headers of one request (nginx's default buffers hold 32 KiB).
MAX_HEADER_BYTES = 64 * 1024


class BoundedHeadersProtocol(_AutoHTTPProtocol):  # type: ignore[misc, valid-type]
    """uvicorn's HTTP protocol with a deadline and a size bound on request headers.

    It relies on what both of uvicorn's protocols do: ``self.cycle`` is replaced when a
    request's headers are complete, and is None or ``response_complete`` while the connection
    waits for the next request. Idle time between requests stays uvicorn's keep-alive timeout.
    """

    header_timeout = 30.0  # set by protocol_class()

    def connection_made(self, transport) -> None:  # type: ignore[no-untyped-def]
        super().connection_made(transport)
        self._header_bytes = 0
        self._header_timer: asyncio.TimerHandle | None = None
        self._arm_header_timer()

    def data_received(self, data: bytes) -> None:
        before = self.cycle
        reading_headers = before is None or before.response_complete
        if reading_headers:
            self._header_bytes += len(data)
            if self._header_timer is None:
                self._arm_header_timer()
        super().data_received(data)
        if self.cycle is not before:  # the headers are complete (the rest of data is body)
            self._header_bytes = 0
            self._cancel_header_timer()
        elif reading_headers and self._header_bytes > MAX_HEADER_BYTES:
            # Still no end of headers: refused. What the parser holds is bounded by this
            # limit plus one read (asyncio reads at most 256 KiB at a time).
            self._refuse(APIError(431, f"request headers are larger than {MAX_HEADER_BYTES} bytes"))

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)

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


def protocol_class(header_timeout: float) -> type[asyncio.Protocol]:
    return type("BoundedHeaders", (BoundedHeadersProtocol,), {"header_timeout": header_timeout})


def serve(runtime: Runtime, app: ASGIApp) -> None:
    """Serve ``app`` (built on ``runtime`` by compose.create_app) until a signal ends the drain."""
    settings = runtime.config.settings
    args = runtime.config.engine_args
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_config=None,  # logging is configured by logs.configure
        access_log=not args.disable_uvicorn_access_log,
        timeout_keep_alive=5,
        # By the time uvicorn shuts down, the drain has already waited; only stragglers remain.
        timeout_graceful_shutdown=5,
        ssl_keyfile=args.ssl_keyfile,
        ssl_certfile=args.ssl_certfile,
        ssl_ca_certs=args.ssl_ca_certs,
        ssl_ciphers=args.ssl_ciphers or "TLSv1",
        h11_max_incomplete_event_size=args.h11_max_incomplete_event_size,
        http=protocol_class(settings.request_read_timeout_seconds),
        lifespan="on",
    )
    server = DrainingServer(config, runtime)
    server.run()
