"""Run the app under uvicorn with a graceful drain.

On SIGTERM (or SIGINT) readiness turns 503 at once, but the listener stays open: Kubernetes
takes a moment to remove the pod from its Service, and requests that still arrive are served.
The server stops listening as soon as nothing is in flight (HTTP requests, streams, queued and
running jobs, webhooks still being delivered) or when DRAIN_TIMEOUT_SECONDS have passed,
whichever comes first; then the app's lifespan drains the features within what is left of that
time (jobs still running end FAILED, their webhooks are sent) and stops the engine. A second
signal exits at once.
"""

from __future__ import annotations

import asyncio
import logging
import signal

import uvicorn
from starlette.types import ASGIApp

from llmendpoints_runtime.app import Runtime

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
        lifespan="on",
    )
    server = DrainingServer(config, runtime)
    server.run()
