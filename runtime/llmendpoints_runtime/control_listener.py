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
/ping), no body read; the head bounded in size and in time from the connection's accept, at most
MAX_CONNECTIONS open with the oldest closed for a new one (``ControlListener``). It listens where
``LLMEP_CONTROL_HOST`` says: the operator gives it the pod's IP (downward API), the address the
kubelet probes and the autoscaler scrapes, so nothing else in the pod's network namespace shares
it with the world.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import selectors
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
# A request head must be whole this long after its connection was accepted. A kubelet's, or a
# Prometheus's, arrives with the connection -- unless its sender waits for a CPU, which on a
# starved machine takes seconds (tests/README.md): the kubelet's own probe timeout, 5 s in the
# operator's pods, is as long as waiting helps. The answer must be written within the second.
HEADER_DEADLINE_SECONDS = 5.0
ANSWER_DEADLINE_SECONDS = 10.0
# Connections open at once; one more closes the oldest still sending its head. Each costs a
# socket and a few hundred bytes; with the head deadline, pushing a probe out takes this many
# connections opened within 2 s.
MAX_CONNECTIONS = 256
ACCEPTS_PER_PASS = MAX_CONNECTIONS // 2
LOOK_SECONDS = 0.5  # the loop wakes at least this often (close(), the parent's death)
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


@dataclass(eq=False)
class _Connection:
    sock: socket.socket
    deadline: float  # reading: the whole head by then; writing: the whole answer
    head: bytes = b""
    out: memoryview | None = None  # the answer being written (None: still reading the head)


class ControlListener:
    """A listening socket served by one thread with a selector: every connection is
    non-blocking, so no client holds another, and each has deadlines.

    - The request head must be complete HEADER_DEADLINE_SECONDS after the connection was
      accepted, however it trickles in (408, closed); it must end within MAX_HEAD_BYTES (431).
    - At most MAX_CONNECTIONS are open; one more closes the oldest still sending its head. A
      kubelet, or a Prometheus, sends its request as it connects; what open connections sent
      is read before new ones are accepted, so clients that connect and then send nothing, or
      a byte now and then, cannot keep it out: before these bounds 16 connections sending a
      byte every 4 s took every slot, and /health went unanswered 20 times out of 20.
    """

    def __init__(self, surface: ControlSurface, host: str, port: int) -> None:
        self.surface = surface
        # A deep backlog: under a flood a probe's connection waits its turn in it rather than
        # having its SYN dropped (and retried a second later).
        self._sock = socket.create_server((host, port), family=_family(host), backlog=1024)
        self._sock.setblocking(False)
        self.port = self._sock.getsockname()[1]
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._sock, selectors.EVENT_READ, None)
        self._open: dict[socket.socket, _Connection] = {}  # in the order they were accepted
        self._thread = threading.Thread(target=self.serve, name="llmep-control", daemon=True)
        self._closed = False

    def start(self) -> ControlListener:
        self._thread.start()
        return self

    def close(self) -> None:
        self._closed = True
        self._sock.close()

    @property
    def open_connections(self) -> int:
        return len(self._open)

    def serve(self, keep_going: Callable[[], bool] = lambda: True) -> None:
        """Until ``close`` or ``keep_going()`` is false (looked at least every LOOK_SECONDS)."""
        try:
            while not self._closed and keep_going():
                try:
                    events = self._selector.select(self._wait(time.monotonic()))
                except (OSError, ValueError):
                    return  # closed under us
                accept = False
                for key, mask in events:  # the connections open first, then new ones:
                    if key.data is None:  # a probe that has sent its request is answered
                        accept = True  # before newcomers can push it out
                    elif key.data.sock not in self._open:
                        continue  # dropped meanwhile
                    elif mask & selectors.EVENT_READ:
                        self._read(key.data)
                    else:
                        self._write(key.data)
                if accept:
                    self._accept()
                self._expire(time.monotonic())
        finally:
            for conn in list(self._open.values()):
                self._drop(conn)
            self._selector.close()

    def _wait(self, now: float) -> float:
        soonest = min((c.deadline for c in self._open.values()), default=now + LOOK_SECONDS)
        return min(LOOK_SECONDS, max(0.0, soonest - now))

    def _accept(self) -> None:
        # At most half the cap a pass: a flood waiting in the backlog cannot push out, in the
        # same pass, a connection accepted before it (the rest wait for the next pass).
        for _ in range(ACCEPTS_PER_PASS):
            try:
                sock, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return  # closed, or out of descriptors: the next pass tries again
            if len(self._open) >= MAX_CONNECTIONS:
                self._drop(self._oldest())
            sock.setblocking(False)
            conn = _Connection(sock, time.monotonic() + HEADER_DEADLINE_SECONDS)
            self._open[sock] = conn
            self._selector.register(sock, selectors.EVENT_READ, conn)
            # A probe's request is usually in by now: answered before anything else happens.
            self._read(conn)

    def _oldest(self) -> _Connection:
        """Who goes for a newcomer: the oldest still waiting for its head (the one that has
        had longest to send it), else the oldest of all."""
        waiting = (c for c in self._open.values() if c.out is None)
        return next(waiting, None) or next(iter(self._open.values()))

    def _read(self, conn: _Connection) -> None:
        try:
            chunk = conn.sock.recv(4096)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            chunk = b""
        if not chunk:
            self._drop(conn)  # closed before the head ended
            return
        conn.head += chunk
        if b"\r\n\r\n" in conn.head:
            self._respond(conn, self._answer(conn.head))
        elif len(conn.head) > MAX_HEAD_BYTES:
            self._respond(
                conn, _response(_error(431, f"request headers above {MAX_HEAD_BYTES} bytes"))
            )

    def _answer(self, data: bytes) -> bytes:
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

    def _respond(self, conn: _Connection, payload: bytes) -> None:
        conn.out = memoryview(payload)
        conn.deadline = time.monotonic() + ANSWER_DEADLINE_SECONDS
        self._selector.modify(conn.sock, selectors.EVENT_WRITE, conn)
        self._write(conn)  # usually all of it, at once

    def _write(self, conn: _Connection) -> None:
        assert conn.out is not None
        try:
            sent = conn.sock.send(conn.out)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._drop(conn)
            return
        conn.out = conn.out[sent:]
        if not conn.out:
            self._drop(conn)  # one request per connection

    def _expire(self, now: float) -> None:
        for conn in [c for c in self._open.values() if c.deadline <= now]:
            if conn.out is None:  # the head did not arrive in time: say so, if it can be said
                late = _error(
                    408, f"request headers not received within {HEADER_DEADLINE_SECONDS:g} s"
                )
                with contextlib.suppress(OSError):
                    conn.sock.send(_response(late))
            self._drop(conn)

    def _drop(self, conn: _Connection) -> None:
        if self._open.pop(conn.sock, None) is None:
            return
        with contextlib.suppress(KeyError, ValueError, OSError):
            self._selector.unregister(conn.sock)
        conn.sock.close()


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
