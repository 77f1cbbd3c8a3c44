"""API keys at the edge: where a client puts its key, and files of keys that change while the
process runs (a mounted Secret: rotating it needs no restart).

Which keys mean what differs between the front doors (the runtime's are bare secrets, the
gateway's carry names, endpoints and limits); reading them from headers and from a watched
file is the same, and lives here.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

logger = logging.getLogger("llmendpoints.edge.keys")

T = TypeVar("T")


def key_from_headers(headers: Iterable[tuple[bytes, bytes]]) -> str | None:
    """``Authorization: Bearer <key>`` or ``x-api-key: <key>``; None when neither is there."""
    for name, value in headers:
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
        elif name == b"x-api-key" and value.strip():
            return value.decode("latin-1").strip()
    return None


def parse_key_list(text: str) -> tuple[str, ...]:
    """Keys separated by newlines or commas, ``#`` comment lines, duplicates once (pure)."""
    keys: list[str] = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keys.extend(k.strip() for k in line.split(",") if k.strip())
    return tuple(dict.fromkeys(keys))


@dataclass
class WatchedFile(Generic[T]):
    """A file parsed into ``T``, re-read when it changes (checked at most every
    ``check_interval`` seconds, by modification time and size).

    Fails closed: a file that cannot be read or parsed keeps what was loaded before -- nothing,
    if it never could be read -- says so in the log and in ``error``; what a component does
    about a file that was never readable (refuse every key, or not start) is its own choice.
    """

    path: str
    parse: Callable[[str], T]
    label: str  # the setting that names the file, for the log
    check_interval: float = 1.0
    value: T | None = None
    error: str | None = None  # why the last read failed, until one succeeds
    _stamp: tuple[int, int] | None = None
    _checked_at: float = field(default=float("-inf"))

    def current(self) -> T | None:
        """The parsed contents, re-reading the file if it is due."""
        self.refresh()
        return self.value

    def refresh(self) -> bool:
        now = time.monotonic()
        if now - self._checked_at < self.check_interval:
            return False
        self._checked_at = now
        return self.load()

    def load(self) -> bool:
        """Read the file if it changed; True when the contents did."""
        try:
            st = os.stat(self.path)
            stamp = (st.st_mtime_ns, st.st_size)
            if stamp == self._stamp:
                return False
            with open(self.path, encoding="utf-8") as handle:
                value = self.parse(handle.read())
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            detail = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            if self.error != detail:  # once per distinct failure, not once a second
                logger.error("cannot use %s (%s); keeping the previous keys", self.label, detail)
            self.error = detail
            self._stamp = None
            return False
        self._stamp = stamp
        self.error = None
        self.value = value
        return True
