"""Reading an HTTP body up to a bound, for the operator's clients (the fit check's hub client,
the autoscaler's scraper). aiohttp's ``read(n)`` answers with what has arrived so far, up to n:
a body sent in several pieces would otherwise be cut at the first."""

from __future__ import annotations

from typing import Protocol


class Readable(Protocol):
    async def read(self, n: int = -1) -> bytes: ...


async def read_at_most(content: Readable, size: int) -> bytes:
    """The body, or its first ``size`` bytes when it is longer (ask for one more than a bound
    to tell a body at the bound from one past it)."""
    data = bytearray()
    while len(data) < size and (chunk := await content.read(size - len(data))):
        data += chunk
    return bytes(data)
