"""Build the gateway from its settings and run it under uvicorn with a graceful drain.

On SIGTERM (or SIGINT): /ready turns 503, held requests are answered 503 with Retry-After at
once, the listener stays open (a Service takes a moment to stop sending), and the process exits
when nothing is in flight and no job webhook is still being delivered, or after
DRAIN_TIMEOUT_SECONDS. A second signal exits at once.
"""

from __future__ import annotations

import asyncio
import logging
import signal

import uvicorn

from llmendpoints_gateway.app import Gateway
from llmendpoints_gateway.config import GatewaySettings
from llmendpoints_gateway.keys import KeyRing
from llmendpoints_gateway.limiter import Limiter
from llmendpoints_gateway.metrics import GatewayMetrics
from llmendpoints_gateway.registry import Registry

logger = logging.getLogger("llmendpoints.gateway.server")


def build(settings: GatewaySettings) -> Gateway:
    metrics = GatewayMetrics(key_labels=settings.metrics_key_labels)
    registry = Registry(metrics, settings.hold_queue_length, settings.load_factor)
    keys = KeyRing.from_settings(
        settings.api_keys.get_secret_value() if settings.api_keys else None,
        settings.api_keys_file,
        settings.endpoints_file,
    )
    url = settings.jobs_queue_url.get_secret_value() if settings.jobs_queue_url else None
    # Per-key limits: shared by every replica through NATS when there is one, else this
    # replica's own; usage records need NATS too.
    limiter = Limiter(settings.gateway_id, url)
    gateway = Gateway(settings, keys, registry, metrics, limiter=limiter)
    gateway.started.append(limiter.start)
    gateway.stopped.append(limiter.stop)
    if settings.endpoints_file:
        from llmendpoints_gateway.discovery.static import StaticDiscovery

        static = StaticDiscovery(settings.endpoints_file, registry, settings.probe_interval_seconds)
        gateway.started.append(static.start)
        gateway.stopped.append(static.stop)
    else:
        from llmendpoints_gateway.discovery.kube import KubeDiscovery

        kube = KubeDiscovery(
            registry, keys, namespace=settings.namespace, keys_namespace=settings.keys_namespace
        )
        gateway.started.append(kube.start)
        gateway.stopped.append(kube.stop)
    if settings.jobs_queue_url is not None:
        from llmendpoints_gateway.jobs import JobGateway, JobUsageMeter
        from llmendpoints_gateway.metering import UsagePublisher
        from llmendpoints_gateway.signals import SignalPublisher

        publisher = SignalPublisher(url, settings.gateway_id)
        registry.on_held = publisher.held_changed
        gateway.nudge = publisher.nudge_soon
        gateway.jobs = JobGateway(
            url,
            publisher.gateway_id,
            webhook_policy=settings.webhook_policy,
            webhook_timeout_seconds=settings.webhook_timeout_seconds,
            webhook_max_concurrency=settings.webhook_max_concurrency,
        )
        gateway.usage = UsagePublisher(url, publisher.gateway_id)
        job_usage = JobUsageMeter(url, publisher.gateway_id, gateway.job_usage)
        for part in (publisher, gateway.jobs, gateway.usage, job_usage):
            gateway.started.append(part.start)
            gateway.stopped.append(part.stop)
    return gateway


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, gateway: Gateway):
        super().__init__(config)
        self.gateway = gateway
        self._drain_task: asyncio.Task | None = None

    def handle_exit(self, sig: int, frame) -> None:
        if self._drain_task is not None:
            logger.warning("second %s: exiting now", signal.Signals(sig).name)
            self.force_exit = True
            self.should_exit = True
            return
        logger.info("%s received: draining", signal.Signals(sig).name)
        self.gateway.start_draining()
        self._drain_task = asyncio.get_event_loop().create_task(self._drain())

    async def _drain(self) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.gateway.settings.drain_timeout_seconds
        while loop.time() < deadline and self.gateway.busy > 0:
            await asyncio.sleep(0.1)
        if self.gateway.busy:
            logger.warning(
                "drain timeout reached with %d request(s) in flight and %d webhook(s) pending",
                self.gateway.active,
                self.gateway.busy - self.gateway.active,
            )
        else:
            logger.info("drained: nothing in flight")
        self.should_exit = True


def serve(settings: GatewaySettings) -> None:
    gateway = build(settings)
    config = uvicorn.Config(
        gateway,
        host=settings.host,
        port=settings.port,
        http="httptools",
        loop="uvloop",
        log_config=None,
        access_log=False,  # the gateway writes its own access line with routing fields
        timeout_keep_alive=30,
        timeout_graceful_shutdown=5,
        backlog=4096,
        lifespan="on",
    )
    DrainingServer(config, gateway).run()
