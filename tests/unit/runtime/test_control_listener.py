"""The control port (LLMEP_CONTROL_PORT): probes and /metrics answered by a thread of their own,
on a real socket, while the event loop of this process is kept busy."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import pytest
from llmendpoints_runtime.control_listener import (
    MAX_HEAD_BYTES,
    ControlListener,
    ControlSurface,
    answer,
)
from llmendpoints_runtime.health import Health


def surface(health: Health, metrics: bytes = b"llmendpoints_queue_depth 3.0\n") -> ControlSurface:
    return ControlSurface(
        liveness=health.liveness,
        readiness=lambda strict: health.readiness(strict=strict),
        metrics=lambda: (metrics, "text/plain; version=0.0.4; charset=utf-8"),
    )


@pytest.mark.parametrize(
    ("state", "method", "target", "status"),
    [
        ("loading", "GET", "/ready", 204),  # SageMaker's and RunPod's reading
        ("loading", "GET", "/ready?strict=1", 503),  # the kubelet's
        ("loading", "GET", "/ping", 204),
        ("loading", "POST", "/ping", 204),
        ("loading", "GET", "/health", 200),
        ("ready", "GET", "/ready?strict=1", 200),
        ("ready", "GET", "/ready?strict=true", 200),
        ("ready", "GET", "/ping", 200),
        ("failed", "GET", "/ready", 503),
        ("failed", "GET", "/health", 503),
        ("draining", "GET", "/ready?strict=1", 503),
        ("ready", "GET", "/metrics", 200),
        ("ready", "GET", "/v1/models", 404),  # nothing else is served here
        ("ready", "POST", "/ready", 405),
        ("ready", "DELETE", "/metrics", 405),
    ],
)
def test_answers_follow_the_health_record(state, method, target, status):
    health = Health()
    if state in ("ready", "draining"):
        health.engine_ready()
    if state == "draining":
        health.start_draining()
    if state == "failed":
        health.engine_failed("the engine core died")
    result = answer(surface(health), method, target)
    assert result.status == status, result.body
    if status == 503:
        body = json.loads(result.body)
        assert body.get("reason") or body.get("status") == "initializing", body


def test_metrics_are_the_surfaces_text():
    result = answer(surface(Health(), b"x 1\n"), "GET", "/metrics")
    assert (result.body, result.content_type.split(";")[0]) == (b"x 1\n", "text/plain")


def request(port: int, raw: bytes, timeout: float = 10) -> tuple[int, dict[str, str], bytes]:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(raw)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    return int(lines[0].split(" ")[1]), headers, body


@pytest.fixture
def listener():
    health = Health()
    health.engine_ready()
    running = ControlListener(surface(health), "127.0.0.1", 0).start()
    try:
        yield running, health
    finally:
        running.close()


def get(path: str) -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: pod\r\n\r\n".encode()


def test_a_real_socket_gets_http_answers_and_the_connection_closes(listener):
    running, health = listener
    status, headers, body = request(running.port, get("/ready?strict=1"))
    assert (status, json.loads(body)) == (200, {"status": "ready"})
    assert headers["connection"] == "close" and headers["content-length"] == str(len(body))
    health.start_draining()
    status, _, body = request(running.port, get("/ready?strict=1"))
    assert status == 503 and json.loads(body)["status"] == "draining"
    status, headers, body = request(running.port, get("/metrics"))
    assert status == 200 and body == b"llmendpoints_queue_depth 3.0\n"
    assert headers["content-type"].startswith("text/plain")


def test_head_gets_the_headers_only(listener):
    running, _ = listener
    status, headers, body = request(running.port, b"HEAD /metrics HTTP/1.1\r\n\r\n")
    assert status == 200 and body == b"" and int(headers["content-length"]) > 0


def test_bad_and_huge_requests_are_refused_and_the_listener_keeps_serving(listener):
    running, _ = listener
    assert request(running.port, b"hello\r\n\r\n")[0] == 400
    huge = b"GET /health HTTP/1.1\r\nX: " + b"a" * (MAX_HEAD_BYTES + 10)
    assert request(running.port, huge)[0] == 431
    assert request(running.port, get("/health"))[0] == 200


def test_a_silent_connection_does_not_hold_the_others(listener):
    running, _ = listener
    silent = [socket.create_connection(("127.0.0.1", running.port)) for _ in range(4)]
    try:
        assert request(running.port, get("/health"))[0] == 200
    finally:
        for sock in silent:
            sock.close()


async def test_answers_while_this_processs_event_loop_is_blocked(listener):
    """The point of the listener: the loop is held (as a busy output handler holds it) and the
    probe is still answered -- by a client in another thread, as the kubelet is elsewhere."""
    running, _ = listener
    answered: list[int] = []

    def probe() -> None:
        answered.append(request(running.port, get("/ready?strict=1"))[0])

    thread = threading.Thread(target=probe)
    thread.start()
    held_until = time.monotonic() + 30
    while not answered and time.monotonic() < held_until:
        time.sleep(0.01)  # the event loop does not run: nothing awaits
    thread.join(10)
    assert answered == [200]
    await asyncio.sleep(0)
