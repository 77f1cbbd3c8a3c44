"""PURE: an SSE answer read as it passes -- its usage, what it generated, whether it ended --
in bounded memory and CPU, whatever a replica sends.

The gateway asks the replica for the usage chunk (``stream_options.include_usage``) and, when
the client did not ask for it, takes that chunk out of the client's stream (``strip``). To drop
it, whole events are sent on as they complete (vLLM writes one event per write, so nothing waits
in practice) and an unfinished event is held until its end.

Bounds (a pod runs the endpoint author's image, and what it sends is not trusted):

- An event is read (scanned, parsed for usage) once, when it is complete, never again: a held
  head is joined with the rest once, when the end arrives.
- An event that grows past MAX_EVENT_BYTES while unfinished is no usage chunk (that one is
  under 1 KiB): what was held of it goes on at once, and the rest passes through as it arrives,
  scanned only for its end; only its first bytes (is it the stream's last event? did it carry
  text?) and its last TAIL_BYTES (a /v1/responses ``response.completed`` with a long output
  carries ``usage`` at its end) are kept. Before this bound, an unterminated 50 MiB event was
  held whole and rescanned at every read: 6.8 s of the gateway's CPU.
- Events parsed for usage are those that mention it and are at most MAX_EVENT_BYTES; a larger
  one is read from its tail (``usage_of_tail``).

A stream cut before its usage chunk (the client left, the replica failed) is still billed: its
prompt by the request's size (``prompt_estimate``) and its completion by what it carried
(``generated``): one token per event that carried a step of generated text -- content,
reasoning (``reasoning``, vLLM's name; ``reasoning_content``, others'), a completion's text, a
/v1/responses delta (vLLM streams an event per engine step) -- plus the pieces of tool calls'
names and arguments, counted as the larger of their number and their characters / 4 (a tool
parser may hold tokens back and send several in one piece).
"""

from __future__ import annotations

import json
import re

from llmendpoints_gateway.metering import (
    CHARS_PER_TOKEN,
    TAIL_BYTES,
    Usage,
    usage_of,
    usage_of_tail,
)

# No usage chunk comes near this; an unfinished event past it is passed through, not held.
MAX_EVENT_BYTES = 64 * 1024

# A step of generated text: a non-empty string under one of these keys (the role-only first
# delta, finish events and empty tool-call arguments carry "").
_STEP_TEXT = re.compile(rb'"(?:content|text|delta|reasoning(?:_content)?)"\s*:\s*"(?!")')
# A chat tool call's name or arguments piece (looked for only in events with "tool_calls").
_TOOL_TEXT = re.compile(rb'"(?:name|arguments)"\s*:\s*"((?:[^"\\]|\\.)*)"')
# A stream's last event: chat and completions end with ``[DONE]``, /v1/responses with a
# terminal ``response.*`` event. At an event's start only: generated text inside a JSON string
# cannot hold a raw newline, so it never matches.
_LAST_EVENT = re.compile(
    rb"(?:\A|\n\n)(?:data: ?\[DONE\]|event: ?response\.(?:completed|failed|incomplete)\r?\n)"
)


def _may_end(data: bytes) -> bool:
    """What _LAST_EVENT needs, found by substring (an order of magnitude cheaper than the
    regex, which most events, a token each, need not be searched with)."""
    return b"[DONE]" in data or b"event:" in data


class _Oversized:
    """What is kept of an event past MAX_EVENT_BYTES while it passes: its head's verdicts and
    its last TAIL_BYTES (as pieces, dropped from the front: no copy per read)."""

    def __init__(self, head: bytes) -> None:
        self.last = _may_end(head) and _LAST_EVENT.match(head) is not None
        self.text = _STEP_TEXT.search(head) is not None
        self.newline = False
        self._tail: list[bytes] = []
        self._size = 0
        self.add(head)

    def add(self, data: bytes) -> None:
        if not data:
            return
        self._tail.append(data)
        self._size += len(data)
        while self._size - len(self._tail[0]) >= TAIL_BYTES:
            self._size -= len(self._tail.pop(0))
        self.newline = data.endswith(b"\n")

    def usage(self) -> Usage | None:
        tail = b"".join(self._tail)[-TAIL_BYTES:]
        return usage_of_tail(tail) if b'"usage"' in tail else None


class StreamUsage:
    """Reads an SSE answer as it passes: finds the usage, optionally drops the usage-only chunk.

    ``feed`` returns the bytes to send on to the client: without stripping, the bytes received,
    unchanged. ``ended``: the stream's last event has passed. A client may close the connection
    then, before the body's end (the openai SDK's synchronous stream does, at ``[DONE]``): it
    had the whole answer, so it did not leave early."""

    def __init__(self, strip: bool, prompt_estimate: int = 0):
        self.strip = strip
        self.prompt_estimate = prompt_estimate
        self.found: Usage | None = None
        self.text_events = 0
        self.tool_pieces = 0
        self.tool_chars = 0
        self.ended = False
        self._head: list[bytes] = []  # the unfinished event so far (at most MAX_EVENT_BYTES)
        self._head_size = 0
        self._over: _Oversized | None = None  # the unfinished event is past MAX_EVENT_BYTES

    @property
    def generated(self) -> int:
        """Completion tokens estimated from the events that passed (for a cut stream)."""
        tools = max(self.tool_pieces, -(-self.tool_chars // CHARS_PER_TOKEN))
        return self.text_events + tools

    @property
    def estimated(self) -> bool:
        return self.found is None and self.generated > 0

    @property
    def usage(self) -> Usage | None:
        if self.found is not None:
            return self.found
        generated = self.generated
        return Usage(self.prompt_estimate, generated) if generated else None

    def feed(self, chunk: bytes) -> bytes:
        out = self._through_oversized(chunk) if self._over is not None else self._feed(chunk)
        return out if self.strip else chunk

    def flush(self) -> bytes:
        """What is held at the end of the stream (an unterminated last event)."""
        head = b"".join(self._head)
        self._head.clear()
        self._head_size = 0
        return head if self.strip else b""

    # -- the bytes' way through --

    def _feed(self, chunk: bytes) -> bytes:
        cut = chunk.rfind(b"\n\n")
        if cut >= 0:
            end = cut + 2
        elif chunk[:1] == b"\n" and self._head and self._head[-1].endswith(b"\n"):
            end = 1  # the end of the held event: "\n" | "\n" across two reads
        else:
            return self._hold(chunk)
        block = b"".join((*self._head, chunk[:end])) if self._head else chunk[:end]
        self._head.clear()
        self._head_size = 0
        out = self._read(block)
        if end == len(chunk):
            return out
        held = self._hold(chunk[end:])
        return out + held if held else out

    def _hold(self, data: bytes) -> bytes:
        """Keep ``data`` as part of the unfinished event; what goes on now (strip): nothing,
        or all of it once the event is past MAX_EVENT_BYTES."""
        self._head.append(data)
        self._head_size += len(data)
        if self._head_size <= MAX_EVENT_BYTES:
            return b""
        head = b"".join(self._head)
        self._head.clear()
        self._head_size = 0
        self._over = _Oversized(head)
        self.text_events += self._over.text  # it went on: billed even if it never ends
        return head

    def _through_oversized(self, chunk: bytes) -> bytes:
        """An oversized event passes: look only for its end."""
        over = self._over
        assert over is not None
        at = chunk.find(b"\n\n")
        if at >= 0:
            end = at + 2
        elif over.newline and chunk[:1] == b"\n":
            end = 1
        else:
            over.add(chunk)
            return chunk
        over.add(chunk[:end])
        self._over = None
        self.ended = self.ended or over.last
        usage = over.usage()
        if usage is not None:
            self.found = usage
        if end == len(chunk):
            return chunk
        return chunk[:end] + self._feed(chunk[end:])

    def _read(self, block: bytes) -> bytes:
        """Complete events, read once: what they generated, whether the last one passed, their
        usage; returns what goes on (strip: without the usage-only chunk)."""
        self.text_events += len(_STEP_TEXT.findall(block))
        if b'"tool_calls"' in block:
            for piece in _TOOL_TEXT.findall(block):
                if piece:
                    self.tool_pieces += 1
                    self.tool_chars += len(piece) - piece.count(b"\\")  # \" is one
        if not self.ended and _may_end(block) and _LAST_EVENT.search(block) is not None:
            self.ended = True
        if b'"usage"' not in block:
            return block
        kept: list[bytes] = []
        for event in block.split(b"\n\n")[:-1]:
            usage, usage_only = _event_usage(event)
            if usage is not None:
                self.found = usage
                if self.strip and usage_only:
                    continue
            kept.append(event + b"\n\n")
        return b"".join(kept)


def _event_usage(event: bytes) -> tuple[Usage | None, bool]:
    """(usage in this SSE event, whether it is the usage-only chunk: ``choices`` empty). An
    event over MAX_EVENT_BYTES is read from its tail, never parsed whole."""
    if len(event) > MAX_EVENT_BYTES:
        return (usage_of_tail(event[-TAIL_BYTES:]) if b'"usage"' in event else None), False
    for line in event.split(b"\n"):
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if not data.startswith(b"{"):
            continue
        try:
            document = json.loads(data)
        except ValueError:
            continue
        if not isinstance(document, dict):
            continue
        if "usage" in document:
            return usage_of(document["usage"]), document.get("choices") == []
        response = document.get("response")  # /v1/responses: response.completed
        if document.get("type") == "response.completed" and isinstance(response, dict):
            return usage_of(response.get("usage")), False
    return None, False
