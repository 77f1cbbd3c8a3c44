"""Pulling from a durable consumer through a reply inbox of its own (the JetStream pull
protocol, ``$JS.API.CONSUMER.MSG.NEXT.<stream>.<consumer>``), for the queue's workers and the
gateway's usage meter.

nats-py's ``fetch`` waits out its timeout when nothing is there and carries no byte bound; this
asks with ``no_wait`` (answered at once) or for one message with an expiry, and a pull may carry
``max_bytes`` so that what one pull brings is bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from typing import Any

import nats.errors
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

_NO_MESSAGES = {"404", "408", "409"}  # nothing (left) to deliver, the pull expired, or full
_LANE_REPLY_SECONDS = 2.0


class PullLane:
    """One lane's durable consumer, pulled through a reply inbox of its own.

    ``take(n)`` asks for up to ``n`` messages with ``no_wait`` (the server answers at once with
    what it has), so asking every lane in turn costs a round trip each, not a poll timeout.
    ``wait(seconds, until)`` asks for one message and waits for it, for ``until`` (a freed
    slot), or for the time. A message that arrives after its asker stopped waiting stays in
    the inbox and is the first a later ``take`` returns, so none is lost.
    """

    def __init__(
        self,
        nc: Any,
        subject: str,
        inbox: str,
        subscription: Subscription,
        max_bytes: int | None = None,
    ) -> None:
        self._nc = nc
        self._subject = subject
        self._inbox = inbox
        self._sub = subscription
        self._max_bytes = max_bytes

    @classmethod
    async def open(
        cls, nc: Any, stream: str, durable: str, *, max_bytes: int | None = None
    ) -> PullLane:
        """``max_bytes``: what one pull may bring at most (it must hold the largest message
        the stream takes: a larger one would never be delivered)."""
        inbox = nc.new_inbox()
        subscription = await nc.subscribe(inbox)
        return cls(
            nc, f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{durable}", inbox, subscription, max_bytes
        )

    def _request(self, **fields: Any) -> bytes:
        if self._max_bytes is not None:
            fields["max_bytes"] = self._max_bytes
        return json.dumps(fields).encode()

    def _pending(self, n: int) -> list[Msg]:
        found: list[Msg] = []
        queue = self._sub._pending_queue  # nats-py keeps delivered messages here
        while len(found) < n and not queue.empty():
            message = queue.get_nowait()
            if message.data or not _status(message):
                found.append(message)
        return found

    async def take(self, n: int) -> list[Msg]:
        found = self._pending(n)
        if found:
            return found
        await self._nc.publish(
            self._subject, self._request(batch=n, no_wait=True), reply=self._inbox
        )
        while len(found) < n:
            try:
                message = await self._sub.next_msg(timeout=_LANE_REPLY_SECONDS)
            except (nats.errors.TimeoutError, TimeoutError):
                break
            status = _status(message)
            if status is None:
                found.append(message)
            elif status in _NO_MESSAGES:
                break
        return found

    async def wait(self, seconds: float, until: asyncio.Event) -> list[Msg]:
        found = self._pending(1)
        if found:
            return found
        expires = int(seconds * 1e9)
        await self._nc.publish(
            self._subject, self._request(batch=1, expires=expires), reply=self._inbox
        )
        deadline = time.monotonic() + seconds
        waiter = asyncio.ensure_future(until.wait())
        reader: asyncio.Future[Msg] | None = None
        try:
            while (left := deadline - time.monotonic()) > 0:
                reader = asyncio.ensure_future(self._sub.next_msg(timeout=left))
                done, _ = await asyncio.wait({reader, waiter}, return_when=asyncio.FIRST_COMPLETED)
                if reader not in done:
                    return []  # a slot freed: the caller looks at every lane again
                try:
                    message = reader.result()
                except (nats.errors.TimeoutError, TimeoutError):
                    return []
                finally:
                    reader = None
                status = _status(message)
                if status is None:
                    return [message]
                if status in _NO_MESSAGES:
                    return []
            return []
        finally:
            waiter.cancel()
            if reader is not None:  # abandoned (a freed slot, or shutdown): not left unread
                reader.cancel()
                with contextlib.suppress(BaseException):
                    await reader

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await self._sub.unsubscribe()


def _status(message: Msg) -> str | None:
    """A JetStream status reply's code (``404`` no messages...), None for a job's message."""
    headers = message.headers or {}
    status = headers.get("Status")
    if status is None and not message.data and not message.reply:
        return "404"
    return status
