"""The header deadline and size bound (server.BoundedHeadersProtocol) and the keep-alive timeout
on a real uvicorn configured as both servers are (server.uvicorn_config), serving a trivial ASGI
app on loopback: no engine. The same against the runtime: tests/runtime/test_front_door.py."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import uvicorn
from llmendpoints_edge.server import DEFAULT_MAX_HEADER_BYTES as MAX_HEADER_BYTES
from llmendpoints_edge.server import uvicorn_config
from llmendpoints_edge.settings import EdgeSettings
from ports import free_port

DEADLINE = 1.0
KEEP_ALIVE = 2.0
WAIT = 30.0  # generous: a condition to wait for, never a timing assertion


async def ok_app(scope, receive, send):
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body", False):  # the whole body, like the runtime
        pass
    await send(
        {"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]}
    )
    await send({"type": "http.response.body", "body": b"ok"})


@pytest.fixture(scope="module")
def port() -> Iterator[int]:
    port = free_port()
    settings = EdgeSettings(
        HOST="127.0.0.1",
        PORT=port,
        REQUEST_READ_TIMEOUT_SECONDS=DEADLINE,
        KEEP_ALIVE_TIMEOUT_SECONDS=KEEP_ALIVE,
    )
    config = uvicorn_config(ok_app, settings, lifespan="off")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + WAIT
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.started
    yield port
    server.should_exit = True
    thread.join(WAIT)


def exchange(port: int, pieces: list[bytes], gap: float = 0.0) -> tuple[bytes, bool]:
    """Send ``pieces`` ``gap`` seconds apart, then read until the server closes or WAIT."""
    with socket.create_connection(("127.0.0.1", port), timeout=WAIT) as sock:
        with contextlib.suppress(OSError):
            for piece in pieces:
                sock.sendall(piece)
                time.sleep(gap)
        received = b""
        sock.settimeout(WAIT)
        while True:
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                return received, False
            except ConnectionResetError:
                return received, True
            if not chunk:
                return received, True
            received += chunk


def status_and_error(raw: bytes) -> tuple[int, dict]:
    head, _, body = raw.partition(b"\r\n\r\n")
    assert b"connection: close" in head.lower()
    return int(head.split()[1]), json.loads(body)["error"]


def test_a_connection_that_sends_nothing_gets_408_and_is_closed(port):
    raw, closed = exchange(port, [])
    status, error = status_and_error(raw)
    assert (status, error["type"], closed) == (408, "RequestTimeoutError", True)
    assert "REQUEST_READ_TIMEOUT_SECONDS" in error["message"]


def test_headers_trickled_past_the_deadline_get_408(port):
    pieces = [b"GET / HTTP/1.1\r\n"] + [b"X"] * int(DEADLINE * 20 + 40)
    raw, closed = exchange(port, pieces, gap=0.1)
    assert status_and_error(raw)[0] == 408 and closed


def test_headers_over_the_bound_get_431(port):
    request = b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (16 * MAX_HEADER_BYTES)
    raw, closed = exchange(port, [request + b"\r\n\r\n"])
    status, error = status_and_error(raw)
    assert (status, error["type"], closed) == (431, "RequestHeaderFieldsTooLargeError", True)


def test_ordinary_requests_and_keep_alive_are_untouched(port):
    request = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"
    with socket.create_connection(("127.0.0.1", port), timeout=WAIT) as sock:
        for _ in range(2):  # two requests on one connection
            sock.sendall(request)
            received = b""
            while not received.endswith(b"ok"):
                received += sock.recv(65536)
            assert received.startswith(b"HTTP/1.1 200")
        # headers just under the bound pass
        big = b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (MAX_HEADER_BYTES - 200)
        sock.sendall(big + b"\r\n\r\n")
        received = b""
        while not received.endswith(b"ok"):
            received += sock.recv(65536)
        assert received.startswith(b"HTTP/1.1 200")


def test_an_idle_connection_is_kept_for_the_keep_alive_timeout_then_closed(port):
    with socket.create_connection(("127.0.0.1", port), timeout=WAIT) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        received = b""
        while not received.endswith(b"ok"):
            received += sock.recv(65536)
        time.sleep(KEEP_ALIVE / 2)  # idle, but within the timeout: the next request is served
        sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        received = b""
        while not received.endswith(b"ok"):
            received += sock.recv(65536)
        assert received.startswith(b"HTTP/1.1 200")
        sock.settimeout(WAIT)
        assert sock.recv(65536) == b""  # then the server closes it, idle


def test_idle_connections_outlive_the_proxies_in_front_by_default():
    """nginx's upstream keepalive_timeout and cloud load balancers' idle timeouts are 60 s: the
    proxy must be the one to close an idle connection, or it sends a request on a connection
    this server is closing and answers 502 (uvicorn's own default is 5 s)."""
    assert uvicorn_config(ok_app, EdgeSettings()).timeout_keep_alive > 60


def test_a_kept_alive_connection_that_starts_a_request_and_stalls_gets_408(port):
    raw, closed = exchange(port, [b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", b"GET / HT"])
    first, _, rest = raw.partition(b"ok")
    assert first.startswith(b"HTTP/1.1 200")
    assert status_and_error(rest)[0] == 408 and closed


def test_a_large_body_sent_with_its_headers_is_not_counted_as_headers(port):
    body = b"x" * (4 * MAX_HEADER_BYTES)
    head = f"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n".encode()
    raw, _ = exchange(
        port, [head + body + b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"]
    )
    assert raw.startswith(b"HTTP/1.1 200")
    assert raw.count(b"HTTP/1.1 200") == 2
