"""Abuse: what one bad client costs a runtime (issue 16's measurements).

    .venv/bin/python bench/abuse.py front-door        # ~2 minutes on 2 cores

Sections (subcommands; each starts its own runtime on the demo model, API keys on):

front-door -- the HTTP front door, all keyless:
  - memory: the runtime's RSS under 150 connections that each declare and send a 10 MiB body
    (target: < 50 MiB growth; before the fix the body was read and parsed before the key was
    checked: 647 -> 2,154 MiB);
  - probe latency: /ready p99 while 150 keyless clients keep sending 10 MiB bodies (target:
    < 50 ms), next to the same probe on the idle server;
  - slow headers: how long a connection that sends nothing, or one header byte a second, is
    held, and what a 1 MiB header gets.

Results: a Markdown section on stdout (for bench/RESULTS.md) and JSON in bench/out/abuse_*.json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import multiprocessing
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
# The same launcher as the runtime tests: a clean environment, whatever the caller's shell holds.
# The tests' kits (tests/conftest.py puts the same two folders on the path).
sys.path[:0] = [str(REPO / "tests"), str(REPO / "tests" / "runtime")]

from runtime_process import RuntimeServer, running_runtime  # noqa: E402

MiB = 1024 * 1024
KEY = "bench-abuse-key"
FRONT_DOOR_RSS_TARGET_MIB = 50
FRONT_DOOR_P99_TARGET_MS = 50


# -- measuring the server ---------------------------------------------------------------------


def rss_mib(pid: int) -> float:
    """Resident memory of one process, MiB (the runtime's API process: where bodies land)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


class RssSampler:
    """Samples a process's RSS every ``interval`` seconds in a thread; keeps the peak."""

    def __init__(self, pid: int, interval: float = 0.02):
        self.pid, self.interval = pid, interval
        self.peak = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(OSError, RuntimeError):
                self.peak = max(self.peak, rss_mib(self.pid))
            self._stop.wait(self.interval)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *_exc) -> None:
        self._stop.set()
        self._thread.join()


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of one process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


# -- the keyless attacker ---------------------------------------------------------------------


def declared_body_request(path: str, size: int) -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {size}\r\n\r\n"
    ).encode()


@functools.cache
def json_body_chunks(size: int, chunk: int = 64 * 1024) -> tuple[bytes, ...]:
    """A valid JSON object of exactly ``size`` bytes, in chunks: ``{"m": [1,1,...,1]}``, the
    kind that costs a parser most (millions of small values), so a server that parses before it
    checks the key pays for it."""
    head, tail = b'{"m": [', b"1]}"
    middle = size - len(head) - len(tail)
    body = head + b"1," * (middle // 2) + b" " * (middle % 2) + tail
    assert len(body) == size
    return tuple(body[i : i + chunk] for i in range(0, size, chunk))


async def keyless_upload(port: int, size: int, path: str = "/v1/completions") -> tuple[str, float]:
    """One keyless client: headers declaring ``size`` bytes, then the body as fast as the server
    takes it. Returns (the status the server answered, or what ended the exchange; seconds the
    connection stayed open)."""
    started = time.monotonic()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    outcome = "no answer"

    async def read_status() -> None:
        nonlocal outcome
        with contextlib.suppress(OSError, asyncio.IncompleteReadError):
            line = await reader.readline()
            if line:
                outcome = line.split()[1].decode()
            while await reader.read(65536):
                pass

    status_task = asyncio.create_task(read_status())
    try:
        writer.write(declared_body_request(path, size))
        for chunk in json_body_chunks(size):
            if status_task.done():
                break
            writer.write(chunk)
            await writer.drain()
    except OSError as exc:
        if outcome == "no answer":
            outcome = type(exc).__name__
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(status_task, 60)
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return outcome, time.monotonic() - started


async def _flood_once(port: int, connections: int, size: int) -> list[tuple[str, float]]:
    return await asyncio.gather(*(keyless_upload(port, size) for _ in range(connections)))


def _flood_forever(port: int, connections: int, size: int, stop, count) -> None:  # child
    async def worker() -> None:
        while not stop.is_set():
            with contextlib.suppress(OSError):
                await keyless_upload(port, size)
            with count.get_lock():
                count.value += 1

    async def run() -> None:
        await asyncio.gather(*(worker() for _ in range(connections)))

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(run())


# -- front-door sections --------------------------------------------------------------------


def front_door_memory(server: RuntimeServer, connections: int = 150, size: int = 10 * MiB) -> dict:
    pid = server.process.pid
    before = rss_mib(pid)
    started = time.monotonic()
    with RssSampler(pid) as sampler:
        results = asyncio.run(_flood_once(server.port, connections, size))
        time.sleep(1.0)  # what the server still holds once the clients are gone
    after = rss_mib(pid)
    held = [seconds for _, seconds in results]
    return {
        "connections": connections,
        "declared_bytes": size,
        "rss_before_mib": round(before, 1),
        "rss_peak_mib": round(sampler.peak, 1),
        "rss_after_mib": round(after, 1),
        "growth_mib": round(max(sampler.peak, after) - before, 1),
        "outcomes": dict(Counter(outcome for outcome, _ in results)),
        "connection_open_s_median": round(statistics.median(held), 3),
        "connection_open_s_max": round(max(held), 3),
        "wall_s": round(time.monotonic() - started, 2),
        "target_mib": FRONT_DOOR_RSS_TARGET_MIB,
    }


def probe_latencies(url: str, seconds: float, interval: float = 0.02) -> list[float]:
    """/ready latencies (ms) from one keep-alive client, every ``interval`` for ``seconds``."""
    latencies: list[float] = []
    with httpx.Client(timeout=30) as client:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            started = time.perf_counter()
            try:
                status = client.get(url + "/ready").status_code
            except httpx.TimeoutException:
                status = None  # counted at the timeout: the probe failed
            latencies.append((time.perf_counter() - started) * 1000)
            if status not in (200, None):
                raise RuntimeError(f"/ready answered {status}")
            time.sleep(interval)
    return latencies


def front_door_ready_latency(
    server: RuntimeServer, connections: int = 150, size: int = 10 * MiB, seconds: float = 20.0
) -> dict:
    idle = probe_latencies(server.url, seconds / 2)
    stop = multiprocessing.Event()
    count = multiprocessing.Value("q", 0)
    flood = multiprocessing.Process(
        target=_flood_forever, args=(server.port, connections, size, stop, count), daemon=True
    )
    flood.start()
    try:
        time.sleep(2.0)  # let the flood reach full strength
        cpu_before, count_before, started = (
            cpu_seconds(server.process.pid),
            count.value,
            time.monotonic(),
        )
        flooded = probe_latencies(server.url, seconds)
        elapsed = time.monotonic() - started
        server_cpu = cpu_seconds(server.process.pid) - cpu_before
        attacks = count.value - count_before
    finally:
        stop.set()
        flood.join(30)
        if flood.is_alive():
            flood.terminate()
            flood.join(10)

    def summary(values: list[float]) -> dict:
        return {
            "samples": len(values),
            "p50_ms": round(statistics.median(values), 2),
            "p99_ms": round(percentile(values, 99), 2),
            "max_ms": round(max(values), 2),
        }

    return {
        "connections": connections,
        "declared_bytes": size,
        "idle": summary(idle),
        "flooded": summary(flooded),
        "probes_timed_out": sum(1 for v in flooded if v >= 30_000),
        "keyless_connections_per_s": round(attacks / elapsed, 1),
        "server_cpu_share": round(server_cpu / elapsed, 2),
        "target_p99_ms": FRONT_DOOR_P99_TARGET_MS,
    }


def _held_open(port: int, plan: Callable[[socket.socket, float], None], cap: float) -> dict:
    """How long the server keeps a connection that ``plan`` feeds; the status it answers."""
    sock = socket.create_connection(("127.0.0.1", port))
    started = time.monotonic()
    received = b""
    stop = threading.Event()

    def feed() -> None:
        with contextlib.suppress(OSError):
            plan(sock, cap)
        stop.set()

    feeder = threading.Thread(target=feed, daemon=True)
    feeder.start()
    sock.settimeout(0.2)
    closed = False
    while time.monotonic() - started < cap:
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            continue
        except OSError:
            closed = True
            break
        if not chunk:
            closed = True
            break
        received += chunk
    held = time.monotonic() - started
    sock.close()
    status = received.split(b" ", 2)[1].decode() if received.startswith(b"HTTP/") else None
    return {"status": status, "closed_by_server": closed, "held_s": round(held, 2)}


def front_door_slow_headers(server: RuntimeServer, cap: float = 120.0) -> dict:
    def nothing(_sock: socket.socket, cap: float) -> None:
        time.sleep(cap)

    def trickle(sock: socket.socket, cap: float) -> None:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        end = time.monotonic() + cap
        while time.monotonic() < end:
            sock.sendall(b"X")  # one header byte a second, forever
            time.sleep(1.0)

    def huge(sock: socket.socket, _cap: float) -> None:
        sock.sendall(b"GET /ping HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * MiB + b"\r\n\r\n")

    results: dict = {}
    threads = [
        threading.Thread(
            target=lambda name=name, plan=plan: results.__setitem__(
                name, _held_open(server.port, plan, cap)
            )
        )
        for name, plan in (
            ("nothing", nothing),
            ("one_byte_a_second", trickle),
            ("1_mib_header", huge),
        )
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return {"cap_s": cap, **results}


def front_door_markdown(result: dict, command: str) -> str:
    memory, latency, slow = result["memory"], result["ready_latency"], result["slow_headers"]
    rss_ok = memory["growth_mib"] < FRONT_DOOR_RSS_TARGET_MIB
    p99_ok = latency["flooded"]["p99_ms"] < FRONT_DOOR_P99_TARGET_MS
    lines = [
        f"## Front door under keyless abuse ({result['date']})",
        "",
        f"Command: `{command}`  ",
        f"Machine: {result['machine']}; load average {result['load_before']} before, "
        f"{result['load_after']} after; runtime on the demo model, `API_KEYS` set, "
        f"`REQUEST_READ_TIMEOUT_SECONDS={result['read_timeout']}`.",
        "",
        "| measurement | result | target |",
        "| --- | --- | --- |",
        f"| runtime RSS under {memory['connections']} keyless connections each sending a "
        f"declared 10 MiB body | {memory['rss_before_mib']} -> peak {memory['rss_peak_mib']} "
        f"MiB (after: {memory['rss_after_mib']}): **+{memory['growth_mib']} MiB** | "
        f"< {FRONT_DOOR_RSS_TARGET_MIB} MiB: {'met' if rss_ok else '**not met**'} |",
        f"| what those clients got | {memory['outcomes']}; connection open "
        f"median {memory['connection_open_s_median']} s, max {memory['connection_open_s_max']} s"
        " | 401 at once, closed |",
        f"| /ready latency, idle ({latency['idle']['samples']} probes) | p50 "
        f"{latency['idle']['p50_ms']} ms, p99 {latency['idle']['p99_ms']} ms, max "
        f"{latency['idle']['max_ms']} ms | |",
        f"| /ready latency under a keyless 10 MiB flood ({latency['connections']} clients, "
        f"{latency['flooded']['samples']} probes) | p50 {latency['flooded']['p50_ms']} ms, "
        f"**p99 {latency['flooded']['p99_ms']} ms**, max {latency['flooded']['max_ms']} ms | "
        f"p99 < {FRONT_DOOR_P99_TARGET_MS} ms: {'met' if p99_ok else '**not met**'} |",
        f"| the flood meanwhile | {latency['keyless_connections_per_s']} keyless connections/s; "
        f"runtime API process CPU {latency['server_cpu_share']} cores; "
        f"{latency['probes_timed_out']} probe(s) timed out (30 s) | |",
    ]
    for name, label in (
        ("nothing", "a connection that sends nothing"),
        ("one_byte_a_second", "headers at one byte a second"),
        ("1_mib_header", "a 1 MiB header"),
    ):
        seen = slow[name]
        lines.append(
            f"| {label} | status {seen['status']}, "
            f"{'closed by the server' if seen['closed_by_server'] else 'still open'} after "
            f"{seen['held_s']} s | closed within REQUEST_READ_TIMEOUT_SECONDS (431 at once for "
            "the header) |"
        )
    return "\n".join(lines) + "\n"


def front_door_main(args: argparse.Namespace) -> dict:
    load_before = " ".join(f"{x:.2f}" for x in os.getloadavg())
    with tempfile.TemporaryDirectory(prefix="bench-abuse-") as tmp:
        model = Path(tmp) / "demo-model"
        subprocess.run(
            [str(BIN / "llmendpoints-runtime"), "demo-model", str(model)],
            check=True,
            capture_output=True,
        )
        log_dir = REPO / "bench" / "out" / "abuse-logs"
        log_dir.mkdir(parents=True, exist_ok=True)
        with running_runtime(
            model,
            log_dir,
            API_KEYS=KEY,
            REQUEST_READ_TIMEOUT_SECONDS=str(args.read_timeout),
        ) as server:
            memory = front_door_memory(server, args.connections)
            latency = front_door_ready_latency(server, args.connections, seconds=args.seconds)
            slow = front_door_slow_headers(server, cap=args.slow_cap)
            alive = httpx.get(server.url + "/ping", timeout=30).status_code
    return {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{os.cpu_count()} CPU cores ({platform.processor() or platform.machine()})",
        "load_before": load_before,
        "load_after": " ".join(f"{x:.2f}" for x in os.getloadavg()),
        "read_timeout": args.read_timeout,
        "memory": memory,
        "ready_latency": latency,
        "slow_headers": slow,
        "ping_after": alive,
    }


SECTIONS: dict[str, tuple[Callable[[argparse.Namespace], dict], Callable[[dict, str], str]]] = {
    "front-door": (front_door_main, front_door_markdown),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    # Without a section (as `make bench` runs it), every section runs with its defaults.
    parser.set_defaults(
        section=None, connections=150, seconds=20.0, read_timeout=30.0, slow_cap=120.0
    )
    sub = parser.add_subparsers(dest="section")
    front = sub.add_parser("front-door", help="keyless floods, slow headers")
    front.add_argument("--connections", type=int, default=150)
    front.add_argument("--seconds", type=float, default=20.0, help="probe time under the flood")
    front.add_argument("--read-timeout", type=float, default=30.0)
    front.add_argument(
        "--slow-cap", type=float, default=120.0, help="longest wait on one slow-header connection"
    )
    args = parser.parse_args()
    out = REPO / "bench" / "out"
    out.mkdir(parents=True, exist_ok=True)
    command = " ".join([".venv/bin/python", "bench/abuse.py", *sys.argv[1:]])
    for section in [args.section] if args.section else list(SECTIONS):
        run, markdown = SECTIONS[section]
        result = run(args)
        name = section.replace("-", "_")
        (out / f"abuse_{name}.json").write_text(json.dumps(result, indent=2) + "\n")
        print(markdown(result, command))
    return 0


if __name__ == "__main__":
    sys.exit(main())
