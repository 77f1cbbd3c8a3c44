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
"""

from __future__ import annotations

import json
from collections.abc import Iterator
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
    tokens, or the errors (then nothing runs). The requests themselves are read again, one at
    a time, by ``requests()``: a 200 MB file is not held twice, once as Python objects."""

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


def split_lines(data: bytes) -> Iterator[tuple[int, bytes]]:
    """(1-based line number, the line without its end) for every line that is not blank."""
    start, number = 0, 0
    size = len(data)
    while start < size:
        number += 1
        end = data.find(b"\n", start)
        if end < 0:
            end = size
        line = data[start:end]
        start = end + 1
        if line.endswith(b"\r"):
            line = line[:-1]
        if line.strip():
            yield number, line


def validate_file(data: bytes, endpoint: str, limits: BatchLimits) -> Validation:
    """Every line of ``data`` checked against the batch's ``endpoint`` and ``limits``."""
    result = Validation()

    def error(code: str, message: str, line: int | None = None, param: str | None = None) -> None:
        if len(result.errors) >= limits.max_errors:
            result.more_errors += 1
        else:
            result.errors.append(LineError(code, message, line, param))

    if len(data) > limits.max_file_bytes:
        error(
            "file_too_large",
            f"the input file is {len(data)} bytes; a batch takes at most "
            f"{limits.max_file_bytes} (LLMEP_BATCH_MAX_FILE_BYTES)",
        )
        return result
    seen: dict[str, int] = {}
    count = 0
    embedding_inputs = 0
    for number, raw in split_lines(data):
        count += 1
        if count > limits.max_requests:
            continue  # counted; reported once below
        request = _line(number, raw, endpoint, limits, error)
        if request is None:
            continue
        first = seen.setdefault(request.custom_id, number)
        if first != number:
            error(
                "duplicate_custom_id",
                f"custom_id {request.custom_id!r} is also the custom_id of line {first}; each "
                "request needs its own",
                number,
                "custom_id",
            )
            continue
        model = request.body["model"]
        if result.model is None:
            result.model, result.model_line = model, number
        elif model != result.model:
            error(
                "mismatched_model",
                f"body.model is {model!r}, but line {result.model_line} uses "
                f"{result.model!r}: one batch runs one model",
                number,
                "body.model",
            )
            continue
        if endpoint == "/v1/embeddings":
            inputs = request.body.get("input")
            embedding_inputs += len(inputs) if isinstance(inputs, list) else 1
        result.tokens += estimate_tokens(request.body, limits.default_max_tokens)
    result.count = min(count, limits.max_requests)
    if count == 0:
        error("empty_file", "the input file holds no request (one JSON object per line)")
    if count > limits.max_requests:
        error(
            "too_many_requests",
            f"the input file holds {count} requests; a batch takes at most "
            f"{limits.max_requests} (LLMEP_BATCH_MAX_REQUESTS)",
        )
    if embedding_inputs > MAX_EMBEDDING_INPUTS:
        error(
            "too_many_embedding_inputs",
            f"the batch embeds {embedding_inputs} inputs; at most {MAX_EMBEDDING_INPUTS} in "
            "one /v1/embeddings batch",
        )
    return result


def requests(data: bytes) -> Iterator[Request]:
    """The requests of a file ``validate_file`` found valid, in order."""
    for number, raw in split_lines(data):
        value = json.loads(raw)
        yield Request(number, value["custom_id"], value["body"])


def _line(number: int, raw: bytes, endpoint: str, limits: BatchLimits, error) -> Request | None:
    if len(raw) > limits.max_line_bytes:
        error(
            "line_too_large",
            f"the request is {len(raw)} bytes; at most {limits.max_line_bytes} per line "
            "(LLMEP_BATCH_MAX_LINE_BYTES)",
            number,
        )
        return None
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
