"""A prober in a process of its own, as the kubelet and Prometheus are: it asks the given paths
in turn, each on a fresh connection, until its stdin closes, then writes what it saw as JSON.

    python tests/runtime/prober.py --port 8001 --paths /health,/ready?strict=1,/metrics \\
        --interval 0.05 --out probes.json [--nice -10]

Each record: wall time sent, path, connect and total milliseconds, status, body (JSON bodies
parsed; for /metrics the autoscaling gauges only), or the error. The file also holds the time
this process spent runnable but waiting for a CPU (its schedstat), so a reader can tell a slow
server from a prober that was not running. Shared by tests/runtime/test_runtime_signals.py and
bench/probes_under_load.py. As a module it also gives ``SlowClients`` (connections that trickle
a request head, or send nothing, reopened as soon as they are closed) and ``kubelet_probes``,
for the control port's tests and bench/abuse.py.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import selectors
import socket
import sys
import threading
import time
from pathlib import Path

GAUGES = (
    "llmendpoints_queue_depth",
    "llmendpoints_requests_in_flight",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
)


def gauges(text: str) -> dict[str, float]:
    values = dict.fromkeys(GAUGES, 0.0)
    for line in text.splitlines():
        match = re.match(r"^([a-z_:]+)(?:\{[^}]*\})? ([0-9.eE+-]+)$", line)
        if match and match.group(1) in values:
            values[match.group(1)] += float(match.group(2))
    return values


def probe_once(host: str, port: int, path: str, timeout: float) -> dict:
    began = time.monotonic()
    record: dict = {"t": time.time(), "path": path}
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            record["connect_ms"] = (time.monotonic() - began) * 1000
            sock.settimeout(max(timeout - (time.monotonic() - began), 0.01))
            sock.sendall(
                f"GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode()
            )
            chunks = []
            while chunk := sock.recv(65536):
                chunks.append(chunk)
        data = b"".join(chunks)
        record["total_ms"] = (time.monotonic() - began) * 1000
        head, _, body = data.partition(b"\r\n\r\n")
        record["status"] = int(head.split(b" ", 2)[1])
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.decode("latin-1").partition(":")
            if name.strip().lower() == "x-llmep-answer-age-ms":
                record["age_ms"] = float(value)  # how old the control port's answer was
        text = body.decode(errors="replace")
        if path.startswith("/metrics"):
            record["gauges"] = gauges(text)
        elif text:
            with contextlib.suppress(ValueError):
                record["body"] = json.loads(text)
    except (OSError, ValueError, IndexError) as exc:
        record["total_ms"] = (time.monotonic() - began) * 1000
        record["error"] = f"{type(exc).__name__}: {exc}"
    return record


class SlowClients:
    """``count`` connections kept open against the port, each reopened the moment the server
    closes it; each sends the start of a request line and then ``every`` seconds one more header
    byte (None: nothing ever). One thread drives them all (a selector), so hundreds cost the
    machine little besides the reconnections."""

    def __init__(self, port: int, count: int, every: float | None) -> None:
        self.port, self.count, self.every = port, count, every
        self.stop = threading.Event()
        self.closed_by_server = 0
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> SlowClients:
        self._thread.start()
        time.sleep(1.0)  # all of them connected
        return self

    def __exit__(self, *_exc) -> None:
        self.stop.set()
        self._thread.join(30)

    def _open(self, selector: selectors.BaseSelector) -> None:
        try:
            sock = socket.create_connection(("127.0.0.1", self.port), timeout=10)
            if self.every is not None:
                sock.sendall(b"GET /health HTTP/1.1\r\nX-Slow: ")
        except OSError:
            time.sleep(0.01)
            return
        sock.setblocking(False)
        selector.register(sock, selectors.EVENT_READ)

    def _run(self) -> None:
        selector = selectors.DefaultSelector()
        next_byte = time.monotonic() + (self.every or 0)
        try:
            while not self.stop.is_set():
                while len(selector.get_map()) < self.count and not self.stop.is_set():
                    self._open(selector)
                for key, _ in selector.select(0.2):  # the server answered (408) or closed it
                    selector.unregister(key.fileobj)
                    key.fileobj.close()
                    self.closed_by_server += 1
                if self.every is not None and time.monotonic() >= next_byte:
                    next_byte += self.every
                    for key in list(selector.get_map().values()):
                        with contextlib.suppress(OSError):
                            key.fileobj.send(b"x")
        finally:
            for key in list(selector.get_map().values()):
                key.fileobj.close()
            selector.close()


def kubelet_probes(port: int, count: int = 20) -> list[dict]:
    """``count`` probes of /health a kubelet would send (a fresh connection each, the request
    written as it connects), each allowed 10 s: twice the pod spec's timeoutSeconds."""
    probes = []
    for _ in range(count):
        probes.append(probe_once("127.0.0.1", port, "/health", timeout=10))
        time.sleep(0.25)
    return probes


def run_delay_ms() -> float:
    """Milliseconds this thread has been runnable but not running (schedstat field 2)."""
    try:
        return int(Path("/proc/thread-self/schedstat").read_text().split()[1]) / 1e6
    except (OSError, IndexError, ValueError):
        return 0.0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--paths", required=True)
    parser.add_argument("--interval", type=float, default=0.05)
    parser.add_argument("--timeout", type=float, default=10.0)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--nice",
        type=int,
        default=None,
        help="set this process's autogroup nice (needs a session of its own and root to lower)",
    )
    args = parser.parse_args()
    if args.nice is not None:
        Path("/proc/self/autogroup").write_text(str(args.nice))
    paths = args.paths.split(",")
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    records: list[dict] = []
    waited_before = run_delay_ms()
    i = 0
    while not stop.is_set():
        began = time.monotonic()
        records.append(probe_once(args.host, args.port, paths[i % len(paths)], args.timeout))
        i += 1
        stop.wait(max(0.0, args.interval - (time.monotonic() - began)))
    args.out.write_text(
        json.dumps({"records": records, "prober_run_delay_ms": run_delay_ms() - waited_before})
    )


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
