"""Admission for a pod of several API processes: MAX_CONCURRENCY and MAX_QUEUE_LENGTH count
every process's sequences (admission.AdmissionQueue's rules, on the pod's board).

A request takes its slots at once when the pod has room and nobody in the pod waits; else it
waits (429 beyond the pod's queue length), in FIFO order within its process. Slots freed in
another process are not announced across processes: a process with waiters looks for room
every POLL_SECONDS (only while it has waiters), so across processes the order is "first to look
after a slot frees", and a slot stays idle at most that long.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque

from llmendpoints_common.errors import RateLimitError

from llmendpoints_runtime.pod.board import PodBoard

POLL_SECONDS = 0.005


class PodAdmission:
    """The AdmissionQueue interface (acquire, release, running, waiting, limit, set_limit) on
    the board's ``<prefix>_running`` / ``<prefix>_waiting`` fields. ``running``/``waiting`` are
    this process's (what its metrics report); ``pod_running``/``pod_waiting`` the pod's."""

    def __init__(
        self, board: PodBoard, index: int, limit: int, max_waiting: int, *, prefix: str = "adm"
    ) -> None:
        if limit < 1:
            raise ValueError("limit must be at least 1")
        self.board = board
        self.index = index
        self.limit = limit
        self.max_waiting = max_waiting
        self._running, self._waiting = f"{prefix}_running", f"{prefix}_waiting"
        self._waiters: deque[tuple[asyncio.Future[None], int]] = deque()
        self._pump: asyncio.Task[None] | None = None

    @property
    def running(self) -> int:
        return int(self.board.get(self.index, self._running))

    @property
    def waiting(self) -> int:
        return int(self.board.get(self.index, self._waiting))

    @property
    def pod_running(self) -> int:
        return int(self.board.total(self._running))

    @property
    def pod_waiting(self) -> int:
        return int(self.board.total(self._waiting))

    def set_limit(self, limit: int) -> None:
        self.limit = max(1, limit)
        self._wake()

    async def acquire(self, weight: int = 1) -> int:
        weight = min(max(1, weight), self.limit)
        board = self.board
        with board.lock:
            if (
                not self._waiters
                and board.total(self._waiting) == 0
                and board.total(self._running) + weight <= self.limit
            ):
                board.add(self.index, self._running, weight)
                return weight
            queued = board.total(self._waiting)
            if queued + weight > self.max_waiting:
                running = board.total(self._running)
                raise RateLimitError(
                    f"server busy: {running:.0f} sequences running and {queued:.0f} queued "
                    "(MAX_QUEUE_LENGTH); retry shortly",
                    headers={"retry-after": "1"},
                )
            board.add(self.index, self._waiting, weight)
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (future, weight)
        self._waiters.append(entry)
        self._ensure_pump()
        try:
            await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                self.release(weight)  # granted as it was cancelled: hand the slots on
            elif entry in self._waiters:
                self._waiters.remove(entry)
                with board.lock:
                    board.add(self.index, self._waiting, -weight)
            raise
        return weight

    def release(self, weight: int = 1) -> None:
        with self.board.lock:
            self.board.add(self.index, self._running, -max(1, weight))
        self._wake()

    def _wake(self) -> None:
        """Grant the head waiters while the pod has room (FIFO: nobody overtakes the head)."""
        board = self.board
        with board.lock:
            while self._waiters:
                future, weight = self._waiters[0]
                if future.done():  # cancelled
                    self._waiters.popleft()
                    board.add(self.index, self._waiting, -weight)
                    continue
                if board.total(self._running) + weight > self.limit:
                    return
                self._waiters.popleft()
                board.add(self.index, self._waiting, -weight)
                board.add(self.index, self._running, weight)
                future.set_result(None)

    def _ensure_pump(self) -> None:
        if self._pump is None or self._pump.done():
            self._pump = asyncio.get_running_loop().create_task(self._poll())

    async def _poll(self) -> None:
        """Slots another process frees are seen here."""
        with contextlib.suppress(asyncio.CancelledError):
            while self._waiters:
                await asyncio.sleep(POLL_SECONDS)
                self._wake()
