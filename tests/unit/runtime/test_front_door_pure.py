"""The front door's pure parts and its ASGI middleware, without a server: the key is checked
before the body is read, the read deadline, the JSON depth bound, request ids, log escaping and
vLLM's error answers in our shape. The same attacks against a real server: tests/runtime/
test_front_door.py."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest
from llmendpoints_common.jobs.models import parse_json_object
from llmendpoints_common.request_ids import valid_request_id
from llmendpoints_edge.asgi import declares_body
from llmendpoints_edge.body import (
    MAX_JSON_DEPTH,
    body_problem,
    json_body_problem,
    json_depth_exceeds,
    large_json_body_problem,
)
from llmendpoints_edge.logs import TEXT_FORMAT, TextFormatter, escape_log_text
from llmendpoints_runtime.auth import APIKeyMiddleware, KeyStore
from llmendpoints_runtime.errors import OpenAIShapedErrors, reshape_error_body
from llmendpoints_runtime.metrics import RuntimeMetrics
from llmendpoints_runtime.middleware import BodyGuard, RequestContext

MiB = 1024 * 1024


def nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


DEEP = b'{"a": ' + nested(200_000) + b"}"


# -- JSON depth ---------------------------------------------------------------------------------


@pytest.mark.parametrize("depth", [1, MAX_JSON_DEPTH])
def test_depth_within_the_bound_passes(depth):
    assert not json_depth_exceeds(nested(depth), MAX_JSON_DEPTH)
    inner = b"[" * (depth - 1) + b"1" + b"]" * (depth - 1)
    assert json_body_problem(b'{"a": ' + inner + b"}") is None


@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH + 1, 200_000])
def test_depth_over_the_bound_is_caught_without_parsing(depth):
    assert json_depth_exceeds(nested(depth), MAX_JSON_DEPTH)
    assert json_depth_exceeds(b'{"a":' * depth + b"1" + b"}" * depth, MAX_JSON_DEPTH)


def test_depth_counts_running_nesting_not_bracket_totals():
    # 10,000 sibling arrays: many brackets, depth 2.
    body = b"[" + b",".join([b"[1]"] * 10_000) + b"]"
    assert not json_depth_exceeds(body, MAX_JSON_DEPTH)


@pytest.mark.parametrize(
    "string",
    [
        "[" * 1000,  # brackets inside a string do not nest
        '\\"' + "[" * 1000,  # an escaped quote does not end the string
        "\\\\" + "x",  # an escaped backslash before the closing quote
    ],
)
def test_brackets_inside_strings_do_not_count(string):
    body = json.dumps({"prompt": string, "after": [[1]]}).encode()
    assert json.loads(body)["prompt"] == string
    assert not json_depth_exceeds(body, 4)


def test_an_escaped_backslash_then_a_real_quote_ends_the_string():
    # "a\\" ends at its third quote; the brackets after it are real.
    body = b'{"p": "a\\\\", "q": ' + nested(10) + b"}"
    assert json_depth_exceeds(body, 5)
    assert not json_depth_exceeds(body, 11)


def test_depth_is_followed_across_scan_chunks():
    filler = b'"' + b"x" * (3 * MiB) + b'"'
    body = b"[" * 100 + filler + b"," + nested(100) + b"]" * 100
    assert json_depth_exceeds(body, 150)
    assert not json_depth_exceeds(body, 200)


@pytest.mark.parametrize(
    ("body", "content_type", "problem"),
    [
        (b'{"a": 1}', b"application/json", None),
        (b"{bad", b"application/json", "not valid JSON"),
        (b"[1]", b"application/json", "got an array"),
        (DEEP, b"application/json", "nested too deeply"),
        (DEEP, b"", "nested too deeply"),
        (DEEP, b"application/vnd.api+json", "nested too deeply"),
        # our routes parse any body as JSON: the depth bound holds whatever the type says
        (DEEP, b"text/plain", "nested too deeply"),
        (b"not json at all", b"text/plain", None),
        (DEEP, b"multipart/form-data", None),
    ],
)
def test_body_problem(body, content_type, problem):
    found = body_problem(body, content_type)
    if problem is None:
        assert found is None
    else:
        assert found is not None and problem in found


def test_a_deep_body_names_the_bound():
    message = json_body_problem(nested(200_000))
    assert message == (
        f"request body is nested too deeply: more than {MAX_JSON_DEPTH} levels of arrays "
        "and objects"
    )


@pytest.mark.parametrize(
    ("body", "problem"),
    [
        (b'  {"prompt": "' + b"x" * MiB + b'"}', None),
        (b"[" + b"1," * MiB + b"1]", "must be a JSON object, got an array"),
        (b"12345", "got a number"),
        (b'"' + b"x" * MiB + b'"', "got a string"),
        (b'{"p": "\xff"}', "not valid UTF-8"),
        (b'{"a": ' + nested(300_000) + b"}", "nested too deeply"),
    ],
)
def test_large_bodies_are_checked_without_a_parse(body, problem):
    found = large_json_body_problem(body)
    if problem is None:
        assert found is None
    else:
        assert found is not None and problem in found


def test_the_job_parser_refuses_deep_json_with_a_400_not_a_recursion_error():
    from llmendpoints_common.errors import BadRequestError

    with pytest.raises(BadRequestError, match="nested too deeply"):
        parse_json_object(nested(200_000))


# -- request ids --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "kept"),
    [
        (b"abc-123", True),
        (b"req_1.2:3", True),
        (b"A.b:c-9", True),
        (b"x" * 128, True),
        (b"x" * 129, False),
        (b"", False),
        (None, False),
        (b'ab] 127.0.0.1:1 - "GET /admin HTTP/1.1" 200 #', False),
        (b"id\r\nforged", False),
        ("caf\u00e9".encode(), False),
    ],
)
def test_valid_request_id(value, kept):
    assert valid_request_id(value) is kept


async def _through_context(request_id: bytes | None) -> tuple[str, str]:
    """(the id the app saw in its scope, the id echoed in the response)."""
    seen: dict = {}

    async def app(scope, receive, send):
        seen["id"] = dict(scope["headers"])[b"x-request-id"].decode()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    sent: list[dict] = []

    async def send(message):
        sent.append(message)

    headers = [] if request_id is None else [(b"x-request-id", request_id)]
    scope = {"type": "http", "method": "GET", "path": "/x", "headers": headers}
    await RequestContext(app, RuntimeMetrics())(scope, None, send)
    echoed = dict(sent[0]["headers"])[b"x-request-id"].decode()
    return seen["id"], echoed


async def test_a_safe_request_id_is_kept_and_echoed():
    assert await _through_context(b"client-id.1:2") == ("client-id.1:2", "client-id.1:2")


@pytest.mark.parametrize("forged", [b'ab] 127.0.0.1:1 - "GET /admin HTTP/1.1" 200 #', b"a b"])
async def test_a_forged_request_id_is_replaced_everywhere(forged):
    seen, echoed = await _through_context(forged)
    assert seen == echoed
    assert len(seen) == 32 and valid_request_id(seen.encode())


# -- log lines ----------------------------------------------------------------------------------


def test_escape_log_text():
    assert escape_log_text('a"b\\c\nd\re\x1b\u2028') == 'a\\"b\\\\c\\nd\\re\\u001b\\u2028'
    assert escape_log_text("/v1/plain-path_1") == "/v1/plain-path_1"


def test_text_lines_escape_every_argument_but_not_the_format():
    record = logging.LogRecord(
        "uvicorn.access",
        logging.INFO,
        __file__,
        1,
        '%s - "%s %s HTTP/%s" %d',
        ("127.0.0.1:1", "GET", '/x"\n127.0.0.1:2 - "GET /admin HTTP/1.1" 200', "1.1", 404),
        None,
    )
    record.request_id = "-"
    line = TextFormatter(TEXT_FORMAT).format(record)
    assert "\n" not in line
    assert line.endswith(
        '127.0.0.1:1 - "GET /x\\"\\n127.0.0.1:2 - \\"GET /admin HTTP/1.1\\" 200 HTTP/1.1" 404'
    )
    # the record itself is untouched (another handler would see the raw arguments)
    assert record.args[2].startswith('/x"\n')


# -- the key before the body ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("headers", "declared"),
    [
        ([(b"content-length", b"10485760")], True),
        ([(b"transfer-encoding", b"chunked")], True),
        ([(b"content-length", b"0")], False),
        ([], False),
    ],
)
def test_declares_body(headers, declared):
    assert declares_body({"headers": headers}) is declared


def _never_receive():
    async def receive():
        raise AssertionError("the body was read before the key was checked")

    return receive


@pytest.mark.parametrize("key", [None, b"Bearer wrong"])
async def test_a_keyless_request_gets_401_and_close_without_a_byte_of_body_read(key):
    reached = False

    async def app(scope, receive, send):
        nonlocal reached
        reached = True

    guard = BodyGuard(app, 10 * MiB, RuntimeMetrics())
    stack = APIKeyMiddleware(guard, KeyStore(("right",), None), frozenset())
    headers = [(b"content-length", b"10485760"), (b"content-type", b"application/json")]
    if key is not None:
        headers.append((b"authorization", key))
    sent: list[dict] = []

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": headers}
    await stack(scope, _never_receive(), send)
    assert not reached
    assert sent[0]["status"] == 401
    response_headers = dict(sent[0]["headers"])
    assert response_headers[b"connection"] == b"close"
    assert json.loads(sent[1]["body"])["error"]["type"] == "AuthenticationError"


# -- the read deadline ----------------------------------------------------------------------------


async def test_a_body_that_stops_arriving_gets_408_and_close():
    first = True

    async def receive():
        nonlocal first
        if first:
            first = False
            return {"type": "http.request", "body": b'{"prompt": ', "more_body": True}
        await asyncio.Event().wait()  # the rest never comes

    async def app(scope, receive, send):
        raise AssertionError("the app must not be called")

    sent: list[dict] = []

    async def send(message):
        sent.append(message)

    headers = [(b"content-length", b"100"), (b"content-type", b"application/json")]
    scope = {"type": "http", "method": "POST", "path": "/run", "headers": headers}
    await BodyGuard(app, 10 * MiB, RuntimeMetrics(), read_timeout=0.05)(scope, receive, send)
    assert sent[0]["status"] == 408
    assert dict(sent[0]["headers"])[b"connection"] == b"close"
    error = json.loads(sent[1]["body"])["error"]
    assert error["type"] == "RequestTimeoutError"
    assert "REQUEST_READ_TIMEOUT_SECONDS" in error["message"]


# -- vLLM's error answers ---------------------------------------------------------------------------


def test_vllms_not_found_comes_out_in_our_shape():
    vllm = b'{"error": {"message": "Not Found", "type": "Not Found", "param": null, "code": 404}}'
    assert json.loads(reshape_error_body(404, vllm, "POST", "/v1/nope")) == {
        "error": {
            "message": "no such route: POST /v1/nope",
            "type": "NotFoundError",
            "param": None,
            "code": 404,
        }
    }


def test_starlettes_detail_body_comes_out_in_our_shape():
    body = reshape_error_body(405, b'{"detail": "Method Not Allowed"}', "PUT", "/v1/models")
    error = json.loads(body)["error"]
    assert error["type"] == "MethodNotAllowedError"
    assert error["message"] == "/v1/models does not take PUT"


def test_vllms_own_openai_errors_keep_their_message_and_param():
    vllm = json.dumps(
        {"error": {"message": "bad n", "type": "BadRequestError", "param": "n", "code": 400}}
    ).encode()
    assert json.loads(reshape_error_body(400, vllm, "POST", "/v1/completions")) == json.loads(vllm)


async def test_the_wrapper_rewrites_error_answers_and_passes_streams():
    async def inner(scope, receive, send):
        status = 404 if scope["path"] == "/v1/nope" else 200
        headers = [(b"content-type", b"application/json"), (b"content-length", b"9")]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": b'{"detail":', "more_body": True})
        await send({"type": "http.response.body", "body": b'"Not Found"}'})

    async def run(path):
        sent: list[dict] = []

        async def send(message):
            sent.append(message)

        scope = {"type": "http", "method": "GET", "path": path, "headers": []}
        await OpenAIShapedErrors(inner)(scope, None, send)
        return sent

    sent = await run("/v1/nope")
    body = sent[1]["body"]
    assert dict(sent[0]["headers"])[b"content-length"] == str(len(body)).encode()
    assert json.loads(body)["error"]["type"] == "NotFoundError"
    assert len(await run("/v1/ok")) == 3  # a 200 passes through message by message


async def test_an_open_probe_never_reads_a_body_and_closes_after_answering():
    async def probe(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    sent: list[dict] = []

    async def send(message):
        sent.append(message)

    stack = APIKeyMiddleware(
        BodyGuard(probe, 10 * MiB, RuntimeMetrics()),
        KeyStore(("right",), None),
        frozenset({"/ping"}),
    )
    headers = [(b"content-length", b"10485760")]
    scope = {"type": "http", "method": "POST", "path": "/ping", "headers": headers}
    await stack(scope, _never_receive(), send)
    assert sent[0]["status"] == 200
    assert dict(sent[0]["headers"])[b"connection"] == b"close"
