"""A stored file's record, the upload as it arrives, and its form fields, checked (pure).

Files belong to the API key that uploaded them (or to the batch that wrote them, which belongs
to its key): another key's file id is a file that does not exist. Ids are opaque
(``file-<32 hex>``). Only ``purpose=batch`` is taken (the Batch API is the one reader of files
here); a batch's results are ``batch_output`` files.

An upload (``POST /v1/files``, multipart) reaches the verbs as events, in the order the client
sent its parts (``Upload``): a front door's multipart reader yields them while the body arrives,
so the file is stored as it comes and never held whole.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from llmendpoints_common.batch.limits import BatchLimits
from llmendpoints_common.errors import BadRequestError

MAX_FILENAME_CHARS = 255


@dataclass(frozen=True)
class FormField:
    """A text field of the form (``purpose``, ``expires_after[seconds]``)."""

    name: str
    value: str


@dataclass(frozen=True)
class FileStart:
    """The file part begins; its bytes follow as ``bytes`` events, then ``FileEnd``."""

    name: str
    filename: str | None


@dataclass(frozen=True)
class FileEnd:
    pass


FormEvent = FormField | FileStart | bytes | FileEnd


@dataclass
class Upload:
    """``POST /v1/files``'s body as it arrives: its events, and the body's declared length
    (Content-Length: the most the file can be), if the client sent one."""

    events: AsyncIterator[FormEvent]
    declared: int | None = None


@dataclass(frozen=True)
class FileContent:
    """A stored file to read: its size, and its bytes in pieces, read as they are asked for
    (``chunks()``: a reader that stops early leaves the rest unread)."""

    size: int
    chunks: Callable[[], AsyncIterator[bytes]]


def new_file_id() -> str:
    return f"file-{uuid.uuid4().hex}"


class FileRecord(BaseModel):
    model_config = ConfigDict(extra="ignore")

    id: str
    owner: str
    filename: str
    purpose: Literal["batch", "batch_output"]
    bytes: int
    created_at: float
    expires_at: float
    # What its requests may cost in tokens (an input file's: prompt estimate + max_tokens), and
    # how many lines it holds: read at upload, used by the enqueued-token limit at batch create.
    lines: int = 0
    tokens: int = 0

    def encode(self) -> bytes:
        return self.model_dump_json().encode()

    @classmethod
    def decode(cls, data: bytes) -> FileRecord:
        return cls.model_validate_json(data)

    def visible(self, owner: str, now: float) -> FileRecord | None:
        """Itself to its owner until it expires; None to anyone else, or once expired (both
        stores answer such a file as one that does not exist)."""
        return self if self.owner == owner and now < self.expires_at else None

    def to_openai(self) -> dict[str, Any]:
        """OpenAI's ``FileObject``."""
        return {
            "id": self.id,
            "object": "file",
            "bytes": self.bytes,
            "created_at": int(self.created_at),
            "expires_at": int(self.expires_at),
            "filename": self.filename,
            "purpose": self.purpose,
            "status": "processed",
            "status_details": None,
        }


def check_purpose(purpose: str | None) -> Literal["batch"]:
    if purpose is None:
        raise BadRequestError("purpose: required form field (purpose=batch)", param="purpose")
    if purpose != "batch":
        raise BadRequestError(
            f"purpose: {purpose!r} is not supported here; files are for the Batch API "
            "(purpose=batch)",
            param="purpose",
        )
    return "batch"


def check_filename(filename: str | None) -> str:
    name = (filename or "").replace("\\", "/").rsplit("/", 1)[-1].strip()
    if not name:
        raise BadRequestError("file: the file part needs a filename", param="file")
    if len(name) > MAX_FILENAME_CHARS or any(ord(c) < 32 for c in name):
        raise BadRequestError(
            f"file: the filename must be at most {MAX_FILENAME_CHARS} printable characters",
            param="file",
        )
    return name


def expires_after(
    anchor: str | None, seconds: str | None, limits: BatchLimits, *, field: str = "expires_after"
) -> int:
    """A file's lifetime from ``expires_after[anchor]`` / ``expires_after[seconds]`` (form
    fields) or the default."""
    if anchor is None and seconds is None:
        return limits.file_ttl_seconds
    if anchor != "created_at":
        raise BadRequestError(
            f"{field}[anchor]: must be 'created_at', got {anchor!r}", param=f"{field}.anchor"
        )
    return check_ttl(seconds, limits, field=field)


def check_ttl(seconds: object, limits: BatchLimits, *, field: str) -> int:
    value: int | None = None
    if isinstance(seconds, int) and not isinstance(seconds, bool):
        value = seconds
    elif isinstance(seconds, str) and seconds.strip().isascii() and seconds.strip().isdigit():
        value = int(seconds)
    low, high = limits.min_file_ttl_seconds, limits.max_file_ttl_seconds
    if value is None or not low <= value <= high:
        raise BadRequestError(
            f"{field}.seconds: must be a whole number of seconds from {low} to {high}, "
            f"got {seconds!r}",
            param=f"{field}.seconds",
        )
    return value
