"""The pod's batch driver host: what moves batches along, in a process of its own.

A batch's driver reads and validates its input file (up to 200 MB), hands its requests to the
queue's batch lane a window at a time, follows them and writes its output and error files
(``llmendpoints_common.batch.driver.BatchDrivers``). None of that belongs in a process that
relays interactive streams: parsing a large file is CPU a serving loop would not get back. So
a gateway pod with batches on runs one driver host, a process of its own started and restarted
by the gateway's supervisor (workers.py; ``llmendpoints-gateway serve --batch-drivers``), and
no serving worker drives anything. It reads what it needs itself -- the queue, the endpoints
(discovery: an OpenAI batch's model is the endpoint's that serves it, if the batch's key may
use that endpoint), the keys -- and each batch is driven by the host holding its lease: with
several gateway pods, one per batch, and another within 20 s when that one goes.

What a host adds to the drivers, as a front door across endpoints does: each running batch's
remaining work and deadline published for the autoscaler (and a nudge when its endpoint has no
ready replica: a batch wakes an endpoint at zero), and a RunPod batch's webhook when it ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from llmendpoints_common.batch.driver import BatchDrivers
from llmendpoints_common.batch.record import BatchRecord, runpod_summary
from llmendpoints_common.batch.signal import BatchSignal
from llmendpoints_common.queue.batch_lines import QueueLines
from llmendpoints_common.queue.batch_store import NatsBatchStore
from llmendpoints_common.queue.signals import drop_batch, publish_batch
from llmendpoints_common.webhooks import (
    DEFAULT_RETRIES,
    DEFAULT_RETRY_DELAY_SECONDS,
    WebhookSender,
)

from llmendpoints_gateway.access import Access
from llmendpoints_gateway.config import GatewaySettings
from llmendpoints_gateway.queue import SharedQueue
from llmendpoints_gateway.registry import Registry

logger = logging.getLogger("llmendpoints.gateway.batch_host")


class BatchHost:
    def __init__(
        self,
        queue: SharedQueue,
        access: Access,
        registry: Registry,
        settings: GatewaySettings,
        *,
        holder: str,
        nudge: Callable[[str], None],
    ) -> None:
        self.queue = queue
        self.access = access
        self.registry = registry
        self.limits = settings.batch_limits()
        self.holder = holder  # whose lease a batch is under: this pod's host
        self.nudge = nudge
        self.webhooks = WebhookSender(
            retries=DEFAULT_RETRIES,
            delay_seconds=DEFAULT_RETRY_DELAY_SECONDS,
            timeout_seconds=settings.webhook_timeout_seconds,
            max_concurrency=settings.webhook_max_concurrency,
            policy=settings.webhook_policy,
        )
        self.drivers: BatchDrivers | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._connect(), name="batch-host")

    async def _connect(self) -> None:
        connection = await self.queue.wait()
        self.drivers = BatchDrivers(
            NatsBatchStore(connection),
            QueueLines(connection),
            holder=self.holder,
            limits=self.limits,
            resolve=self._resolve,
            signal=self._signal,
            on_end=self._ended,
        )
        await self.drivers.start()
        logger.info("batch drivers running as %s", self.holder)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self.drivers is not None:
            await self.drivers.stop()
        await self.webhooks.aclose(timeout=5.0)

    # ---- the drivers' callbacks ------------------------------------------------------------

    async def _resolve(self, owner: str, model: str) -> str:
        """The endpoint an OpenAI batch's model runs on, if the batch's key may use it."""
        ep = self.registry.by_model(model)
        key = self.access.keys.by_name(owner) if owner else None
        if ep is None or not self.access.allows(key, ep):
            raise LookupError(f"the model {model!r} does not exist")
        return ep.id

    async def _signal(self, record: BatchRecord) -> None:
        if record.endpoint is None:
            return
        js = (await self.queue.wait()).js
        if not record.active:
            await drop_batch(js, record.endpoint, record.id)
            return
        await publish_batch(js, record.endpoint, BatchSignal.of(record))
        ep = self.registry.by_id(record.endpoint)
        if ep is not None and not ep.ready and record.remaining:
            self.nudge(ep.id)  # a batch wakes an endpoint at zero

    def _ended(self, record: BatchRecord) -> None:
        if record.api == "runpod" and record.webhook and record.endpoint is not None:
            ep = self.registry.by_id(record.endpoint)
            name = self.registry.address(ep) if ep is not None else record.endpoint
            self.webhooks.send(record.webhook, runpod_summary(record, name))
