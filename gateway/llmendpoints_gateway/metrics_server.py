"""``/metrics`` on a port of its own (GATEWAY_METRICS_PORT), never on the client port.

The gateway's series name endpoints and, when asked for, keys: what a tenant must not read.
The chart exposes this port to the cluster's monitoring only (a PodMonitor / ServiceMonitor),
never through the gateway's Service or Ingress.
"""

from __future__ import annotations

import logging
import socket

from aiohttp import web

from llmendpoints_gateway.metrics import CONTENT_TYPE, GatewayMetrics

logger = logging.getLogger("llmendpoints.gateway.metrics")


class MetricsServer:
    """On ``host:port``, or -- a worker of several (workers.py) -- on the loopback socket its
    supervisor gave it, which serves the workers' sum on the port."""

    def __init__(
        self, metrics: GatewayMetrics, host: str, port: int, sock: socket.socket | None = None
    ):
        self.metrics = metrics
        self.host = host
        self.port = port
        self.sock = sock
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        if self.sock is not None:
            await web.SockSite(self._runner, self.sock).start()
            return
        await web.TCPSite(self._runner, self.host, self.port).start()
        logger.info("metrics on port %d", self.port)

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _metrics(self, _: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), headers={"content-type": CONTENT_TYPE})
