"""Probes and /metrics on a port of their own, answered by a thread of their own.

The main port's /health, /ready, /ping and /metrics are answered by the event loop, which also
carries every request, stream and engine output. Under load it answered them seconds late
(bench/RESULTS.md, "Probes under load": a pod with MAX_NUM_SEQS=2 and 24 requests went silent
for the whole run): the kubelet restarts a loaded pod, and the autoscaler reads the pod that
most needs replicas as silent. This listener owns its socket and its threads and needs nothing
from the loop: each answer is read from the same records the main port's answers are
(``Health``, ``RuntimeMetrics``, vLLM's Prometheus registry), which other threads may read.

``LLMEP_CONTROL_PORT`` turns it on (the operator sets it, and points the kubelet's probes and
the autoscaler's scrape at it). The main port keeps answering the same paths (SageMaker and
RunPod load balancers call /ping there).

Deliberately small: HTTP/1.0-style, one request per connection (``Connection: close``), GET
(and POST for /ping), no body read, headers bounded in size and time, a bounded number of
connections answered at once (the rest are closed unanswered, as a full backlog would).
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import parse_qs, urlsplit

from llmendpoints_runtime.health import Probe

logger = logging.getLogger("llmendpoints.control")

MAX_HEAD_BYTES = 8 * 1024
READ_TIMEOUT_SECONDS = 5.0
MAX_CONNECTIONS = 16
_TRUE = {"1", "true", "yes", "on"}


@dataclass(frozen=True)
class Answer:
    status: int
    body: bytes
    content_type: str = "application/json"


@dataclass(frozen=True)
class ControlSurface:
    """Where the answers come from (each callable is safe to call from any thread)."""

    liveness: Callable[[], Probe]
    readiness: Callable[[bool], Probe]  # strict?
    metrics: Callable[[], tuple[bytes, str]]  # (body, content type)


_PHRASES = {
    200: "OK",
    204: "No Content",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    408: "Request Timeout",
    431: "Request Header Fields Too Large",
    500: "Internal Server Error",
    503: "Service Unavailable",
}


def answer(surface: ControlSurface, method: str, target: str) -> Answer:
    """What a request for ``method target`` gets (pure apart from the surface's reads)."""
    import json

    parts = urlsplit(target)
    path = parts.path
    if path not in ("/health", "/ready", "/ping", "/metrics"):
        return _error(404, f"{path} is not served on the control port")
    allowed = ("GET", "POST") if path == "/ping" else ("GET",)
    if method not in (*allowed, "HEAD"):
        return _error(405, f"{method} is not allowed on {path}")
    if path == "/metrics":
        body, content_type = surface.metrics()
        return Answer(200, body, content_type)
    if path == "/health":
        probe = surface.liveness()
    else:
        strict = path == "/ready" and any(
            v.lower() in _TRUE for v in parse_qs(parts.query).get("strict", [])
        )
        probe = surface.readiness(strict)
    if probe.status == 204:
        return Answer(204, b"")
    return Answer(probe.status, json.dumps(probe.body).encode())


def _error(status: int, message: str) -> Answer:
    import json

    return Answer(status, json.dumps({"error": {"message": message, "code": status}}).encode())


def _head(data: bytes) -> tuple[str, str] | None:
    """(method, target) from a complete request head; None when it is not one."""
    line = data.split(b"\r\n", 1)[0].decode("latin-1")
    fields = line.split(" ")
    if len(fields) != 3 or not fields[2].startswith("HTTP/"):
        return None
    return fields[0], fields[1]


def _response(result: Answer, *, head_only: bool = False) -> bytes:
    phrase = _PHRASES.get(result.status, "")
    lines = [f"HTTP/1.1 {result.status} {phrase}", "connection: close"]
    if result.status != 204:
        lines += [f"content-type: {result.content_type}", f"content-length: {len(result.body)}"]
    head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
    return head if head_only or result.status == 204 else head + result.body


class ControlListener:
    """A listening socket and an accept thread; each connection is answered in a short-lived
    thread (at most MAX_CONNECTIONS at once), so one slow client cannot hold the others."""

    def __init__(self, surface: ControlSurface, host: str, port: int) -> None:
        self.surface = surface
        self._sock = socket.create_server(
            (host, port), family=_family(host), backlog=128, reuse_port=False
        )
        self.port = self._sock.getsockname()[1]
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._thread = threading.Thread(target=self._accept, name="llmep-control", daemon=True)

    def start(self) -> ControlListener:
        self._thread.start()
        return self

    def close(self) -> None:
        self._sock.close()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            if not self._slots.acquire(blocking=False):
                conn.close()  # as a full backlog would; probes retry at their period
                continue
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            with conn:
                conn.settimeout(READ_TIMEOUT_SECONDS)
                conn.sendall(self._handle(conn))
        except OSError:
            pass  # the client left, or sent nothing in time
        except Exception:
            logger.exception("control port: unexpected error")
        finally:
            self._slots.release()

    def _handle(self, conn: socket.socket) -> bytes:
        data = b""
        while b"\r\n\r\n" not in data:
            try:
                chunk = conn.recv(4096)
            except TimeoutError:
                return _response(_error(408, "request headers not received in time"))
            if not chunk:
                raise OSError("closed before the headers ended")
            data += chunk
            if len(data) > MAX_HEAD_BYTES and b"\r\n\r\n" not in data:
                return _response(_error(431, f"request headers above {MAX_HEAD_BYTES} bytes"))
        head = _head(data)
        if head is None:
            return _response(_error(400, "not an HTTP request"))
        method, target = head
        try:
            result = answer(self.surface, method, target)
        except Exception:
            logger.exception("control port: %s %s failed", method, target)
            result = _error(500, "internal error; see the server log")
        return _response(result, head_only=method == "HEAD")


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET
