"""Admission control: at most MAX_CONCURRENCY requests in the engine, a bounded FIFO queue behind.

vLLM queues internally without limit; a bounded queue in front of it keeps a pod from accepting
more than it can answer in reasonable time and makes the backlog visible (queue depth) to the
autoscaler. Beyond the queue's length ``acquire`` raises RateLimitError (429 with Retry-After) at
once.
"""

from __future__ import annotations

import asyncio
from collections import deque

from llmendpoints_common.errors import RateLimitError


class AdmissionQueue:
    def __init__(self, limit: int, max_waiting: int):
        if limit < 1:
            raise ValueError("limit must be at least 1")
        self.limit = limit
        self.max_waiting = max_waiting
        self.running = 0
        self._waiters: deque[asyncio.Future[None]] = deque()

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def set_limit(self, limit: int) -> None:
        self.limit = max(1, limit)
        self._wake()

    async def acquire(self) -> None:
        if self.running < self.limit and not self._waiters:
            self.running += 1
            return
        if len(self._waiters) >= self.max_waiting:
            raise RateLimitError(
                f"server busy: {self.running} requests running and {self.waiting} queued "
                "(MAX_QUEUE_LENGTH); retry shortly",
                headers={"retry-after": "1"},
            )
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(future)
        try:
            await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                # The slot was granted as the waiter was cancelled: hand it on.
                self.release()
            else:
                self._waiters.remove(future)
            raise

    def release(self) -> None:
        self.running -= 1
        self._wake()

    def _wake(self) -> None:
        while self._waiters and self.running < self.limit:
            future = self._waiters.popleft()
            if not future.done():
                self.running += 1
                future.set_result(None)


def default_max_concurrency(max_num_seqs: int | None) -> int:
    """Never lower than what the engine batches at once (worker-vllm's default was 300)."""
    return max(300, max_num_seqs or 0)
