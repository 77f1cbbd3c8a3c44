"""The control port (LLMEP_CONTROL_PORT): probes and /metrics answered by a process of their own
(control_listener.start, what the runtime runs) on a real socket, while this process's event
loop is kept busy and while clients misbehave: trickling, silent, more than it keeps open."""

from __future__ import annotations

import json
import os
import select
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from llmendpoints_runtime import control_listener
from llmendpoints_runtime.control_listener import (
    HEADER_DEADLINE_SECONDS,
    MAX_CONNECTIONS,
    MAX_HEAD_BYTES,
    ControlListener,
    ControlSurface,
    answer,
)
from llmendpoints_runtime.health import Health
from prober import SlowClients, kubelet_probes, probe_once


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


# -- the child process fed by the publisher ---------------------------------------------------


@pytest.fixture
def control_port():
    health = Health()
    metrics = {"text": b"llmendpoints_queue_depth 0.0\n"}
    published = ControlSurface(
        liveness=health.liveness,
        readiness=lambda strict: health.readiness(strict=strict),
        metrics=lambda: (metrics["text"], "text/plain"),
    )
    running = control_listener.start(published, "127.0.0.1", 0)
    try:
        yield running, health, metrics
    finally:
        running.close()


def wait_for(check, what: str, timeout: float = 30):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.02)
    raise AssertionError(f"not within {timeout} s: {what}")


def test_the_child_process_answers_what_the_api_process_publishes(control_port):
    running, health, metrics = control_port
    assert running.process.pid != os.getpid() and running.process.poll() is None
    status, headers, body = request(running.port, get("/ready?strict=1"))
    assert status == 503 and json.loads(body)["status"] == "initializing"
    # How old the published answer is, for whoever wants to know (a few publish intervals).
    assert 0 <= float(headers["x-llmep-answer-age-ms"]) < 30_000
    assert request(running.port, get("/ready"))[0] == 204
    health.engine_ready()
    metrics["text"] = b"llmendpoints_queue_depth 22.0\n"
    wait_for(lambda: request(running.port, get("/ready?strict=1"))[0] == 200, "ready published")
    wait_for(
        lambda: request(running.port, get("/metrics"))[2] == b"llmendpoints_queue_depth 22.0\n",
        "metrics published",
    )
    health.start_draining()
    wait_for(lambda: request(running.port, get("/ping"))[0] == 503, "draining published")


def test_answers_while_a_thread_of_this_process_holds_the_gil(control_port):
    """What the thread listener could not do: the API process's event loop keeps the GIL under
    load; the child has its own interpreter, so its answers do not wait for it."""
    running, health, _ = control_port
    health.engine_ready()
    stop = threading.Event()

    def spin() -> None:  # a CPU-bound Python thread: it holds the GIL but for switch intervals
        while not stop.is_set():
            sum(range(1000))

    spinner = threading.Thread(target=spin)
    spinner.start()
    try:
        wait_for(lambda: request(running.port, get("/ready?strict=1"))[0] == 200, "ready")
        answers = [request(running.port, get(path))[0] for path in ("/health", "/metrics") * 5]
    finally:
        stop.set()
        spinner.join()
    assert answers == [200] * 10


def test_stale_answers_turn_into_503_saying_the_runtime_is_stuck(tmp_path):
    health = Health()
    health.engine_ready()
    surface = ControlSurface(
        health.liveness, lambda s: health.readiness(strict=s), lambda: (b"", "")
    )
    control_listener.ControlPublisher(surface, tmp_path).publish(metrics=True)
    now = time.time()
    fresh = control_listener.file_surface(tmp_path, clock=lambda: now + 1)
    assert fresh.liveness().status == 200 and fresh.readiness(True).status == 200
    later = now + control_listener.STALE_AFTER_SECONDS + 1
    stale = control_listener.file_surface(tmp_path, clock=lambda: later)
    for probe in (stale.liveness(), stale.readiness(True), stale.readiness(False)):
        assert probe.status == 503 and "stuck" in probe.body["reason"]


def test_a_port_in_use_is_an_error_naming_it():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        surface = ControlSurface(
            Health().liveness, lambda s: Health().readiness(strict=s), lambda: (b"", "")
        )
        before = set(Path("/dev/shm").glob("llmep-control-*"))
        with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{port}"):
            control_listener.start(surface, "127.0.0.1", port)
        assert set(Path("/dev/shm").glob("llmep-control-*")) == before  # nothing left behind


def test_the_child_dies_with_its_parent():
    script = (
        "import os, sys; from llmendpoints_runtime import control_listener as c; "
        "from llmendpoints_runtime.health import Health; h = Health(); "
        "s = c.ControlSurface(h.liveness, lambda x: h.readiness(strict=x), lambda: (b'', '')); "
        "p = c.start(s, '127.0.0.1', 0); print(p.process.pid, p.directory, flush=True); "
        "os._exit(0)"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    child_pid, directory = done.stdout.split()
    child = int(child_pid)

    def gone() -> bool:
        try:
            state = Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return True
        return state in ("Z", "X")

    wait_for(gone, "the control port's process to end with its parent")
    assert not Path(directory).exists()  # nothing left behind in /dev/shm


# -- clients that misbehave, against the child process -------------------------------------------


def test_sixteen_trickling_connections_do_not_stop_the_kubelets_probe(control_port):
    """16 connections sending a header byte every 4 s, reopened as soon as they are closed.
    Before: they held every connection the port served (each read waited 5 s for the next
    byte) and /health went unanswered 20 times out of 20 -- a kubelet would restart a healthy
    pod. Now each must finish its head within HEADER_DEADLINE_SECONDS of its accept."""
    running, _, _ = control_port
    with SlowClients(running.port, 16, every=4.0) as attacker:
        probes = kubelet_probes(running.port)
        # each was cut at its deadline, not served
        wait_for(lambda: attacker.closed_by_server >= 16, "the slow clients cut", timeout=60)
    assert [p.get("status") for p in probes] == [200] * 20, probes


def test_more_silent_connections_than_it_keeps_do_not_stop_the_probe(control_port):
    """Twice MAX_CONNECTIONS connections that send nothing, each reopened when closed:
    a new connection closes the oldest still sending its head, and a probe, whose request comes
    with its connection, is read before newcomers can push it out."""
    running, _, _ = control_port
    with SlowClients(running.port, 2 * MAX_CONNECTIONS, every=None):
        probes = kubelet_probes(running.port)
    assert [p.get("status") for p in probes] == [200] * 20, probes


def test_headers_that_trickle_past_the_deadline_get_408_and_a_close(listener):
    """A byte every 0.3 s forever: never idle long, yet closed with 408 at the deadline (the
    old per-read timeout let it live as long as it kept sending)."""
    running, _ = listener
    with socket.create_connection(("127.0.0.1", running.port), timeout=30) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nX-Slow: ")
        answer = b""
        for _ in range(int(4 * HEADER_DEADLINE_SECONDS / 0.3) + 20):
            readable, _, _ = select.select([sock], [], [], 0.3)
            if readable:
                answer = sock.recv(65536)
                break
            sock.sendall(b"x")
        try:
            rest = sock.recv(65536)  # then the server closes it
        except ConnectionResetError:  # (a reset: it closed with our last bytes unread)
            rest = b""
    assert answer.startswith(b"HTTP/1.1 408 "), answer
    assert rest == b""
    assert request(running.port, get("/health"))[0] == 200


def test_it_listens_on_the_address_given_only():
    """The runtime gives it LLMEP_CONTROL_HOST (the operator: the pod's IP). 127.0.0.2 stands
    for the pod's IP: answered there, refused on the pod's other addresses."""
    health = Health()
    health.engine_ready()
    running = control_listener.start(surface(health), "127.0.0.2", 0)
    try:
        assert probe_once("127.0.0.2", running.port, "/health", timeout=10)["status"] == 200
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", running.port), timeout=10).close()
    finally:
        running.close()
