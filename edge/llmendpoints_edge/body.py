"""The request body, read once: within a deadline, within a size limit, checked, handed on.

- 408, connection closed: the body has not fully arrived ``timeout`` seconds after the headers
  (a client that stops sending holds nothing for longer);
- 413, connection closed: the body is over the limit (declared or counted as it arrives);
- 400: a JSON body that is not UTF-8, not an object, or nested deeper than ``MAX_JSON_DEPTH``
  (whatever its content type, forms aside: our routes parse a body whatever the client
  declares, and a 200,000-deep array would exhaust the parser's recursion).

Large bodies are checked without being parsed: the one parse that matters is the route's own,
and a parse holds the event loop (the GIL, even in a thread) for about 0.3 s per 10 MB. Small
ones are parsed here, for errors that name the exact spot.

What was read is kept in the request's scope (``scope[BODY]``) and replayed to the application;
later ``receive()`` calls go to the server, so a client's disconnect still reaches whoever
serves the request (vLLM aborts the generation on it). The scope outlives the request -- uvicorn's
protocol keeps the last one for as long as its connection is open, idle keep-alive included --
so the body goes from it when the request ends (``release``, called by the edge's server).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import numpy as np
from llmendpoints_common.errors import (
    APIError,
    BadRequestError,
    ContentTooLargeError,
    RequestTimeoutError,
)

from llmendpoints_edge.asgi import Message, Receive, Scope, header

# Where the body read at the edge is kept for whoever needs it next (read once, parsed once).
BODY = "llmep.body"
# The JSON object the edge's own check parsed it into (bodies up to FULL_PARSE_MAX_BYTES), for
# a route that parses it next (``read_body(keep_parsed=True)``, ``parsed_object``: taken, not
# kept, so a request held for a replica holds its body and no parsed copy of it).
PARSED = "llmep.parsed"


class ClientGone(Exception):
    """The client disconnected before its request was answered."""


def read_before(scope: Scope) -> bytes | None:
    """The body the edge already read for this request, if it did."""
    return scope.get(BODY)


async def read_body(
    scope: Scope,
    receive: Receive,
    *,
    limit: int,
    setting: str,
    timeout: float,
    arrays: bool = False,
    keep_parsed: bool = False,
) -> bytes:
    """The whole body, kept in ``scope[BODY]``; raises 408 / 413 (with ``Connection: close``),
    400 for a body no route could use, ClientGone if the client left. ``arrays``: a JSON array
    is a body too (RunPod's batch create takes one). ``keep_parsed``: the route will parse it
    (``parsed_object``): keep the object the check parsed for it."""
    declared = header(scope, b"content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(limit, setting, declared)
    chunks: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(timeout):
            async for chunk in chunks_of(receive):
                size += len(chunk)
                if size > limit:
                    raise _too_large(limit, setting)
                chunks.append(chunk)
    except TimeoutError:
        raise closing(
            RequestTimeoutError(
                f"the request body did not arrive within {timeout:g} s "
                "(REQUEST_READ_TIMEOUT_SECONDS)"
            )
        ) from None
    body = b"".join(chunks)
    content_type = (header(scope, b"content-type") or b"").split(b";")[0].strip().lower()
    problem, parsed = _check_body(body, content_type, arrays=arrays)
    if problem is not None:
        raise BadRequestError(problem)
    scope[BODY] = body
    if keep_parsed and parsed is not None:
        scope[PARSED] = parsed
    return body


async def chunks_of(receive: Receive) -> AsyncIterator[bytes]:
    """The body's chunks as they arrive; ClientGone if the client leaves first."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone()
        yield message.get("body", b"")
        if not message.get("more_body", False):
            return


def release(scope: Scope) -> int:
    """The request ended: drop what the edge kept of its body; its size. A kept-alive
    connection holds its last request's scope until the next request or its idle timeout
    (75 s): 40 idle clients that each sent 10 MB held 400 MB."""
    scope.pop(PARSED, None)
    body = scope.pop(BODY, None)
    return len(body) if body is not None else 0


def closing(exc: APIError) -> APIError:
    """``exc`` with ``Connection: close``: the rest of the body is never read."""
    exc.headers["connection"] = "close"
    return exc


def _too_large(limit: int, setting: str, declared: bytes | None = None) -> APIError:
    size = f"is {declared.decode()} bytes" if declared is not None else "is larger"
    return closing(
        ContentTooLargeError(f"request body {size}; the limit is {limit} bytes ({setting})")
    )


def replay(body: bytes, *, then: Receive) -> Receive:
    """A ``receive`` that hands the app ``body`` as the whole request, once, then defers to
    ``then`` (usually the server's receive, so a client's disconnect still reaches the app)."""
    sent = False

    async def receive() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await then()

    return receive


# Deeper bodies are refused before any parser sees them. Python's parser gives up (RecursionError)
# near 1,000 levels, and what vLLM does with the parsed value may recurse again; no request
# body needs more than a few dozen (a JSON schema nests two levels per object level).
MAX_JSON_DEPTH = 128
# Bodies up to this size are parsed here, for messages that point at the error; larger ones
# only get the cheap structural checks (json_depth_exceeds costs ~60 ms per 10 MB at worst).
FULL_PARSE_MAX_BYTES = 256 * 1024
_FORM_TYPES = frozenset({b"multipart/form-data", b"application/x-www-form-urlencoded"})


def is_json_type(content_type: bytes) -> bool:
    """Content types that FastAPI (so vLLM) parses as JSON: none, application/json, +json."""
    return content_type in (b"", b"application/json") or (
        content_type.startswith(b"application/") and content_type.endswith(b"+json")
    )


def body_problem(body: bytes, content_type: bytes, *, arrays: bool = False) -> str | None:
    """Why a request body is refused before any route sees it, or None (pure). ``arrays``:
    a JSON array is as good as an object."""
    return _check_body(body, content_type, arrays=arrays)[0]


def _check_body(
    body: bytes, content_type: bytes, *, arrays: bool = False
) -> tuple[str | None, dict | None]:
    """``body_problem``, and the JSON object the check parsed (None: not parsed here, or an
    array)."""
    if not body or content_type in _FORM_TYPES:
        return None, None
    if is_json_type(content_type):
        if len(body) <= FULL_PARSE_MAX_BYTES:
            return _check_json(body, arrays=arrays)
        return large_json_body_problem(body, arrays=arrays), None
    # Our routes parse a body as JSON whatever its declared type: the depth bound holds too.
    if json_depth_exceeds(body, MAX_JSON_DEPTH):
        return _too_deep(), None
    return None, None


def _not_utf8(exc: UnicodeDecodeError) -> str:
    return f"request body is not valid UTF-8 (the bytes from offset {exc.start} are not UTF-8)"


def _too_deep() -> str:
    return f"request body is nested too deeply: more than {MAX_JSON_DEPTH} levels of arrays and objects"


def json_body_problem(body: bytes, *, arrays: bool = False) -> str | None:
    """Why a JSON request body is unusable, or None (pure; parses the body)."""
    return _check_json(body, arrays=arrays)[0]


def _check_json(body: bytes, *, arrays: bool = False) -> tuple[str | None, dict | None]:
    """``json_body_problem``, and the object parsed when there is none."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        return _not_utf8(exc), None
    if json_depth_exceeds(body, MAX_JSON_DEPTH):
        return _too_deep(), None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        return (
            f"request body is not valid JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})",
            None,
        )
    except RecursionError:  # unreachable after the depth check; never a 500 all the same
        return _too_deep(), None
    if isinstance(value, dict):
        return None, value
    if arrays and isinstance(value, list):
        return None, None
    what = _JSON_TYPE_NAMES.get(type(value), "a value")
    return f"request body must be a JSON object, got {what}", None


def large_json_body_problem(body: bytes, *, arrays: bool = False) -> str | None:
    """The checks of ``json_body_problem`` that need no parse: UTF-8, an object, the depth
    (pure). Malformed JSON further in is left to the route's parser, which answers 400."""
    try:
        body.decode("utf-8")
    except UnicodeDecodeError as exc:
        return _not_utf8(exc)
    first = body.lstrip(b" \t\r\n")[:1]
    if first != b"{" and not (arrays and first == b"["):
        what = _FIRST_BYTE_NAMES.get(first, "a value" if first else "only whitespace")
        if first[:1].isdigit():
            what = "a number"
        return f"request body must be a JSON object, got {what}"
    if json_depth_exceeds(body, MAX_JSON_DEPTH):
        return _too_deep()
    return None


_FIRST_BYTE_NAMES = {
    b"[": "an array",
    b'"': "a string",
    b"-": "a number",
    b"t": "a boolean",
    b"f": "a boolean",
    b"n": "null",
}

_JSON_TYPE_NAMES = {
    list: "an array",
    str: "a string",
    int: "a number",
    float: "a number",
    bool: "a boolean",
    type(None): "null",
}

# +1 for [ and {, -1 for ] and }, 0 for every other byte.
_DEPTH_STEP = np.zeros(256, dtype=np.int8)
_DEPTH_STEP[[ord("["), ord("{")]] = 1
_DEPTH_STEP[[ord("]"), ord("}")]] = -1
_QUOTE = ord('"')
_SCAN_CHUNK = 1 << 20


def json_depth_exceeds(body: bytes, limit: int) -> bool:
    """Whether ``body``, read as JSON, nests arrays and objects more than ``limit`` deep
    (pure, no parse: vectorised over the bytes, so a 10 MB body costs tens of milliseconds).

    Brackets inside strings do not count. Escaped backslashes and quotes are dropped first, so
    every quote left opens or closes a string. On malformed input the count may be off, but
    never below what a parser would reach before it stops at the first error.
    """
    if body.count(b"[") + body.count(b"{") <= limit:
        return False
    text = body.replace(b"\\\\", b"").replace(b'\\"', b"")
    data = np.frombuffer(text, dtype=np.uint8)
    depth = quotes = 0
    for start in range(0, len(data), _SCAN_CHUNK):  # chunks bound the scan's memory
        chunk = data[start : start + _SCAN_CHUNK]
        quote_count = np.cumsum(chunk == _QUOTE, dtype=np.int64) + quotes
        steps = _DEPTH_STEP[chunk].astype(np.int64)
        steps[(quote_count & 1).astype(bool)] = 0  # inside a string
        depths = np.cumsum(steps) + depth
        if int(depths.max()) > limit:
            return True
        depth, quotes = int(depths[-1]), int(quote_count[-1])
    return False


def parsed_object(scope: Scope, body: bytes) -> dict:
    """``parse_object(body)``, without parsing again a body the edge's check parsed already
    (``read_body`` into this scope). The parsed object is handed over once: taken from the
    scope, so the scope keeps no second copy of the body."""
    parsed = scope.pop(PARSED, None)
    if parsed is not None and scope.get(BODY) is body:
        return parsed
    return parse_object(body)


def parse_object(body: bytes) -> dict:
    """A body the edge has checked, as the JSON object it is (400 for malformed JSON, which
    the edge leaves to this parse for bodies over ``FULL_PARSE_MAX_BYTES``)."""
    if not body:
        raise BadRequestError("the request body is empty: send a JSON object")
    try:
        value = json.loads(body)
    except (ValueError, RecursionError) as exc:
        detail = exc.msg if isinstance(exc, json.JSONDecodeError) else type(exc).__name__
        raise BadRequestError(f"request body is not valid JSON: {detail}") from None
    if not isinstance(value, dict):
        raise BadRequestError(
            f"request body must be a JSON object, got {_JSON_TYPE_NAMES.get(type(value), 'a value')}"
        )
    return value
