"""wait_until_set: what the background loops (queue worker, autoscaler, batch lines, signal
publisher, gateway supervisor) wait with, so that stopping them with a cancel always stops them."""

from __future__ import annotations

import asyncio
import contextlib
import sys

import pytest
from llmendpoints_common.waiting import wait_until_set


def test_it_says_whether_the_event_was_set_in_time():
    async def main() -> tuple[bool, bool, bool]:
        event = asyncio.Event()
        missed = await wait_until_set(event, 0.01)
        asyncio.get_running_loop().call_later(0.01, event.set)
        seen = await wait_until_set(event, 5)
        already = await wait_until_set(event, 0)  # set: no wait at all, even with no time
        return missed, seen, already

    assert asyncio.run(main()) == (False, True, True)


async def _cancel_as_it_is_set(waiter) -> str:
    event = asyncio.Event()
    task = asyncio.create_task(waiter(event))
    await asyncio.sleep(0.01)
    event.set()  # the event and the cancel land in the same loop iteration
    task.cancel()
    try:
        return await task
    except asyncio.CancelledError:
        return "cancelled"


def test_a_cancel_landing_as_the_event_is_set_is_not_lost():
    async def waiter(event: asyncio.Event) -> str:
        await wait_until_set(event, 10)
        return "went on"

    assert asyncio.run(_cancel_as_it_is_set(waiter)) == "cancelled"


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="wait_for was fixed in Python 3.12")
def test_python_3_11s_wait_for_loses_that_cancel():
    """Why the helper exists: the same race with ``asyncio.wait_for`` goes on as if not
    cancelled."""

    async def waiter(event: asyncio.Event) -> str:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(event.wait(), 10)
        return "went on"

    assert asyncio.run(_cancel_as_it_is_set(waiter)) == "went on"
