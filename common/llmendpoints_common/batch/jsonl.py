"""An OpenAI batch input file, validated as OpenAI validates it (pure).

One request per line: ``{"custom_id": str, "method": "POST", "url": <the batch's endpoint>,
"body": {...}}``. A file is refused as a whole -- the batch ends ``failed`` with ``errors``
naming each bad line (1-based, as an editor counts them) -- when a line is not a JSON object,
lacks or repeats a ``custom_id``, names another method or URL than the batch's, has no
``body.model`` or another model than the first line's, asks to stream, or when the file is
empty or holds too many requests. What only the model can judge (a ``max_tokens`` beyond the
context, an unknown sampling parameter) is not checked here: that request runs, fails, and
lands in the error file with the engine's 400, as at OpenAI.

Empty lines are skipped (a trailing newline, a blank line between requests).

A file is read as it streams (``Validator``, ``UploadCount``): at most one line of it is held,
and a line beyond LLMEP_BATCH_MAX_LINE_BYTES not even that (``LineReader``).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from llmendpoints_common.batch.limits import BatchLimits

# The endpoints a batch may target: the OpenAI routes a job can call with a body.
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")
MAX_CUSTOM_ID_CHARS = 512
# OpenAI: /v1/embeddings batches hold at most 50,000 embedding inputs in all.
MAX_EMBEDDING_INPUTS = 50_000
_LINE_KEYS = frozenset({"custom_id", "method", "url", "body"})


@dataclass(frozen=True)
class LineError:
    """One entry of a failed batch's ``errors.data`` (OpenAI's ``BatchError``)."""

    code: str
    message: str
    line: int | None = None
    param: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message, "param": self.param, "line": self.line}


@dataclass(frozen=True)
class Request:
    """A valid line: its ``custom_id`` and the body sent to the batch's endpoint."""

    line: int
    custom_id: str
    body: dict[str, Any]


@dataclass
class Validation:
    """What validating a file found: how many requests, their model and what they may cost in
    tokens, or the errors (then nothing runs)."""

    count: int = 0
    errors: list[LineError] = field(default_factory=list)
    model: str | None = None
    model_line: int | None = None
    tokens: int = 0
    more_errors: int = 0  # errors past ``max_errors``, counted, not listed

    @property
    def ok(self) -> bool:
        return not self.errors

    def error_list(self) -> list[dict[str, Any]]:
        listed = [e.to_json() for e in self.errors]
        if self.more_errors:
            listed.append(
                LineError(
                    "too_many_errors",
                    f"{self.more_errors} more error(s) not listed; fix the ones above first",
                ).to_json()
            )
        return listed


def check_endpoint(endpoint: object) -> str:
    """The batch's ``endpoint``; ValueError naming the ones that exist."""
    if endpoint not in ENDPOINTS:
        raise ValueError(f"endpoint: {endpoint!r} is not one of {', '.join(ENDPOINTS)}")
    return str(endpoint)


@dataclass(frozen=True)
class Line:
    """A line that is not blank: its 1-based number, its bytes without the line end, and its
    size. ``data`` is None for a line longer than the reader's bound: its bytes were counted,
    never kept."""

    number: int
    data: bytes | None
    size: int


class LineReader:
    """Lines out of a file's chunks as they arrive, holding at most ``max_bytes`` of a line:
    a 190 MiB line costs its count, not its bytes (pure)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.number = 0  # lines begun so far
        self.size = 0  # bytes read so far
        self._buffer = bytearray()
        self._line_size = 0
        self._over = False

    def feed(self, chunk: bytes) -> list[Line]:
        """The lines ``chunk`` completes (blank ones left out)."""
        self.size += len(chunk)
        found: list[Line] = []
        start = 0
        while (end := chunk.find(b"\n", start)) >= 0:
            self._take(chunk[start:end])
            if (line := self._end()) is not None:
                found.append(line)
            start = end + 1
        self._take(chunk[start:])
        return found

    def finish(self) -> list[Line]:
        """The last line, when the file does not end with a line end."""
        if not self._line_size:
            return []
        line = self._end()
        return [line] if line is not None else []

    def _take(self, piece: bytes) -> None:
        self._line_size += len(piece)
        if self._over:
            return
        if len(self._buffer) + len(piece) > self.max_bytes + 1:  # + 1: a CR before the LF
            self._over = True
            self._buffer = bytearray()
        else:
            self._buffer += piece

    def _end(self) -> Line | None:
        self.number += 1
        data: bytes | None = None
        size = self._line_size
        if not self._over:
            data = bytes(self._buffer)
            if data.endswith(b"\r"):
                data, size = data[:-1], size - 1
            if len(data) > self.max_bytes:
                data = None
        blank = data is not None and not data.strip()
        self._buffer, self._line_size, self._over = bytearray(), 0, False
        return None if blank else Line(self.number, data, size)


class Validator:
    """An input file checked line by line as it is read, against the batch's ``endpoint`` and
    ``limits``: ``feed`` it chunks (each returns its valid requests, in order), then
    ``finish`` (the last line's, if it had no line end); ``result`` then says what was found. Memory: one line (at most LLMEP_BATCH_MAX_LINE_BYTES) and a 16-byte digest per
    ``custom_id`` for the duplicate check."""

    def __init__(self, endpoint: str, limits: BatchLimits) -> None:
        self.endpoint = endpoint
        self.limits = limits
        self.result = Validation()
        self._reader = LineReader(limits.max_line_bytes)
        self._seen: dict[bytes, int] = {}  # digest of a custom_id -> its line
        self._count = 0
        self._embedding_inputs = 0
        self._too_large = False

    @property
    def ok(self) -> bool:
        return self.result.ok and not self._too_large

    def feed(self, chunk: bytes) -> list[Request]:
        if self._too_large:
            return []
        if self._reader.size + len(chunk) > self.limits.max_file_bytes:
            self._too_large = True
            return []
        return self._lines(self._reader.feed(chunk))

    def finish(self) -> list[Request]:
        """The file's end: the last line's request when it has no line end; then ``result``
        holds the whole file's findings."""
        if self._too_large:
            self.result.errors, self.result.more_errors = [], 0
            self._error(
                "file_too_large",
                f"the input file is larger than {self.limits.max_file_bytes} bytes; a batch "
                "takes at most that (LLMEP_BATCH_MAX_FILE_BYTES)",
            )
            return []
        last = self._lines(self._reader.finish())
        self._totals()
        return last

    def _error(self, code: str, message: str, line: int | None = None, param=None) -> None:
        if len(self.result.errors) >= self.limits.max_errors:
            self.result.more_errors += 1
        else:
            self.result.errors.append(LineError(code, message, line, param))

    def _lines(self, lines: list[Line]) -> list[Request]:
        valid = []
        for line in lines:
            self._count += 1
            if self._count > self.limits.max_requests:
                continue  # counted; reported once at the end
            request = self._check(line)
            if request is not None:
                valid.append(request)
        return valid

    def _check(self, line: Line) -> Request | None:
        if line.data is None:
            self._error(
                "line_too_large",
                f"the request is {line.size} bytes; at most {self.limits.max_line_bytes} per "
                "line (LLMEP_BATCH_MAX_LINE_BYTES)",
                line.number,
            )
            return None
        request = _line(line.number, line.data, self.endpoint, self._error)
        if request is None:
            return None
        digest = hashlib.blake2b(request.custom_id.encode(), digest_size=16).digest()
        first = self._seen.setdefault(digest, line.number)
        if first != line.number:
            self._error(
                "duplicate_custom_id",
                f"custom_id {request.custom_id!r} is also the custom_id of line {first}; each "
                "request needs its own",
                line.number,
                "custom_id",
            )
            return None
        result, model = self.result, request.body["model"]
        if result.model is None:
            result.model, result.model_line = model, line.number
        elif model != result.model:
            self._error(
                "mismatched_model",
                f"body.model is {model!r}, but line {result.model_line} uses "
                f"{result.model!r}: one batch runs one model",
                line.number,
                "body.model",
            )
            return None
        if self.endpoint == "/v1/embeddings":
            inputs = request.body.get("input")
            self._embedding_inputs += len(inputs) if isinstance(inputs, list) else 1
        result.tokens += estimate_tokens(request.body, self.limits.default_max_tokens)
        return request

    def _totals(self) -> None:
        limits, count = self.limits, self._count
        self.result.count = min(count, limits.max_requests)
        if count == 0:
            self._error("empty_file", "the input file holds no request (one JSON object per line)")
        if count > limits.max_requests:
            self._error(
                "too_many_requests",
                f"the input file holds {count} requests; a batch takes at most "
                f"{limits.max_requests} (LLMEP_BATCH_MAX_REQUESTS)",
            )
        if self._embedding_inputs > MAX_EMBEDDING_INPUTS:
            self._error(
                "too_many_embedding_inputs",
                f"the batch embeds {self._embedding_inputs} inputs; at most "
                f"{MAX_EMBEDDING_INPUTS} in one /v1/embeddings batch",
            )


def validate_file(data: bytes, endpoint: str, limits: BatchLimits) -> Validation:
    """A whole file in memory checked at once (``Validator``'s rules)."""
    check = Validator(endpoint, limits)
    check.feed(data)
    check.finish()
    return check.result


class UploadCount:
    """An upload's lines and what its requests may cost in tokens, counted as it arrives (not
    validated: that is the batch's validation). A line that is not a JSON object with a
    ``body``, or is longer than the line bound, counts its bytes / 4 (pure)."""

    def __init__(self, limits: BatchLimits) -> None:
        self.default_max_tokens = limits.default_max_tokens
        self._reader = LineReader(limits.max_line_bytes)
        self.lines = 0
        self.tokens = 0

    def feed(self, chunk: bytes) -> None:
        self._count(self._reader.feed(chunk))

    def finish(self) -> None:
        self._count(self._reader.finish())

    def _count(self, lines: list[Line]) -> None:
        for line in lines:
            self.lines += 1
            body = None
            if line.data is not None:
                try:
                    value = json.loads(line.data)
                    body = value.get("body") if isinstance(value, dict) else None
                except (ValueError, RecursionError):
                    pass
            if isinstance(body, dict):
                self.tokens += estimate_tokens(body, self.default_max_tokens)
            else:
                self.tokens += line.size // 4


def _line(number: int, raw: bytes, endpoint: str, error) -> Request | None:
    try:
        value = json.loads(raw)
    except UnicodeDecodeError as exc:
        error("invalid_json_line", f"the line is not UTF-8 (byte {exc.start})", number)
        return None
    except json.JSONDecodeError as exc:
        error("invalid_json_line", f"the line is not JSON: {exc.msg} (column {exc.colno})", number)
        return None
    except RecursionError:
        error("invalid_json_line", "the line is nested too deeply", number)
        return None
    if not isinstance(value, dict):
        error("invalid_json_line", "the line is not a JSON object", number)
        return None
    for key in value:
        if key not in _LINE_KEYS:
            error(
                "invalid_request",
                f"{key}: unknown field (a request line has custom_id, method, url and body)",
                number,
                str(key),
            )
            return None
    custom_id = value.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        error(
            "missing_custom_id" if custom_id is None else "invalid_custom_id",
            "custom_id: required, a non-empty string",
            number,
            "custom_id",
        )
        return None
    if len(custom_id) > MAX_CUSTOM_ID_CHARS:
        error(
            "invalid_custom_id",
            f"custom_id: at most {MAX_CUSTOM_ID_CHARS} characters, got {len(custom_id)}",
            number,
            "custom_id",
        )
        return None
    if value.get("method") != "POST":
        error(
            "invalid_method",
            f'method: must be "POST", got {value.get("method")!r}',
            number,
            "method",
        )
        return None
    if value.get("url") != endpoint:
        error(
            "mismatched_endpoint",
            f"url: {value.get('url')!r} is not the batch's endpoint {endpoint}",
            number,
            "url",
        )
        return None
    body = value.get("body")
    if not isinstance(body, dict):
        error("invalid_body", "body: required, a JSON object (the request to send)", number, "body")
        return None
    model = body.get("model")
    if not isinstance(model, str) or not model:
        error("missing_model", "body.model: required, a non-empty string", number, "body.model")
        return None
    if body.get("stream") not in (None, False):
        error(
            "invalid_body",
            "body.stream: batch requests are not streamed (drop stream, or set it to false)",
            number,
            "body.stream",
        )
        return None
    return Request(number, custom_id, body)


def estimate_tokens(body: dict[str, Any], default_max_tokens: int) -> int:
    """What one request may cost in tokens, for the enqueued-token limit: its text's bytes / 4
    (a prompt estimate that needs no tokenizer) plus what it may generate."""
    text_bytes = len(
        json.dumps(body.get("messages") or body.get("prompt") or body.get("input") or "")
    )
    sequences = body.get("n") if isinstance(body.get("n"), int) and body["n"] > 0 else 1
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    generated = limit if isinstance(limit, int) and limit >= 0 else default_max_tokens
    if "input" in body and "messages" not in body and "prompt" not in body:
        generated = 0  # embeddings generate nothing
    return text_bytes // 4 + sequences * generated
