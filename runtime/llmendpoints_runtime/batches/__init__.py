"""Batches on one pod: OpenAI's Batch API and RunPod's batch jobs without the shared queue.

The verbs, the validation, the state machine and the driver are ``llmendpoints_common.batch``'s
(the gateway runs the same on the shared queue); this package gives them a store on local disk
(``store.LocalBatchStore`` under the model cache, bounded), a lane in this process
(``local.LocalLines``) and FastAPI routes (``routes.py``). ``compose.py`` plugs the feature in.

All of it runs in the API process, on the loop that serves vLLM's routes, so nothing here holds
that loop: the store and the lane touch files in worker threads, and the driver parses an input
file in a worker thread a piece at a time as it streams from disk.
"""

from __future__ import annotations

import contextlib
import logging
import socket
from collections.abc import AsyncIterator, Callable
from pathlib import Path

from fastapi import APIRouter
from llmendpoints_common.batch.api import BatchAPI
from llmendpoints_common.batch.driver import BatchDrivers
from llmendpoints_common.batch.record import BatchRecord, runpod_summary
from llmendpoints_common.destinations import DestinationPolicy
from llmendpoints_common.webhooks import WebhookSender

from llmendpoints_runtime.batches.local import LocalLines
from llmendpoints_runtime.batches.routes import build_batch_routers
from llmendpoints_runtime.batches.store import LocalBatchStore
from llmendpoints_runtime.config import RuntimeSettings
from llmendpoints_runtime.jobs.port import JobEngine
from llmendpoints_runtime.jobs.settings import JobSettings

log = logging.getLogger("llmendpoints.batch")


class BatchFeature:
    """What compose.py plugs in: the routers (whose lifespan starts the driver and the lane),
    the work a draining pod waits for, and the drain."""

    def __init__(
        self,
        api: BatchAPI,
        drivers: BatchDrivers,
        lines: LocalLines,
        webhooks: WebhookSender,
        routers: list[APIRouter],
    ) -> None:
        self.api = api
        self.drivers = drivers
        self.lines = lines
        self.webhooks = webhooks
        self._routers = routers

    def busy(self) -> int:
        return self.lines.running + self.webhooks.pending

    async def drain(self, timeout: float) -> None:
        await self.drivers.stop()
        await self.lines.drain(timeout)
        await self.webhooks.aclose(timeout=1.0)

    def routers(self) -> list[APIRouter]:
        drivers, lines = self.drivers, self.lines

        @contextlib.asynccontextmanager
        async def lifespan(_: object) -> AsyncIterator[None]:
            await lines.start()
            await drivers.start()
            try:
                yield
            finally:
                await drivers.stop()

        self._routers[0].lifespan_context = lifespan
        return self._routers


def build_batch_feature(
    engine: JobEngine,
    job_settings: JobSettings,
    settings: RuntimeSettings,
    *,
    root: str,
    endpoint: str,
    slots: Callable[[], int],
    webhook_policy: DestinationPolicy,
) -> BatchFeature:
    """Batches kept under ``root``, run in this pod while ``slots()`` allows."""
    limits = settings.batch_limits()
    store = LocalBatchStore(Path(root), max_bytes=settings.batch_local_max_bytes)
    lines = LocalLines(
        engine, job_settings, Path(root), slots=slots, priority=settings.batch_priority
    )
    webhooks = WebhookSender(
        retries=job_settings.webhook_retries,
        delay_seconds=job_settings.webhook_retry_delay_seconds,
        timeout_seconds=job_settings.webhook_timeout_seconds,
        max_concurrency=job_settings.webhook_max_concurrency,
        policy=webhook_policy,
    )

    async def resolve(owner: str, model: str) -> str:
        served = engine.served_models()
        if model in served.base or model in served.adapters:
            return endpoint
        raise LookupError(
            f"model {model!r} is not served here (this endpoint serves "
            f"{', '.join([*served.base, *served.adapters]) or 'nothing yet'})"
        )

    def ended(record: BatchRecord) -> None:
        lines.forget(record.id)
        if record.api == "runpod" and record.webhook:
            webhooks.send(record.webhook, runpod_summary(record, endpoint.split("/", 1)[-1]))

    drivers = BatchDrivers(
        store,
        lines,
        holder=f"{socket.gethostname()}-runtime",
        limits=limits,
        resolve=resolve,
        on_end=ended,
    )
    api = BatchAPI(
        store,
        lines,
        limits,
        wake=drivers.wake,
        webhook_policy=webhook_policy,
        job_limits=job_settings.limits,
    )
    routers = build_batch_routers(
        api, settings, endpoint=endpoint, endpoint_name=endpoint.split("/", 1)[-1]
    )
    log.info("batches kept in %s", root)
    return BatchFeature(api, drivers, lines, webhooks, routers)
