"""Work for an endpoint that no pod holds, read from NATS: requests the gateway replicas hold
(the LLMEP_SIGNALS bucket) and jobs in the shared queue (queued by priority, running). Also the
gateway's nudges ("work arrived for an endpoint with no ready replica"), so that a scale-up from
zero does not wait for the next tick.

The only module of the operator that talks to NATS. One connection per operator; nats-py
reconnects on its own, and a read that fails makes that tick's outside work unknown (the
decision then neither scales from zero nor to zero on it).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Protocol

import nats
from llmendpoints_common.queue import signals
from llmendpoints_common.queue.depth import endpoint_depth
from nats.aio.client import Client as NATS

from .decision import Outside

logger = logging.getLogger(__name__)

# How long one read may take before the tick goes on without it.
READ_TIMEOUT_SECONDS = 2.0


class OutsideReader(Protocol):
    async def read(self, endpoint: str) -> Outside: ...

    async def close(self) -> None: ...


class NatsOutside:
    """Reads held requests and queued / running jobs; calls `on_nudge(endpoint)` on nudges."""

    def __init__(
        self,
        url: str,
        on_nudge: Callable[[str], Awaitable[None] | None] | None = None,
        *,
        jobs: bool = True,
    ) -> None:
        self._url = url
        self._on_nudge = on_nudge
        self._jobs = jobs  # False: no shared job queue to read (held requests only)
        self._nc: NATS | None = None
        self._lock = asyncio.Lock()

    async def _connect(self) -> NATS:
        async with self._lock:
            if self._nc is None or self._nc.is_closed:
                self._nc = await nats.connect(
                    self._url,
                    name="llmendpoints-operator",
                    connect_timeout=READ_TIMEOUT_SECONDS,
                    max_reconnect_attempts=-1,
                )
                if self._on_nudge is not None:
                    await signals.subscribe_nudges(self._nc, self._on_nudge)
            return self._nc

    async def start(self) -> None:
        """Connect now (and subscribe to nudges) instead of at the first read."""
        await self._connect()

    async def read(self, endpoint: str) -> Outside:
        async with asyncio.timeout(READ_TIMEOUT_SECONDS):
            js = (await self._connect()).jetstream()
            held = await signals.read_held(js, endpoint)
            if not self._jobs:
                return Outside(held=held)
            depth = await endpoint_depth(js, endpoint)  # the shared queue's own accounting
            return Outside(
                held=held,
                jobs_queued=depth.for_scaling,  # normal priority (queued counts every one)
                jobs_queued_low_priority=depth.queued_low_priority,
                jobs_running=depth.running,
            )

    async def close(self) -> None:
        if self._nc is not None and not self._nc.is_closed:
            await self._nc.close()
        self._nc = None
