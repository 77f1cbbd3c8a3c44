"""Work for an endpoint that no pod holds, read from NATS: requests the gateway replicas hold
(the LLMEP_SIGNALS bucket), jobs in the shared queue (queued by priority, running) and the
running batches' remaining work and deadlines (their drivers' signals). Also the
gateway's nudges ("work arrived for an endpoint with no ready replica"), so that a scale-up from
zero does not wait for the next tick.

Reads go through the operator's one queue connection (jobs_queue.py: its own credential). An
endpoint is its namespace and name: two same-named endpoints in two namespaces are read apart.
A read that fails makes that tick's outside work unknown (the decision then neither scales
from zero nor to zero on it).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Protocol

from llmendpoints_common.identity import EndpointRef
from llmendpoints_common.queue import signals
from llmendpoints_common.queue.depth import endpoint_depth

from ..jobs_queue import JobsQueue
from .decision import Outside

logger = logging.getLogger(__name__)

# How long one read may take before the tick goes on without it.
READ_TIMEOUT_SECONDS = 2.0


class OutsideReader(Protocol):
    async def read(self, endpoint: EndpointRef) -> Outside: ...

    async def close(self) -> None: ...


class NatsOutside:
    """Reads held requests and queued / running jobs; calls `on_nudge(endpoint)` on nudges."""

    def __init__(
        self,
        queue: JobsQueue,
        on_nudge: Callable[[EndpointRef], Awaitable[None] | None] | None = None,
        *,
        jobs: bool = True,
    ) -> None:
        self._queue = queue
        self._on_nudge = on_nudge
        self._jobs = jobs  # False: no shared job queue to read (held requests only)
        self._subscribed = None
        self._lock = asyncio.Lock()

    async def _connect(self):
        connection = await self._queue.connection()
        async with self._lock:
            if self._on_nudge is not None and self._subscribed is not connection:
                await signals.subscribe_nudges(connection.nc, self._on_nudge)
                self._subscribed = connection
        return connection

    async def start(self) -> None:
        """Connect now (and subscribe to nudges) instead of at the first read."""
        await self._connect()

    async def read(self, endpoint: EndpointRef) -> Outside:
        async with asyncio.timeout(READ_TIMEOUT_SECONDS):
            connection = await self._connect()
            held = await signals.read_held(connection.js, endpoint)
            if not self._jobs:
                return Outside(held=held)
            # Its worker consumers, should the reconcile not have reached NATS.
            await self._queue.ensure_endpoint(endpoint)
            depth = await endpoint_depth(connection.js, endpoint)  # the queue's own accounting
            batches = await signals.read_batches(connection.js, endpoint)
            return Outside(
                held=held,
                jobs_queued=depth.for_scaling,  # normal priority (queued counts every one)
                jobs_queued_low_priority=depth.queued_low_priority,
                jobs_running=depth.running,
                jobs_queued_batch=depth.queued_batch,
                batches=tuple(batches),
            )

    async def close(self) -> None:
        await self._queue.close()
        self._subscribed = None
