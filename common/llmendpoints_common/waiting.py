"""Waiting for an ``asyncio.Event`` with a timeout, without losing a cancellation.

Python 3.11's ``asyncio.wait_for`` returns normally when its task is cancelled in the same
loop iteration as the awaited future completes (CPython gh-86296, fixed in 3.12 by rewriting
it on ``asyncio.timeout``): a loop stopped by ``task.cancel()`` then runs another round, and
may block until its next timeout, before it sees the cancel. ``asyncio.timeout`` has no such
window, so the background loops wait through here.
"""

from __future__ import annotations

import asyncio


async def wait_until_set(event: asyncio.Event, timeout: float) -> bool:
    """True once ``event`` is set, False if ``timeout`` seconds pass first (a cancel of the
    caller's task always propagates)."""
    try:
        async with asyncio.timeout(max(timeout, 0.0)):
            await event.wait()
    except TimeoutError:
        return False
    return True
