"""Probes and /metrics on a port of their own, answered by a process of its own.

The main port's /health, /ready, /ping and /metrics are answered by the event loop, which also
carries every request, stream and engine output. A loaded pod answered them late, and the
kubelet restarts a pod it cannot probe while the autoscaler reads it as silent. A thread of the
API process does no better (measured, bench/RESULTS.md "Probes under load"): the event loop holds
the GIL nearly all the time under load, and each of the handful of blocking calls a thread makes
to answer (accept, recv, send) waits for it -- 15-26 ms per probe with one busy thread on an idle
machine, seconds on a starved one, worse than the loop itself.

So the answers come from a small child process with no share in the API process's GIL
(``python -m llmendpoints_runtime.control_listener``, standard library only). The API process
publishes what it would answer -- the three probe answers and the /metrics text -- into files
in a private directory (on tmpfs, /dev/shm, where there is one) every
``PUBLISH_INTERVAL_SECONDS``, from its event loop (``ControlPublisher.run``; a publishing thread,
measured, got the GIL so rarely under load that its answers were seconds old). A late
publication only makes the answers older, never late, and each answer says its age
(``x-llmep-answer-age-ms``). The child serves each request from the newest files. If they stop
being refreshed for ``STALE_AFTER_SECONDS`` -- the API process is stuck -- the child answers
/health and /ready 503 saying so, so liveness still means "this process makes progress". The
child dies with its parent (PR_SET_PDEATHSIG, and it checks its parent between connections).

``LLMEP_CONTROL_PORT`` turns it on (the operator sets it, and points the kubelet's probes and
the autoscaler's scrape at it). The main port keeps answering the same paths (SageMaker and
RunPod load balancers call /ping there).

Deliberately small: one request per connection (``Connection: close``), GET (and POST for
/ping), no body read, headers bounded in size and time, at most MAX_CONNECTIONS answered at once
(the rest are closed unanswered, as a full backlog would).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

from llmendpoints_runtime.health import Probe

logger = logging.getLogger("llmendpoints.control")

MAX_HEAD_BYTES = 8 * 1024
READ_TIMEOUT_SECONDS = 5.0
MAX_CONNECTIONS = 16
PUBLISH_INTERVAL_SECONDS = 0.1
METRICS_EVERY = 5  # publications: /metrics text is rendered every 0.5 s
STALE_AFTER_SECONDS = 30.0
_START_TIMEOUT_SECONDS = 30.0
_TRUE = {"1", "true", "yes", "on"}
_PROBES_FILE, _METRICS_FILE = "probes.json", "metrics"
METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


@dataclass(frozen=True)
class Answer:
    status: int
    body: bytes
    content_type: str = "application/json"
    age_seconds: float | None = None  # how old the published answer is (x-llmep-answer-age-ms)


@dataclass(frozen=True)
class ControlSurface:
    """Where the answers come from."""

    liveness: Callable[[], Probe]
    readiness: Callable[[bool], Probe]  # strict?
    metrics: Callable[[], tuple[bytes, str]]  # (body, content type)
    # Age in seconds of what the probes (False) or /metrics (True) answer; None: live answers.
    age: Callable[[bool], float] | None = None


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
    parts = urlsplit(target)
    path = parts.path
    if path not in ("/health", "/ready", "/ping", "/metrics"):
        return _error(404, f"{path} is not served on the control port")
    allowed = ("GET", "POST") if path == "/ping" else ("GET",)
    if method not in (*allowed, "HEAD"):
        return _error(405, f"{method} is not allowed on {path}")
    age = surface.age(path == "/metrics") if surface.age is not None else None
    if path == "/metrics":
        body, content_type = surface.metrics()
        return Answer(200, body, content_type, age)
    if path == "/health":
        probe = surface.liveness()
    else:
        strict = path == "/ready" and any(
            v.lower() in _TRUE for v in parse_qs(parts.query).get("strict", [])
        )
        probe = surface.readiness(strict)
    if probe.status == 204:
        return Answer(204, b"", age_seconds=age)
    return Answer(probe.status, json.dumps(probe.body).encode(), age_seconds=age)


def _error(status: int, message: str) -> Answer:
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
    if result.age_seconds is not None:
        lines.append(f"x-llmep-answer-age-ms: {max(result.age_seconds, 0) * 1000:.0f}")
    if result.status != 204:
        lines += [f"content-type: {result.content_type}", f"content-length: {len(result.body)}"]
    head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
    return head if head_only or result.status == 204 else head + result.body


# -- the listener (in the child process; also usable in-process by tests) -------------------------


class ControlListener:
    """A listening socket and an accept thread; each connection is answered in a short-lived
    thread (at most MAX_CONNECTIONS at once), so one slow client cannot hold the others."""

    def __init__(self, surface: ControlSurface, host: str, port: int) -> None:
        self.surface = surface
        self._sock = socket.create_server((host, port), family=_family(host), backlog=128)
        self._sock.settimeout(1.0)  # the accept loop looks up now and then (parent_alive)
        self.port = self._sock.getsockname()[1]
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._thread = threading.Thread(target=self.serve, name="llmep-control", daemon=True)
        self._closed = False

    def start(self) -> ControlListener:
        self._thread.start()
        return self

    def close(self) -> None:
        self._closed = True
        self._sock.close()

    def serve(self, keep_going: Callable[[], bool] = lambda: True) -> None:
        while not self._closed and keep_going():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return  # closed
            if not self._slots.acquire(blocking=False):
                conn.close()  # as a full backlog would; probes retry at their period
                continue
            threading.Thread(target=self._serve_one, args=(conn,), daemon=True).start()

    def _serve_one(self, conn: socket.socket) -> None:
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


# -- what the API process publishes, and how the child reads it ---------------------------------


def write_atomically(path: Path, data: bytes) -> None:
    staged = path.with_name(f".{path.name}.{threading.get_native_id()}")
    staged.write_bytes(data)
    os.replace(staged, path)


def probes_snapshot(surface: ControlSurface, now: float) -> bytes:
    def one(probe: Probe) -> list:
        return [probe.status, probe.body]

    return json.dumps(
        {
            "t": now,
            "health": one(surface.liveness()),
            "ready": one(surface.readiness(False)),
            "ready_strict": one(surface.readiness(True)),
        }
    ).encode()


def file_surface(directory: Path, clock: Callable[[], float] = time.time) -> ControlSurface:
    """The child's view: the newest published answers, 503 once they are stale."""

    def read() -> dict:
        return json.loads((directory / _PROBES_FILE).read_bytes())

    def checked(key: str) -> Probe:
        snapshot = read()
        age = clock() - snapshot["t"]
        if age > STALE_AFTER_SECONDS:
            status = "unhealthy" if key == "health" else "failed"
            reason = f"the runtime has not refreshed its health for {age:.0f} s: it is stuck"
            return Probe(503, {"status": status, "reason": reason})
        status, body = snapshot[key]
        return Probe(status, body)

    def age(metrics: bool) -> float:
        if metrics:
            return clock() - (directory / _METRICS_FILE).stat().st_mtime
        return clock() - read()["t"]

    return ControlSurface(
        liveness=lambda: checked("health"),
        readiness=lambda strict: checked("ready_strict" if strict else "ready"),
        metrics=lambda: ((directory / _METRICS_FILE).read_bytes(), METRICS_CONTENT_TYPE),
        age=age,
    )


class ControlPublisher:
    """The API process's side: publishes ``surface``'s answers into ``directory``.

    In the runtime it runs on the event loop (``run``): measured under load, a publishing
    thread got the GIL so rarely that the answers it published were seconds old, while the
    loop itself stays responsive (it answers the main port's probes in milliseconds). The
    answers never wait for the loop; their freshness does, and each answer says its age
    (``x-llmep-answer-age-ms``). ``start_thread`` is for callers without a loop."""

    def __init__(self, surface: ControlSurface, directory: Path) -> None:
        self.surface = surface
        self.directory = directory
        self._stop = threading.Event()
        self._count = 0

    def publish(self, *, metrics: bool) -> None:
        write_atomically(self.directory / _PROBES_FILE, probes_snapshot(self.surface, time.time()))
        if metrics:
            write_atomically(self.directory / _METRICS_FILE, self.surface.metrics()[0])

    def tick(self) -> None:
        """One publication: the probe answers, and /metrics every METRICS_EVERY ticks."""
        self._count += 1
        try:
            self.publish(metrics=self._count % METRICS_EVERY == 0)
        except Exception:  # a failed publication must not end the publishing
            logger.exception("control port: publishing the answers failed")

    async def run(self) -> None:
        """Publish every PUBLISH_INTERVAL_SECONDS on the running event loop, until cancelled."""
        import asyncio  # the API process's side: the child (this module's main) never loads it

        while not self._stop.is_set():
            self.tick()
            await asyncio.sleep(PUBLISH_INTERVAL_SECONDS)

    def start_thread(self) -> ControlPublisher:
        def run() -> None:
            while not self._stop.wait(PUBLISH_INTERVAL_SECONDS):
                self.tick()

        threading.Thread(target=run, name="llmep-control-pub", daemon=True).start()
        return self

    def stop(self) -> None:
        self._stop.set()


@dataclass
class ControlPort:
    """The running control port: the child process, the publisher, the port it listens on."""

    port: int
    process: subprocess.Popen
    publisher: ControlPublisher
    directory: Path

    def close(self) -> None:
        self.publisher.stop()
        shutil.rmtree(self.directory, ignore_errors=True)
        # The child may be gone already (engine shutdown stops every descendant, and reaps it).
        with contextlib.suppress(OSError, subprocess.TimeoutExpired):
            self.process.kill()
            self.process.wait(5)


def start(surface: ControlSurface, host: str, port: int, *, thread: bool = True) -> ControlPort:
    """Publish ``surface``'s answers and start the child process serving them on host:port;
    from then on a thread publishes them, or (``thread=False``) the caller runs
    ``port.publisher.run()`` on its event loop. OSError when the child cannot listen there (its
    message says why)."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    directory = Path(tempfile.mkdtemp(prefix="llmep-control-", dir=base))
    publisher = ControlPublisher(surface, directory)
    publisher.publish(metrics=True)
    if thread:
        publisher.start_thread()
    process = subprocess.Popen(
        [
            sys.executable, "-m", "llmendpoints_runtime.control_listener",
            "--host", host, "--port", str(port), "--state", str(directory),
            "--parent", str(os.getpid()),
        ],
        stdout=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
    )  # fmt: skip
    line = _first_line(process, _START_TIMEOUT_SECONDS)
    if not line.startswith("listening "):
        publisher.stop()
        with contextlib.suppress(OSError):
            process.kill()
        shutil.rmtree(directory, ignore_errors=True)
        raise OSError(line.strip() or f"the control port's process exited ({process.poll()})")
    return ControlPort(int(line.split()[1]), process, publisher, directory)


def _first_line(process: subprocess.Popen, timeout: float) -> str:
    result: list[str] = []
    reader = threading.Thread(target=lambda: result.append(process.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    return result[0] if result else ""


# -- the child process ----------------------------------------------------------------------------


def _die_with_parent(state: Path) -> None:
    """Linux: SIGTERM when the parent dies (even by SIGKILL); on SIGTERM the published files go
    too, so a killed runtime leaves nothing in /dev/shm."""
    import ctypes

    def end(*_: object) -> None:
        shutil.rmtree(state, ignore_errors=True)
        os._exit(0)

    signal.signal(signal.SIGTERM, end)
    with contextlib.suppress(Exception):
        ctypes.CDLL(None).prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m llmendpoints_runtime.control_listener")
    parser.add_argument("--host", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--state", type=Path, required=True)
    parser.add_argument("--parent", type=int, required=True)
    args = parser.parse_args(argv)
    _die_with_parent(args.state)
    if os.getppid() != args.parent:
        shutil.rmtree(args.state, ignore_errors=True)
        return 1  # the parent is already gone
    try:
        listener = ControlListener(file_surface(args.state), args.host, args.port)
    except OSError as exc:
        print(f"cannot listen on {args.host}:{args.port}: {exc}", flush=True)
        return 1
    print(f"listening {listener.port}", flush=True)
    listener.serve(keep_going=lambda: os.getppid() == args.parent)
    shutil.rmtree(args.state, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
