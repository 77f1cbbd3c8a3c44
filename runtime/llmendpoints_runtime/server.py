"""Serve the runtime under the edge's server (``llmendpoints_edge.server``): uvicorn with a
graceful drain and bounded request headers.

On SIGTERM readiness turns 503 at once while the listener stays open; the server stops
listening as soon as nothing is in flight (HTTP requests, streams, queued and running jobs,
webhooks still being delivered) or when DRAIN_TIMEOUT_SECONDS have passed; then the app's
lifespan drains the features within what is left of that time (jobs still running end FAILED,
their webhooks are sent) and stops the engine.
"""

from __future__ import annotations

import socket

from llmendpoints_edge.asgi import ASGIApp
from llmendpoints_edge.server import serve as serve_edge

from llmendpoints_runtime.app import Runtime


def serve(runtime: Runtime, app: ASGIApp, *, sockets: list[socket.socket] | None = None) -> None:
    """Serve ``app`` (built on ``runtime`` by compose.create_app) until a signal ends the drain;
    on ``sockets`` (listening already: a pod's API processes share one) or HOST:PORT."""
    settings = runtime.config.settings
    args = runtime.config.engine_args
    serve_edge(
        app,
        runtime,
        settings,
        sockets=sockets,
        access_log=not args.disable_uvicorn_access_log,
        ssl_keyfile=args.ssl_keyfile,
        ssl_certfile=args.ssl_certfile,
        ssl_ca_certs=args.ssl_ca_certs,
        ssl_ciphers=args.ssl_ciphers or "TLSv1",
        h11_max_incomplete_event_size=args.h11_max_incomplete_event_size,
    )
