"""The front door under attack, against one real runtime (demo model, API keys on, a 2 s read
deadline): a keyless caller costs only its headers, a body that stops arriving is cut off, deep
JSON is a 400, a forged request id is replaced, client text is escaped in the log, and vLLM's
own 404 comes out in our error shape. After every attack the server still answers /ping and a
real completion. Raw sockets where the HTTP client would hide what the server does."""

from __future__ import annotations

import contextlib
import json
import re
import socket
import time

import httpx
import pytest
from runtime_process import running_runtime

pytestmark = pytest.mark.engine

KEY = "front-door-key"
AUTH = {"authorization": f"Bearer {KEY}"}
READ_TIMEOUT = 2  # REQUEST_READ_TIMEOUT_SECONDS for this module
MiB = 1024 * 1024
DEEP = '{"model": "demo", "prompt": ' + "[" * 200_000 + "]" * 200_000 + "}"
FORGED_ID = 'ab] 127.0.0.1:1 - "GET /admin HTTP/1.1" 200 #'


@pytest.fixture(scope="module")
def server(demo_model, runtime_logs):
    with running_runtime(
        demo_model,
        runtime_logs,
        API_KEYS=KEY,
        REQUEST_READ_TIMEOUT_SECONDS=str(READ_TIMEOUT),
    ) as server:
        yield server


def still_serving(server) -> None:
    """The process keeps serving: the probe and a real completion."""
    assert httpx.get(server.url + "/ping", timeout=60).status_code == 200
    response = httpx.post(
        server.url + "/v1/completions",
        headers=AUTH,
        json={"model": "demo", "prompt": "Hello", "max_tokens": 4},
        timeout=120,
    )
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 4


def raw_exchange(server, request: bytes, *, timeout: float = 60.0) -> tuple[bytes, bool]:
    """Send ``request`` bytes, then read until the server closes the connection or ``timeout``
    passes; returns (what arrived, whether the server closed)."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=timeout) as sock:
        with contextlib.suppress(OSError):  # the server may close before taking it all
            sock.sendall(request)
        received = b""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            sock.settimeout(max(0.1, deadline - time.monotonic()))
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                break
            except ConnectionResetError:
                return received, True
            if not chunk:
                return received, True
            received += chunk
        return received, False


def parse_response(raw: bytes) -> tuple[int, dict[str, str], dict]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
    return status, headers, json.loads(body)


def headers_declaring(path: str, length: int, *extra: str) -> bytes:
    lines = [
        f"POST {path} HTTP/1.1",
        "Host: 127.0.0.1",
        "Content-Type: application/json",
        f"Content-Length: {length}",
        *extra,
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


@pytest.mark.parametrize(
    ("auth", "reason"),
    [((), "missing API key"), (("Authorization: Bearer wrong",), "invalid API key")],
    ids=["keyless", "wrong-key"],
)
@pytest.mark.parametrize("path", ["/v1/completions", "/run", "/invocations"])
def test_a_declared_10_mib_body_without_a_key_gets_401_from_the_headers_and_a_close(
    server, path, auth, reason
):
    # Headers only: the body never comes. A server that read the body first would wait for it
    # and, after the read deadline, answer 408; the 401 shows the key was checked first.
    raw, closed = raw_exchange(server, headers_declaring(path, 10 * MiB, *auth))
    status, headers, body = parse_response(raw)
    assert status == 401
    assert body["error"]["type"] == "AuthenticationError"
    assert body["error"]["message"].startswith(reason)
    assert headers["connection"] == "close"
    assert closed, "the server left the connection open to receive a 10 MiB body"
    still_serving(server)


def test_the_open_probe_takes_no_body_from_a_keyless_caller(server):
    # POST /ping needs no key (SageMaker's probe): it answers, reads nothing, and closes.
    raw, closed = raw_exchange(server, headers_declaring("/ping", 10 * MiB))
    status, headers, _ = parse_response(raw)
    assert status == 200
    assert headers["connection"] == "close"
    assert closed
    still_serving(server)


def test_a_body_that_stops_arriving_gets_408_and_its_connection_closed(server):
    body = json.dumps({"model": "demo", "prompt": "Hello", "max_tokens": 4}).encode()
    request = headers_declaring("/v1/completions", len(body), f"Authorization: Bearer {KEY}")
    raw, closed = raw_exchange(server, request + body[: len(body) // 2], timeout=READ_TIMEOUT + 60)
    status, headers, error = parse_response(raw)
    assert status == 408
    assert error["error"]["type"] == "RequestTimeoutError"
    assert "REQUEST_READ_TIMEOUT_SECONDS" in error["error"]["message"]
    assert headers["connection"] == "close"
    assert closed
    still_serving(server)


@pytest.mark.parametrize(
    "sent",
    [b"", b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: "],
    ids=["nothing", "half-the-headers"],
)
def test_headers_that_do_not_arrive_get_408_and_a_close(server, sent):
    raw, closed = raw_exchange(server, sent, timeout=READ_TIMEOUT + 60)
    status, headers, error = parse_response(raw)
    assert status == 408
    assert error["error"]["type"] == "RequestTimeoutError"
    assert "headers" in error["error"]["message"]
    assert headers["connection"] == "close"
    assert closed
    still_serving(server)


def test_huge_headers_get_431_and_a_close(server):
    request = b"GET /ping HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * MiB + b"\r\n\r\n"
    raw, closed = raw_exchange(server, request)
    status, _, error = parse_response(raw)
    assert status == 431
    assert error["error"]["message"] == "request headers are larger than 65536 bytes"
    assert closed
    still_serving(server)


def test_a_keyless_body_that_stops_arriving_still_gets_its_401(server):
    raw, closed = raw_exchange(server, headers_declaring("/run", 100) + b'{"input": ')
    assert parse_response(raw)[0] == 401
    assert closed


@pytest.mark.parametrize(
    ("path", "content_type"),
    [
        ("/v1/completions", "application/json"),
        ("/v1/chat/completions", "application/json"),
        ("/run", "application/json"),
        ("/run", "text/plain"),  # our routes parse whatever the type says
        ("/runsync", "application/json"),
        ("/invocations", "application/json"),
    ],
)
def test_deep_json_is_a_400_naming_the_problem(server, path, content_type):
    response = httpx.post(
        server.url + path,
        headers={**AUTH, "content-type": content_type},
        content=DEEP,
        timeout=60,
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "BadRequestError"
    assert "nested too deeply" in error["message"]
    still_serving(server)


@pytest.mark.parametrize("path", ["/v1/completions", "/run", "/invocations"])
@pytest.mark.parametrize("size", ["small", "large"])
def test_malformed_json_is_a_400_in_openais_shape(server, path, size):
    # Large bodies are not parsed by the guard: the route's own parser (vLLM's or ours) says no.
    filler = "x" * (300 * 1024 if size == "large" else 10)
    body = '{"model": "demo", "prompt": "' + filler + '", "max_tokens": }'
    response = httpx.post(
        server.url + path,
        headers={**AUTH, "content-type": "application/json"},
        content=body,
        timeout=60,
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "BadRequestError"
    assert error["message"]
    assert "Traceback" not in response.text
    still_serving(server)


def test_a_forged_request_id_is_replaced_and_a_safe_one_kept(server):
    forged = httpx.get(server.url + "/v1/models", headers={**AUTH, "x-request-id": FORGED_ID})
    assert forged.status_code == 200
    replaced = forged.headers["x-request-id"]
    assert replaced != FORGED_ID
    assert re.fullmatch(r"[A-Za-z0-9._:-]{1,128}", replaced)
    kept = httpx.get(server.url + "/v1/models", headers={**AUTH, "x-request-id": "my-id.1:2"})
    assert kept.headers["x-request-id"] == "my-id.1:2"
    # the completion's id carries the request id vLLM was given: the safe one, not the forged
    completion = httpx.post(
        server.url + "/v1/completions",
        headers={**AUTH, "x-request-id": FORGED_ID},
        json={"model": "demo", "prompt": "Hi", "max_tokens": 2},
        timeout=120,
    )
    assert completion.status_code == 200
    assert "admin" not in completion.json()["id"]
    still_serving(server)


def test_client_text_in_the_log_is_escaped(server):
    # A quote in the query string is legal on the wire; raw, it would close the access log's
    # quoted request line and let the rest pose as a second entry.
    marker = "forged-entry-7d1f"
    request = (
        f'GET /ping?q="+127.0.0.1:1+-+"GET+/{marker}+HTTP/1.1"+200 HTTP/1.1\r\n'
        f"Host: 127.0.0.1\r\nX-Request-Id: {FORGED_ID}\r\nConnection: close\r\n\r\n"
    ).encode()
    raw, _ = raw_exchange(server, request)
    assert parse_response(raw)[0] == 200
    deadline = time.monotonic() + 30
    lines: list[str] = []
    while time.monotonic() < deadline and not lines:
        lines = [line for line in server.log().splitlines() if marker in line]
        time.sleep(0.2)
    assert lines, "the access log has no line for the request"
    for line in lines:
        assert f'\\"GET+/{marker}+HTTP/1.1\\"' in line, line
        assert not re.search(rf'(?<!\\)"GET\+/{marker}', line), line  # no bare quote
    assert FORGED_ID not in server.log()
    still_serving(server)


@pytest.mark.parametrize("method", ["GET", "POST"])
def test_an_unknown_v1_path_is_a_404_in_our_shape(server, method):
    response = httpx.request(method, server.url + "/v1/no-such-route", headers=AUTH, json={})
    assert response.status_code == 404
    assert response.json() == {
        "error": {
            "message": f"no such route: {method} /v1/no-such-route",
            "type": "NotFoundError",
            "param": None,
            "code": 404,
        }
    }
    still_serving(server)
