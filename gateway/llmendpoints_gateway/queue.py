"""The gateway's one connection to the shared queue (NATS JetStream, JOBS_QUEUE_URL).

Built at the composition root (server.py) and handed to every part that needs NATS -- the job
API, the limiter, the usage publisher and meter, the held-request signals -- so the process
holds one connection with one retry loop, not one of each per part. Until it is connected (or
while NATS is away) the parts degrade as each documents: the job API answers 503 with
Retry-After, the limiter enforces limits on this replica's own state, usage records and signals
wait in their buffers. The gateway serves OpenAI requests all the while.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random

from llmendpoints_common.queue.client import QueueConnection

logger = logging.getLogger("llmendpoints.gateway.queue")

# Reconnect attempts back off from the first delay to the last, with jitter.
RETRY_FIRST_SECONDS = 0.5
RETRY_MAX_SECONDS = 10.0


class SharedQueue:
    def __init__(self, url: str, gateway_id: str, creds_file: str | None = None) -> None:
        self.url = url
        self.gateway_id = gateway_id
        self.creds_file = creds_file
        self.connection: QueueConnection | None = None
        self._connected = asyncio.Event()
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._connect())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self.connection is not None:
            await self.connection.close()

    async def wait(self) -> QueueConnection:
        """The connection, once there is one (nats-py reconnects it by itself afterwards)."""
        await self._connected.wait()
        assert self.connection is not None
        return self.connection

    @property
    def connected(self) -> bool:
        return self.connection is not None and self.connection.connected

    async def _connect(self) -> None:
        delay = RETRY_FIRST_SECONDS
        while True:
            try:
                self.connection = await QueueConnection.connect(
                    self.url, name=f"gateway-{self.gateway_id}", creds_file=self.creds_file
                )
            except Exception as exc:
                logger.warning(
                    "cannot reach the shared queue at JOBS_QUEUE_URL (%s); retrying in %.1f s",
                    str(exc) or type(exc).__name__,
                    delay,
                )
                await asyncio.sleep(delay * random.uniform(0.8, 1.2))
                delay = min(RETRY_MAX_SECONDS, delay * 2)
                continue
            logger.info("connected to the shared queue")
            self._connected.set()
            return
