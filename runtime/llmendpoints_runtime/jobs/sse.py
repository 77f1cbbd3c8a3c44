"""Cutting a server-sent-event byte stream into whole events (pure).

OpenAI streaming responses arrive from the ASGI app as byte chunks of any size. A job's raw
output must be cut only between events -- never inside an event, never inside a multi-byte
UTF-8 character. Event boundaries are blank lines, which are ASCII, so cutting there also keeps
every character whole.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

_BOUNDARY = re.compile(rb"\r\n\r\n|\n\n|\r\r")


@dataclass(frozen=True)
class SSEEvent:
    raw: str  # the event's text including its terminating blank line

    @property
    def data(self) -> str | None:
        """The event's data (multi-line data joined by newlines), or None if it has none."""
        lines = [
            line[5:].removeprefix(" ") for line in self.raw.splitlines() if line.startswith("data:")
        ]
        return "\n".join(lines) if lines else None

    @property
    def is_done(self) -> bool:
        return self.data == "[DONE]"

    def json(self) -> Any:
        """The data parsed as JSON, or None for [DONE], comments and non-JSON data."""
        data = self.data
        if data is None or data == "[DONE]":
            return None
        try:
            return json.loads(data)
        except json.JSONDecodeError:
            return None

    @property
    def error(self) -> dict[str, Any] | None:
        """An OpenAI error object streamed as an event (vLLM does this mid-stream)."""
        value = self.json()
        if isinstance(value, dict) and isinstance(value.get("error"), dict):
            return value["error"]
        return None


class SSECutter:
    """Feed bytes in any pieces; get back only complete events."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[SSEEvent]:
        self._buffer += data
        events: list[SSEEvent] = []
        start = 0
        for match in _BOUNDARY.finditer(self._buffer):
            events.append(SSEEvent(self._buffer[start : match.end()].decode("utf-8")))
            start = match.end()
        del self._buffer[:start]
        return events

    def finish(self) -> list[SSEEvent]:
        """The stream ended: a last event without its blank line still counts."""
        rest, self._buffer = bytes(self._buffer), bytearray()
        if not rest.strip():
            return []
        return [SSEEvent(rest.decode("utf-8", errors="replace") + "\n\n")]
