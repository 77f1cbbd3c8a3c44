"""Holding requests while an endpoint has no ready replica: a bounded FIFO of waiters.

A request that finds no ready replica waits here; the moment discovery reports one ready,
every waiter is released in arrival order and routed normally. Beyond the queue's length, past
the hold timeout, or when the gateway shuts down, the waiter gets a 503 with Retry-After. A
client that disconnects while held is simply removed.

Held requests are shared fairly: one key takes at most its share of an endpoint's queue
(GATEWAY_HOLD_KEY_SHARE), and the bodies held across every endpoint fit in one byte budget
(GATEWAY_HOLD_MAX_BYTES) -- a held request keeps its body, and nothing else of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import time
from collections import deque
from collections.abc import Awaitable, Callable

from llmendpoints_common.errors import ServiceUnavailableError
from llmendpoints_edge.body import ClientGone

RETRY_AFTER_SECONDS = 5
# Before an endpoint's pod even starts its startup budget: scheduling, a node scaled up, the image
# pulled. Added to spec.engine.startupTimeoutSeconds for the hold of a discovered endpoint.
SCHEDULING_MARGIN_SECONDS = 300.0


def hold_timeout(setting: float, startup_timeout: float | None) -> float:
    """How long a request is held for an endpoint with no ready replica (pure).

    Never shorter than the endpoint's own start-up: a held request answered 503 while the pod
    that would serve it is still within its startupTimeoutSeconds is a cold start reported as a
    failure. GATEWAY_HOLD_TIMEOUT_SECONDS is the floor, and the whole bound for endpoints whose
    start-up budget the gateway does not know (static endpoints)."""
    if startup_timeout is None:
        return setting
    return max(setting, startup_timeout + SCHEDULING_MARGIN_SECONDS)


def unavailable(message: str, retry_after: int = RETRY_AFTER_SECONDS) -> ServiceUnavailableError:
    return ServiceUnavailableError(
        message, code="endpoint_unavailable", headers={"retry-after": str(retry_after)}
    )


class HoldBudget:
    """Bytes of held request bodies, across the endpoints of one gateway replica."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.used = 0

    def take(self, size: int) -> bool:
        if self.used + size > self.max_bytes:
            return False
        self.used += size
        return True

    def give(self, size: int) -> None:
        self.used = max(0, self.used - size)


class HoldQueue:
    def __init__(
        self,
        endpoint: str,
        max_length: int,
        on_change: Callable[[int], None] = lambda n: None,
        on_reject: Callable[[str], None] = lambda reason: None,
        *,
        key_share: float = 1.0,
        budget: HoldBudget | None = None,
        on_held: Callable[[float, str], None] = lambda seconds, outcome: None,
    ):
        self.endpoint = endpoint
        self.max_length = max_length
        self.per_key = max(1, int(max_length * key_share))
        self.budget = budget or HoldBudget(1 << 62)
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._by_key: dict[str, int] = {}
        self._closed = False
        self._on_change = on_change
        self._on_reject = on_reject
        # (seconds held, outcome: released, timeout, shutdown, client_gone): the hold-time
        # histogram. A request refused because the queue is full was never held.
        self._on_held = on_held

    def __len__(self) -> int:
        return len(self._waiters)

    def _admit(self, key: str, size: int) -> None:
        """Raise 503 when this request may not be held (closing, full, the key's share, bytes)."""
        if self._closed:
            self._on_reject("shutdown")
            raise unavailable("the gateway is shutting down; retry")
        if len(self._waiters) >= self.max_length:
            self._on_reject("queue_full")
            raise unavailable(
                f"endpoint {self.endpoint!r} has no ready replica and its hold queue is full "
                f"({self.max_length} requests); retry later"
            )
        if self._by_key.get(key, 0) >= self.per_key:
            self._on_reject("key_share")
            raise unavailable(
                f"endpoint {self.endpoint!r} has no ready replica and this key already has "
                f"{self.per_key} requests waiting for it (its share of the hold queue); retry "
                "later"
            )
        if not self.budget.take(size):
            self._on_reject("bytes")
            raise unavailable(
                f"endpoint {self.endpoint!r} has no ready replica and the gateway holds as "
                f"many request bytes as it may ({self.budget.max_bytes}); retry later"
            )

    async def wait(
        self, timeout: float, disconnected: Awaitable[object], *, key: str = "", size: int = 0
    ) -> None:
        """Return when released; raise 503 (full, the key's share taken, the byte budget
        spent, timeout, closing) or ClientGone. ``key``: the caller's key name; ``size``: the
        bytes its request keeps while held."""
        try:
            self._admit(key, size)
        except BaseException:
            if inspect.iscoroutine(disconnected):
                disconnected.close()  # never awaited: closed, not left to the collector's warning
            raise
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        self._by_key[key] = self._by_key.get(key, 0) + 1
        self._on_change(len(self._waiters))
        gone = asyncio.ensure_future(disconnected)
        # A cancelled wait is a request whose handler was cancelled: its client went away.
        started, outcome = time.monotonic(), "client_gone"
        try:
            done, _ = await asyncio.wait(
                {waiter, gone}, timeout=timeout, return_when="FIRST_COMPLETED"
            )
            if waiter in done:
                if waiter.exception() is not None:  # the 503 set by close()
                    outcome = "shutdown"
                    raise waiter.exception()
                outcome = "released"
                return
            if gone in done:
                outcome = "client_gone"
                raise ClientGone()
            outcome = "timeout"
            self._on_reject("timeout")
            raise unavailable(
                f"endpoint {self.endpoint!r} has had no ready replica for {timeout:.0f} s; retry later"
            )
        finally:
            gone.cancel()
            if not waiter.done():
                waiter.cancel()
            with contextlib.suppress(ValueError):  # already released
                self._waiters.remove(waiter)
            self.budget.give(size)
            left = self._by_key[key] - 1
            if left:
                self._by_key[key] = left
            else:
                del self._by_key[key]
            self._on_change(len(self._waiters))
            self._on_held(time.monotonic() - started, outcome)

    def release_all(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
        self._on_change(0)

    def close(self) -> None:
        """Shutting down: every waiter gets a 503 with Retry-After; new ones too."""
        self._closed = True
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                self._on_reject("shutdown")
                waiter.set_exception(unavailable("the gateway is shutting down; retry"))
        self._on_change(0)
