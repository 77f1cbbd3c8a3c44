"""Freed memory back to the OS after large request bodies (glibc's ``malloc_trim``).

A body is read in the chunks the server hands over (64-320 KiB), joined, parsed, forwarded, and
freed when its request ends (``body.release``). glibc serves most of those allocations from its
heap -- it raises its mapping threshold to the size of each large block freed, up to 32 MiB --
and gives heap memory back only from the top, which the small objects allocated between the
chunks pin. Measured on the gateway (bench/RESULTS.md, "Request bodies"): 40 clients sending 10 MB
each at once, every byte freed afterwards, left the process 290 MiB larger; with the threshold
fixed at 128 KiB, still 5 MiB more after each such round (90 after 20). ``malloc_trim(0)``
returns every free page of the heap, wherever it is: the same rounds then leave nothing behind.

It walks the heap, so it runs on the event loop at most once per ``interval`` and only after a
body of ``min_bytes`` or more has gone; elsewhere than glibc it does nothing.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import time

logger = logging.getLogger("llmendpoints.edge.memory")

TRIM_AFTER_BYTES = 1024 * 1024
TRIM_INTERVAL_SECONDS = 1.0


def _malloc_trim():  # the C function, or None
    try:
        return ctypes.CDLL(None).malloc_trim
    except (AttributeError, OSError):
        return None


class HeapTrimmer:
    """Gives freed heap pages back after large bodies went, at most once per ``interval``."""

    def __init__(
        self, min_bytes: int = TRIM_AFTER_BYTES, interval: float = TRIM_INTERVAL_SECONDS
    ) -> None:
        self.min_bytes = min_bytes
        self.interval = interval
        self.trims = 0
        self._trim = _malloc_trim()
        self._scheduled: asyncio.TimerHandle | None = None
        self._last = 0.0

    def released(self, size: int) -> None:
        """A request's body of ``size`` bytes was dropped (on the event loop)."""
        if size < self.min_bytes or self._trim is None or self._scheduled is not None:
            return
        loop = asyncio.get_running_loop()
        wait = max(0.0, self._last + self.interval - loop.time())
        self._scheduled = loop.call_later(wait, self._run)

    def _run(self) -> None:
        self._scheduled = None
        started = time.perf_counter()
        self._trim(0)
        self._last = asyncio.get_running_loop().time()
        self.trims += 1
        logger.debug("heap trimmed in %.1f ms", (time.perf_counter() - started) * 1000)
