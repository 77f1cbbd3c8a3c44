"""A ``multipart/form-data`` upload read as it arrives, within a deadline and a bound.

The body reader (``body.py``) keeps a whole body in memory within ``MAX_REQUEST_BODY_BYTES``;
an upload to ``/v1/files`` may be 200 MB. This reader holds none of the file: it turns the body
into events as it arrives (``llmendpoints_common.batch.files``: ``FormField`` for each small text
field, ``FileStart``, the file's bytes, ``FileEnd``), and its consumer stores each piece before
the next is read -- TCP's own flow control holds the client back meanwhile. So an upload costs
the server what one piece costs, whatever the file's size:

- 408, connection closed: the upload has not fully arrived ``timeout`` seconds after the
  headers;
- 413, connection closed: the file is over ``limit`` (declared or counted as it arrives), or
  the whole body over ``limit`` plus room for the other fields;
- 400: not a multipart body, no boundary, a malformed part, a text field over
  ``FIELD_LIMIT``, more than one file, or no file at all;
- 415: another content type.

Pure of any framework: it reads an ASGI ``receive``.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator

from llmendpoints_common.batch.files import FileEnd, FileStart, FormEvent, FormField, Upload
from llmendpoints_common.errors import (
    APIError,
    BadRequestError,
    ContentTooLargeError,
    RequestTimeoutError,
)

from llmendpoints_edge.asgi import Receive, Scope, header
from llmendpoints_edge.body import ClientGone, closing

FIELD_LIMIT = 64 * 1024
HEADERS_LIMIT = 16 * 1024
MAX_FIELDS = 32
# What the body may hold beyond the file: the other fields, part headers, boundaries.
OVERHEAD = MAX_FIELDS * (FIELD_LIMIT // 8) + HEADERS_LIMIT

_PARAM = re.compile(r';\s*([A-Za-z0-9_*-]+)\s*=\s*("(?:[^"\\]|\\.)*"|[^;]*)')


def content_params(value: str) -> tuple[str, dict[str, str]]:
    """``form-data; name="file"; filename="a.jsonl"`` -> ("form-data", {...}) (pure)."""
    kind, _, rest = value.partition(";")
    params: dict[str, str] = {}
    for match in _PARAM.finditer(";" + rest):
        name, raw = match.group(1).lower(), match.group(2).strip()
        if raw.startswith('"') and raw.endswith('"') and len(raw) >= 2:
            raw = re.sub(r"\\(.)", r"\1", raw[1:-1])
        params[name] = raw
    return kind.strip().lower(), params


def boundary_of(scope: Scope) -> bytes:
    content_type = (header(scope, b"content-type") or b"").decode("latin-1")
    kind, params = content_params(content_type)
    if kind != "multipart/form-data":
        raise APIError(
            415,
            f"the upload must be multipart/form-data (a file field and purpose), got "
            f"{kind or 'no content type'}",
        )
    boundary = params.get("boundary", "")
    if not 1 <= len(boundary) <= 200:
        raise BadRequestError("multipart/form-data without a valid boundary")
    return boundary.encode("latin-1")


class _Parser:
    """The multipart state machine, fed chunks as they arrive; each feed returns the events
    those bytes complete (pure)."""

    def __init__(self, boundary: bytes, *, limit: int, setting: str, file_field: str) -> None:
        self.first = b"--" + boundary
        self.delimiter = b"\r\n--" + boundary
        self.limit = limit
        self.setting = setting
        self.file_field = file_field
        self.buffer = b""
        self.state = "preamble"  # -> headers -> body -> after -> ... -> done
        self.name: str | None = None
        self.text: bytearray | None = None  # the text field being read (None: the file)
        self.fields = 0
        self.file_seen = False
        self.file_size = 0
        self._events: list[FormEvent] = []

    def feed(self, chunk: bytes) -> list[FormEvent]:
        self.buffer += chunk
        self._events = []
        while self._step():
            pass
        return self._events

    def _step(self) -> bool:
        """One move of the state machine; False when it needs more bytes."""
        if self.state == "preamble":
            at = self.buffer.find(self.first)
            if at < 0:
                self.buffer = self.buffer[-len(self.first) :]
                return False
            self.buffer = self.buffer[at + len(self.first) :]
            self.state = "after"
        elif self.state == "after":
            return self._after_boundary()
        elif self.state == "headers":
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0:
                if len(self.buffer) > HEADERS_LIMIT:
                    raise BadRequestError("a multipart part's headers are too large")
                return False
            self._start_part(self.buffer[:end])
            self.buffer = self.buffer[end + 4 :]
            self.state = "body"
        elif self.state == "body":
            return self._body()
        else:  # done: an epilogue is ignored
            self.buffer = b""
            return False
        return True

    def _after_boundary(self) -> bool:
        if len(self.buffer) < 2:
            return False
        if self.buffer[:2] == b"--":
            self.state = "done"
            return False
        if self.buffer[:2] != b"\r\n":
            raise BadRequestError("malformed multipart body (no line end after a boundary)")
        self.buffer = self.buffer[2:]
        self.state = "headers"
        return True

    def _body(self) -> bool:
        at = self.buffer.find(self.delimiter)
        if at < 0:
            keep = len(self.delimiter) - 1
            if len(self.buffer) > keep:
                self._data(self.buffer[:-keep])
                self.buffer = self.buffer[-keep:]
            return False
        self._data(self.buffer[:at])
        self._end_part()
        self.buffer = self.buffer[at + len(self.delimiter) :]
        self.state = "after"
        return True

    def _start_part(self, raw: bytes) -> None:
        headers: dict[str, str] = {}
        for line in raw.decode("utf-8", "replace").split("\r\n"):
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        kind, params = content_params(headers.get("content-disposition", ""))
        name = params.get("name")
        if kind != "form-data" or not name:
            raise BadRequestError("malformed multipart part (no form-data name)")
        self.name = name
        if "filename" in params or name == self.file_field:
            if self.file_seen:
                raise BadRequestError(f"{name}: only one file per upload", param=name)
            if name != self.file_field:
                raise BadRequestError(
                    f"{name}: unexpected file field (send the file as {self.file_field!r})",
                    param=name,
                )
            self.file_seen = True
            self.text = None
            self._events.append(FileStart(name, params.get("filename")))
        else:
            if self.fields >= MAX_FIELDS:
                raise BadRequestError(f"more than {MAX_FIELDS} form fields")
            self.fields += 1
            self.text = bytearray()

    def _data(self, data: bytes) -> None:
        if not data:
            return
        if self.text is not None:
            self.text += data
            if len(self.text) > FIELD_LIMIT:
                raise BadRequestError(
                    f"{self.name}: a form field of at most {FIELD_LIMIT} bytes", param=self.name
                )
            return
        self.file_size += len(data)
        if self.file_size > self.limit:
            raise closing(
                ContentTooLargeError(
                    f"the file is larger than {self.limit} bytes ({self.setting})",
                    param=self.file_field,
                )
            )
        self._events.append(data)

    def _end_part(self) -> None:
        if self.text is not None and self.name is not None:
            try:
                self._events.append(FormField(self.name, self.text.decode("utf-8")))
            except UnicodeDecodeError:
                raise BadRequestError(f"{self.name}: not UTF-8 text", param=self.name) from None
        elif self.text is None:
            self._events.append(FileEnd())
        self.text = None
        self.name = None


class MultipartReader:
    """An upload's body as events (``upload()``), read only as its consumer asks for them;
    ``complete`` once the whole body was read (else the answer must close the connection).
    The content type (415, 400) and a declared length over the bound (413) are checked when
    it is made, before any of the body is read."""

    def __init__(
        self,
        scope: Scope,
        receive: Receive,
        *,
        limit: int,
        setting: str,
        timeout: float,
        timeout_setting: str = "REQUEST_READ_TIMEOUT_SECONDS",
        file_field: str = "file",
    ) -> None:
        try:
            boundary = boundary_of(scope)
        except APIError as exc:
            raise closing(exc) from None  # the body is never read
        raw = header(scope, b"content-length")
        self.declared = int(raw) if raw is not None and raw.isdigit() else None
        if self.declared is not None and self.declared > limit + OVERHEAD:
            raise closing(
                ContentTooLargeError(
                    f"the upload is {self.declared} bytes; files are at most {limit} bytes "
                    f"({setting})",
                    param=file_field,
                )
            )
        self._receive = receive
        self._parser = _Parser(boundary, limit=limit, setting=setting, file_field=file_field)
        self._limit = limit
        self._setting = setting
        self._timeout = timeout
        self._timeout_setting = timeout_setting
        self.complete = False

    def upload(self) -> Upload:
        return Upload(self._events(), self.declared)

    async def _events(self) -> AsyncIterator[FormEvent]:
        parser = self._parser
        deadline = asyncio.get_running_loop().time() + self._timeout
        received = 0
        more = True
        while more:
            message = await self._next(deadline)
            if message["type"] == "http.disconnect":
                raise ClientGone()
            chunk = message.get("body", b"")
            more = message.get("more_body", False)
            received += len(chunk)
            if received > self._limit + OVERHEAD:
                raise closing(
                    ContentTooLargeError(
                        f"the upload is larger than {self._limit} bytes ({self._setting})",
                        param=parser.file_field,
                    )
                )
            for event in parser.feed(chunk):
                yield event
        self.complete = True
        if parser.state != "done":
            raise BadRequestError("the multipart body ends before its closing boundary")
        if not parser.file_seen:
            raise BadRequestError(
                f"{parser.file_field}: required (the file part)", param=parser.file_field
            )

    async def _next(self, deadline: float) -> dict:
        """The next message of the body, within the upload's deadline (408 past it)."""
        try:
            async with asyncio.timeout_at(deadline):
                return await self._receive()
        except TimeoutError:
            raise closing(
                RequestTimeoutError(
                    f"the upload did not arrive within {self._timeout:g} s "
                    f"({self._timeout_setting})"
                )
            ) from None
