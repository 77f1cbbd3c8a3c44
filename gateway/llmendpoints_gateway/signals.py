"""Scale-from-zero signals for the operator's autoscaler, on the shared NATS (JOBS_QUEUE_URL).

- Held requests per endpoint: ``publish_held`` (llmendpoints_common.queue.signals) writes this
  gateway replica's count into the expiring ``LLMEP_SIGNALS`` bucket whenever it changes
  (coalesced: one write per endpoint per ``COALESCE_SECONDS``) and every
  ``HELD_REFRESH_SECONDS`` while it is known, so the entry outlives quiet periods but not the
  replica.
- A nudge (``llmep.nudge.<endpoint>``) when a request starts waiting for an endpoint with no
  ready replica, at most once a second per endpoint: the autoscaler acts before its next tick.

NATS being down never stops the gateway serving: the counts are published once the shared
connection (queue.py) is there.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re

from llmendpoints_common.queue.signals import HELD_REFRESH_SECONDS, nudge, publish_held
from llmendpoints_common.waiting import wait_until_set

from llmendpoints_gateway.queue import SharedQueue

logger = logging.getLogger("llmendpoints.gateway.signals")

COALESCE_SECONDS = 0.1
NUDGE_INTERVAL_SECONDS = 1.0


def key_token(gateway_id: str) -> str:
    """A pod name as one NATS key token ('.' and wildcards are separators there)."""
    return re.sub(r"[^A-Za-z0-9_-]", "_", gateway_id) or "gateway"


class SignalPublisher:
    def __init__(self, queue: SharedQueue, gateway_id: str):
        self.queue = queue
        self.gateway_id = key_token(gateway_id)
        self._counts: dict[str, int] = {}
        self._dirty: set[str] = set()
        self._nudged_at: dict[str, float] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._pending: set[asyncio.Task] = set()

    def held_changed(self, endpoint: str, count: int) -> None:
        """Registry callback (synchronous, on the event loop)."""
        before = self._counts.get(endpoint, 0)
        self._counts[endpoint] = count
        self._dirty.add(endpoint)
        self._wake.set()
        if count > before:
            self.nudge_soon(endpoint)

    def nudge_soon(self, endpoint: str) -> None:
        """Nudge the autoscaler for ``endpoint`` (at most once a second; best effort)."""
        loop = asyncio.get_running_loop()
        if loop.time() - self._nudged_at.get(endpoint, float("-inf")) < NUDGE_INTERVAL_SECONDS:
            return
        self._nudged_at[endpoint] = loop.time()
        if self.queue.connected:
            task = loop.create_task(self._nudge(endpoint))
            self._pending.add(task)
            task.add_done_callback(self._pending.discard)

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self.queue.connected:
            # This replica holds nothing any more: say so rather than wait for the TTL.
            with contextlib.suppress(Exception):
                js = (await self.queue.wait()).js
                for endpoint in self._counts:
                    await publish_held(js, endpoint, self.gateway_id, 0)

    async def _nudge(self, endpoint: str) -> None:
        try:
            await nudge((await self.queue.wait()).nc, endpoint)
        except Exception as exc:
            logger.warning("nudge for %s failed: %s", endpoint, exc)

    async def _run(self) -> None:
        js = (await self.queue.wait()).js
        logger.info("publishing held-request signals as gateway %s", self.gateway_id)
        self._dirty.update(self._counts)
        loop = asyncio.get_running_loop()
        refresh_at = loop.time() + HELD_REFRESH_SECONDS
        while True:
            await wait_until_set(self._wake, refresh_at - loop.time())
            self._wake.clear()
            if loop.time() >= refresh_at:
                self._dirty.update(self._counts)
                refresh_at = loop.time() + HELD_REFRESH_SECONDS
            dirty, self._dirty = self._dirty, set()
            for endpoint in dirty:
                try:
                    await publish_held(js, endpoint, self.gateway_id, self._counts.get(endpoint, 0))
                except Exception as exc:
                    logger.warning("publishing held count for %s failed: %s", endpoint, exc)
                    self._dirty.add(endpoint)
            await asyncio.sleep(COALESCE_SECONDS)
            # Endpoints at 0 stop being refreshed once written: their entries expire.
            for endpoint in [e for e, n in self._counts.items() if n == 0 and e not in self._dirty]:
                del self._counts[endpoint]
