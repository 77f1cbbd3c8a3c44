"""A ``multipart/form-data`` upload read as it arrives, within a deadline and a bound.

The body reader (``body.py``) keeps a whole body in memory within ``MAX_REQUEST_BODY_BYTES``;
an upload to ``/v1/files`` may be 200 MB. This reader streams the one file part into a spooled
temporary file (memory up to ``SPOOL_BYTES``, disk beyond) and keeps the small text fields
(``purpose``, ``expires_after[seconds]``) in memory:

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
import tempfile
from dataclasses import dataclass, field
from typing import IO

from llmendpoints_common.errors import (
    APIError,
    BadRequestError,
    ContentTooLargeError,
    RequestTimeoutError,
)

from llmendpoints_edge.asgi import Receive, Scope, header
from llmendpoints_edge.body import chunks_of, closing

SPOOL_BYTES = 8 * 1024 * 1024
FIELD_LIMIT = 64 * 1024
HEADERS_LIMIT = 16 * 1024
MAX_FIELDS = 32
# What the body may hold beyond the file: the other fields, part headers, boundaries.
OVERHEAD = MAX_FIELDS * (FIELD_LIMIT // 8) + HEADERS_LIMIT

_PARAM = re.compile(r';\s*([A-Za-z0-9_*-]+)\s*=\s*("(?:[^"\\]|\\.)*"|[^;]*)')


@dataclass
class Upload:
    """The form: its text fields, and its file (read from the start; the caller closes it)."""

    fields: dict[str, str] = field(default_factory=dict)
    file: IO[bytes] | None = None
    file_field: str | None = None
    filename: str | None = None
    size: int = 0

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


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
    """The multipart state machine, fed chunks as they arrive (pure but for the spool)."""

    def __init__(self, boundary: bytes, *, limit: int, setting: str, file_field: str) -> None:
        self.first = b"--" + boundary
        self.delimiter = b"\r\n--" + boundary
        self.limit = limit
        self.setting = setting
        self.file_field = file_field
        self.upload = Upload()
        self.buffer = b""
        self.state = "preamble"  # -> headers -> body -> after -> ... -> done
        self.name: str | None = None
        self.text: bytearray | None = None

    def feed(self, chunk: bytes) -> None:
        self.buffer += chunk
        while True:
            if self.state == "preamble":
                at = self.buffer.find(self.first)
                if at < 0:
                    self.buffer = self.buffer[-len(self.first) :]
                    return
                self.buffer = self.buffer[at + len(self.first) :]
                self.state = "after"
            elif self.state == "after":
                if len(self.buffer) < 2:
                    return
                if self.buffer[:2] == b"--":
                    self.state = "done"
                    return
                if self.buffer[:2] != b"\r\n":
                    raise BadRequestError("malformed multipart body (no line end after a boundary)")
                self.buffer = self.buffer[2:]
                self.state = "headers"
            elif self.state == "headers":
                end = self.buffer.find(b"\r\n\r\n")
                if end < 0:
                    if len(self.buffer) > HEADERS_LIMIT:
                        raise BadRequestError("a multipart part's headers are too large")
                    return
                self._start_part(self.buffer[:end])
                self.buffer = self.buffer[end + 4 :]
                self.state = "body"
            elif self.state == "body":
                at = self.buffer.find(self.delimiter)
                if at < 0:
                    keep = len(self.delimiter) - 1
                    if len(self.buffer) > keep:
                        self._data(self.buffer[:-keep])
                        self.buffer = self.buffer[-keep:]
                    return
                self._data(self.buffer[:at])
                self._end_part()
                self.buffer = self.buffer[at + len(self.delimiter) :]
                self.state = "after"
            else:  # done: an epilogue is ignored
                self.buffer = b""
                return

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
            if self.upload.file is not None:
                raise BadRequestError(f"{name}: only one file per upload", param=name)
            if name != self.file_field:
                raise BadRequestError(
                    f"{name}: unexpected file field (send the file as {self.file_field!r})",
                    param=name,
                )
            self.upload.file = tempfile.SpooledTemporaryFile(SPOOL_BYTES)  # noqa: SIM115
            self.upload.file_field = name
            self.upload.filename = params.get("filename")
            self.text = None
        else:
            if len(self.upload.fields) >= MAX_FIELDS:
                raise BadRequestError(f"more than {MAX_FIELDS} form fields")
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
        assert self.upload.file is not None
        self.upload.size += len(data)
        if self.upload.size > self.limit:
            raise closing(
                ContentTooLargeError(
                    f"the file is larger than {self.limit} bytes ({self.setting})",
                    param=self.file_field,
                )
            )
        self.upload.file.write(data)

    def _end_part(self) -> None:
        if self.text is not None and self.name is not None:
            try:
                self.upload.fields[self.name] = self.text.decode("utf-8")
            except UnicodeDecodeError:
                raise BadRequestError(f"{self.name}: not UTF-8 text", param=self.name) from None
        self.text = None
        self.name = None


async def read_multipart(
    scope: Scope,
    receive: Receive,
    *,
    limit: int,
    setting: str,
    timeout: float,
    timeout_setting: str = "REQUEST_READ_TIMEOUT_SECONDS",
    file_field: str = "file",
) -> Upload:
    """The upload, its file at most ``limit`` bytes; raises 400 / 408 / 413 / 415 (see the
    module), ClientGone if the client left."""
    boundary = boundary_of(scope)
    declared = header(scope, b"content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit + OVERHEAD:
        raise closing(
            ContentTooLargeError(
                f"the upload is {declared.decode()} bytes; files are at most {limit} bytes "
                f"({setting})",
                param=file_field,
            )
        )
    parser = _Parser(boundary, limit=limit, setting=setting, file_field=file_field)
    received = 0
    try:
        async with asyncio.timeout(timeout):
            async for chunk in chunks_of(receive):
                received += len(chunk)
                if received > limit + OVERHEAD:
                    raise closing(
                        ContentTooLargeError(
                            f"the upload is larger than {limit} bytes ({setting})",
                            param=file_field,
                        )
                    )
                parser.feed(chunk)
    except TimeoutError:
        parser.upload.close()
        raise closing(
            RequestTimeoutError(
                f"the upload did not arrive within {timeout:g} s ({timeout_setting})"
            )
        ) from None
    except BaseException:
        parser.upload.close()
        raise
    upload = parser.upload
    if parser.state != "done":
        upload.close()
        raise BadRequestError("the multipart body ends before its closing boundary")
    if upload.file is None:
        raise BadRequestError(f"{file_field}: required (the file part)", param=file_field)
    upload.file.seek(0)
    return upload
