"""``/metrics`` on a port of its own (GATEWAY_METRICS_PORT), never on the client port.

The gateway's series name endpoints and, when asked for, keys: what a tenant must not read.
The chart exposes this port to the cluster's monitoring only (a PodMonitor / ServiceMonitor),
never through the gateway's Service or Ingress.
"""

from __future__ import annotations

import logging

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from llmendpoints_gateway.metrics import GatewayMetrics

logger = logging.getLogger("llmendpoints.gateway.metrics")


class MetricsServer:
    def __init__(self, metrics: GatewayMetrics, host: str, port: int):
        self.metrics = metrics
        self.host = host
        self.port = port
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, self.host, self.port).start()
        logger.info("metrics on port %d", self.port)

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _metrics(self, _: web.Request) -> web.Response:
        body = generate_latest(self.metrics.registry)
        return web.Response(body=body, headers={"content-type": CONTENT_TYPE_LATEST})
