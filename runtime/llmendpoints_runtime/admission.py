"""Admission control: at most MAX_CONCURRENCY sequences in the engine, a bounded FIFO queue behind.

vLLM queues internally without limit; a bounded queue in front of it keeps a pod from accepting
more than it can answer in reasonable time and makes the backlog visible (queue depth) to the
autoscaler. Beyond the queue's length ``acquire`` raises RateLimitError (429 with Retry-After) at
once.

Work is counted in sequences, as the engine runs it (``llmendpoints_common.fair_use``): a
request with ``n: 4`` holds 4 of the MAX_CONCURRENCY slots, so one request cannot fill the
engine while a small one waits behind it. A request that asks for more sequences than the whole
limit (a /v1/completions with 1,000 prompts) is admitted alone: it waits until nothing else is
admitted, then holds every slot while it runs -- refusing it would break batch clients vLLM
serves, and letting it in beside others is what this admission is there to stop. The queue is
strictly FIFO: a heavy request at the head waits until enough slots are free, and the requests
behind it wait too, so a heavy request is never starved by a stream of light ones.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Protocol

from llmendpoints_common.errors import RateLimitError


class Admission(Protocol):
    """What callers use of an admission (this module's queue; ``pod.admission.PodAdmission``
    for a pod of several API processes)."""

    limit: int
    max_waiting: int

    @property
    def running(self) -> int: ...

    @property
    def waiting(self) -> int: ...

    def set_limit(self, limit: int) -> None: ...

    async def acquire(self, weight: int = 1) -> int: ...

    def release(self, weight: int = 1) -> None: ...


class AdmissionQueue:
    def __init__(self, limit: int, max_waiting: int):
        if limit < 1:
            raise ValueError("limit must be at least 1")
        self.limit = limit
        # Sequences that may wait (MAX_QUEUE_LENGTH); more are refused with 429.
        self.max_waiting = max_waiting
        # Sequences running, and waiting.
        self.running = 0
        self.waiting = 0
        self._waiters: deque[tuple[asyncio.Future[None], int]] = deque()

    @property
    def waiting_requests(self) -> int:
        return len(self._waiters)

    def set_limit(self, limit: int) -> None:
        self.limit = max(1, limit)
        self._wake()

    async def acquire(self, weight: int = 1) -> int:
        """Wait for ``weight`` sequences' slots (all of them if it is more than the limit);
        returns the slots taken, which ``release`` gives back."""
        weight = min(max(1, weight), self.limit)
        if self.running + weight <= self.limit and not self._waiters:
            self.running += weight
            return weight
        if self.waiting + weight > self.max_waiting:
            raise RateLimitError(
                f"server busy: {self.running} sequences running and {self.waiting} queued "
                "(MAX_QUEUE_LENGTH); retry shortly",
                headers={"retry-after": "1"},
            )
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (future, weight)
        self._waiters.append(entry)
        self.waiting += weight
        try:
            await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                # The slots were granted as the waiter was cancelled: hand them on.
                self.release(weight)
            elif entry in self._waiters:  # (else _wake already dropped it)
                self._waiters.remove(entry)
                self.waiting -= weight
                self._wake()  # the head may have left: the next one may fit now
            raise
        return weight

    def release(self, weight: int = 1) -> None:
        self.running -= max(1, weight)
        self._wake()

    def _wake(self) -> None:
        while self._waiters:
            future, weight = self._waiters[0]
            if future.done():  # cancelled; its acquire() takes it out
                self._waiters.popleft()
                self.waiting -= weight
                continue
            if self.running + weight > self.limit:
                return  # FIFO: nobody overtakes the head
            self._waiters.popleft()
            self.waiting -= weight
            self.running += weight
            future.set_result(None)


def default_max_concurrency(max_num_seqs: int | None) -> int:
    """Never lower than what the engine batches at once (worker-vllm's default was 300)."""
    return max(300, max_num_seqs or 0)
