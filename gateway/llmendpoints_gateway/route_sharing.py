"""Every gateway process's prefix index learns what the others sent, through the shared queue.

A process's prefix index knows the prompt blocks *it* sent to each replica. With several
processes -- GATEWAY_WORKERS, and gateway replicas behind a Service -- each sees only its share
of the requests, so each knows less of what the engines hold: measured on the routing bench
(bench/RESULTS.md), the engines' prefix-cache hit rate fell from 0.785 with one process to
0.721 with two and 0.618 with four (round-robin: ~0.61). So each process publishes what it
routes -- (endpoint, replica, blocks) records, batched every ``FLUSH_SECONDS`` on core NATS
(``llmep.routes.<process>``, nothing stored) -- and applies everyone else's to its own index:
all indexes hold (about) the same, and a conversation's turn finds its history whichever
process it reaches. A record costs 8 bytes a block (256 characters of prompt) on the wire.

Best effort: records published while NATS is away are dropped (the index only gets less exact);
a batch never exceeds ``MAX_BATCH_BYTES`` (NATS's default message limit is 1 MB).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence

from llmendpoints_common.queue import names

from llmendpoints_gateway.metrics import GatewayMetrics
from llmendpoints_gateway.prefix_index import RouteLog, decode_records, encode_records
from llmendpoints_gateway.queue import SharedQueue
from llmendpoints_gateway.signals import key_token

logger = logging.getLogger("llmendpoints.gateway.route_sharing")

FLUSH_SECONDS = 0.02
MAX_BATCH_BYTES = 512 * 1024


class RouteSharing:
    def __init__(
        self,
        queue: SharedQueue,
        process_id: str,
        outbox: RouteLog,
        apply: Callable[[str, str, list[int]], None],
        metrics: GatewayMetrics | None = None,
    ) -> None:
        self.queue = queue
        self.metrics = metrics
        self.subject = names.routes_subject(key_token(process_id))
        self.outbox = outbox  # what this process routed (the registry's)
        self.apply = apply  # (endpoint id, replica, blocks): another process routed them
        self._tasks: list[asyncio.Task] = []
        self._subscription = None
        self.sent = 0  # records published
        self.received = 0  # records of other processes applied

    async def start(self) -> None:
        self._tasks = [asyncio.create_task(self._publish()), asyncio.create_task(self._listen())]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._subscription is not None:
            with contextlib.suppress(Exception):
                await self._subscription.unsubscribe()

    async def _listen(self) -> None:
        nc = (await self.queue.wait()).nc
        self._subscription = await nc.subscribe(names.ROUTES_WILDCARD, cb=self._received)

    async def _received(self, msg) -> None:
        if msg.subject == self.subject:
            return  # our own, applied when routed
        try:
            records = decode_records(msg.data)
        except ValueError as exc:
            logger.warning("routing records from %s not read: %s", msg.subject, exc)
            return
        for endpoint, replica, blocks in records:
            self.apply(endpoint, replica, blocks)
        self.received += len(records)
        if self.metrics is not None:
            self.metrics.shared_records.labels("received").inc(len(records))

    async def _publish(self) -> None:
        while True:
            await self.outbox.wake.wait()
            await asyncio.sleep(FLUSH_SECONDS)  # a batch: what was routed meanwhile
            pending = self.outbox.take()
            if not self.queue.connected:
                continue  # best effort: the index is only less exact
            nc = (await self.queue.wait()).nc
            batch: list[tuple[str, str, Sequence[int]]] = []
            size = 0
            for record in pending:
                record_size = 16 + len(record[0]) + len(record[1]) + 8 * len(record[2])
                if batch and size + record_size > MAX_BATCH_BYTES:
                    await self._send(nc, batch)
                    batch, size = [], 0
                batch.append(record)
                size += record_size
            if batch:
                await self._send(nc, batch)

    async def _send(self, nc, batch: list[tuple[str, str, Sequence[int]]]) -> None:
        try:
            await nc.publish(self.subject, encode_records(batch))
            self.sent += len(batch)
            if self.metrics is not None:
                self.metrics.shared_records.labels("sent").inc(len(batch))
        except Exception as exc:
            logger.warning("routing records not published: %s", exc)
