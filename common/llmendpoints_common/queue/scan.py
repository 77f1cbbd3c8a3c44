"""Listing a key-value bucket's keys without a consumer: batched direct gets.

A key-value watcher (nats-py's ``kv.watch``, ``kv.keys``) is an ordered consumer on the server,
and the server keeps it after the listing is done -- for its inactive threshold, five minutes --
so every listing of every tenant left one behind, and a thousand listings filled what the
account allows (the Batch API then answered 500 to everyone). Here a listing is a few requests
to the stream's direct-get API (NATS ADR-31, nats-server 2.11+): ``next_by_subj`` with the
filter and a ``batch``, answered with up to ``batch`` messages in stream order and an
end-of-batch status saying how many more match; the next page starts after the last sequence
seen. Nothing is created on the server; a page's messages come straight to this connection's
inbox.

A bucket keeps one message per key (``max_msgs_per_subject=1``), so the messages are the keys'
latest values. A key written again during the listing moves to a later sequence and may be seen
twice: the later one is kept. Delete and purge markers (empty values) are left out.
"""

from __future__ import annotations

import json

from nats.aio.client import Client as NATS
from nats.aio.subscription import Subscription

PAGE = 256
_END_OF_BATCH = "204"
_NO_MESSAGES = "404"


class ScanError(Exception):
    """The stream did not answer a direct get: ``status`` 503 when nobody answers (no such
    stream), another status when it refused."""

    def __init__(self, status: str, description: str) -> None:
        super().__init__(f"direct get answered {status} {description}".strip())
        self.status = status

    @property
    def no_stream(self) -> bool:
        return self.status == "503"


async def latest(
    nc: NATS, stream: str, subjects: str, *, page: int = PAGE, timeout: float = 5.0
) -> dict[str, bytes]:
    """subject -> its latest value, for every subject matching ``subjects`` in ``stream``."""
    found: dict[str, tuple[int, bytes]] = {}
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    try:
        seq = 0
        while True:
            request = {"next_by_subj": subjects, "seq": seq, "batch": page}
            await nc.publish(
                f"$JS.API.DIRECT.GET.{stream}", json.dumps(request).encode(), reply=inbox
            )
            more, seq = await _page(sub, found, seq, timeout)
            if not more:
                break
    finally:
        await sub.unsubscribe()
    return {subject: data for subject, (_, data) in found.items() if data}


async def _page(
    sub: Subscription, found: dict[str, tuple[int, bytes]], seq: int, timeout: float
) -> tuple[bool, int]:
    """Read one page's answers into ``found``: (whether more match, where the next starts)."""
    while True:
        msg = await sub.next_msg(timeout=timeout)
        headers = msg.headers or {}
        status = headers.get("Status")
        if status == _END_OF_BATCH:
            return int(headers.get("Nats-Num-Pending") or 0) > 0, seq
        if status == _NO_MESSAGES:
            return False, seq
        if status:
            raise ScanError(status, str(headers.get("Description", "")))
        subject, at = headers["Nats-Subject"], int(headers["Nats-Sequence"])
        if at >= found.get(subject, (0, b""))[0]:
            found[subject] = (at, msg.data or b"")
        seq = at + 1
