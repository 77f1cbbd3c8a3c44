"""Abuse: what one bad client costs a front door -- the runtime's or the gateway's (issues 16
and 21).

    .venv/bin/python bench/abuse.py front-door        # the runtime, ~2 minutes on 2 cores
    .venv/bin/python bench/abuse.py front-door --target gateway --before /path/to/old/checkout \
        --rounds 2 --slow-cap 40                      # the gateway, old vs this code, ~8 min
    .venv/bin/python bench/abuse.py hold --before /path/to/old/checkout --rounds 2   # ~2 min

Sections (subcommands; API keys on everywhere):

front-door -- the HTTP front door, all keyless. ``--target runtime`` (default): a runtime on the
demo model; ``--target gateway``: a gateway (static endpoints file, ``API_KEYS`` set) in front
of a stand-in backend (bench/gateway_standin.py). Per server:
  - memory: its RSS under 150 connections that each declare and send a 10 MiB body
    (target: < 50 MiB growth; before issue 16's fix the runtime read and parsed the body before
    checking the key: 647 -> 2,154 MiB; issue 21: the gateway, 60 connections, 65 -> 1,029 MiB);
  - probe latency: /ready p99 while 150 keyless clients keep sending 10 MiB bodies (target:
    < 50 ms), next to the same probe on the idle server;
  - slow headers: how long a connection that sends nothing, or one header byte a second, is
    held, and what a 1 MiB header gets.

hold -- held-request memory (issue 21: "a held request costs about 32 MiB"): a gateway with one
static endpoint whose only backend does not listen, so every request to it is held; ``--held``
requests of each of ``--sizes`` body bytes (chat prompts) are sent and held, and the gateway's
RSS growth divided by their number is the cost of one held request (target: about the body's
own size: the body kept once, nothing re-serialised).

``--before PATH`` runs the same section against a checkout of older code too (its
runtime/gateway/common folders first on the server's PYTHONPATH), alternating old and this code
for ``--rounds`` rounds on the same machine.

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
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
# The same launchers as the tests: a clean environment, whatever the caller's shell holds.
# The tests' kits (tests/conftest.py puts the same two folders on the path).
sys.path[:0] = [str(REPO / "tests"), str(REPO / "tests" / "runtime")]

from gateway.harness import launch_gateway, launch_standin, write_endpoints  # noqa: E402
from ports import free_port  # noqa: E402
from proc_kit import cpu_seconds, rss_mib  # noqa: E402
from runtime_process import ServedProcess, running_runtime  # noqa: E402

MiB = 1024 * 1024
KEY = "bench-abuse-key"
FRONT_DOOR_RSS_TARGET_MIB = 50
FRONT_DOOR_P99_TARGET_MS = 50
CHAT = "/v1/chat/completions"


# -- the servers under test, from this checkout or an older one ------------------------------


def code_trees(before: Path | None) -> list[tuple[str, Path]]:
    """(label, checkout) of each code measured: this one, and ``before`` first when given."""
    if before is None:
        return [("this code", REPO)]
    return [("before", before.resolve()), ("after", REPO)]


def pythonpath(code: Path) -> str:
    """The server's packages from ``code``: its folders first on PYTHONPATH (ahead of this venv's
    editable install). Folders an older checkout lacks (edge/) are left out."""
    folders = ("runtime", "gateway", "common", "edge", "operator")
    return os.pathsep.join(str(code / f) for f in folders if (code / f).is_dir())


@contextlib.contextmanager
def running_gateway_of(
    code: Path, log_dir: Path, endpoints: list[dict], **settings: str
) -> Iterator[ServedProcess]:
    """A gateway process of ``code`` (tests/gateway/harness.py's launcher) on a static
    endpoints file, its other settings at their defaults (access log on, as deployed)."""
    path = write_endpoints(log_dir / f"endpoints-{time.monotonic_ns()}.yaml", endpoints)
    gateway = launch_gateway(
        log_dir, PYTHONPATH=pythonpath(code), GATEWAY_ENDPOINTS_FILE=str(path), **settings
    )
    try:
        gateway.wait_http("/health")
        yield gateway
    finally:
        gateway.stop()


def wait_ready_replicas(gateway: ServedProcess, want: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    auth = {"authorization": f"Bearer {KEY}"}
    while time.monotonic() < deadline:
        models = httpx.get(gateway.url + "/v1/models", headers=auth, timeout=5).json()["data"]
        if models and models[0]["ready_replicas"] >= want:
            return
        time.sleep(0.1)
    raise TimeoutError(f"the gateway did not see its backend ready:\n{gateway.log()[-3000:]}")


def loadavg() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def machine() -> str:
    return f"{os.cpu_count()} CPU cores ({platform.processor() or platform.machine()})"


# -- measuring the server ---------------------------------------------------------------------


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
    """A valid JSON request of exactly ``size`` bytes, in chunks: ``{"model": "demo", "m":
    [1,1,...,1]}``, the kind that costs a parser most (millions of small values), so a server
    that parses before it checks the key pays for it (and, with a model named, gets as far as
    the key check)."""
    head, tail = b'{"model": "demo", "m": [', b"1]}"
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


def front_door_memory(server: ServedProcess, connections: int = 150, size: int = 10 * MiB) -> dict:
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
    server: ServedProcess, connections: int = 150, size: int = 10 * MiB, seconds: float = 20.0
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


def front_door_slow_headers(server: ServedProcess, cap: float = 120.0) -> dict:
    def nothing(_sock: socket.socket, cap: float) -> None:
        time.sleep(cap)

    def trickle(sock: socket.socket, cap: float) -> None:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        end = time.monotonic() + cap
        while time.monotonic() < end:
            sock.sendall(b"X")  # one header byte a second, forever
            time.sleep(1.0)

    def huge(sock: socket.socket, _cap: float) -> None:
        sock.sendall(
            b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * MiB + b"\r\n\r\n"
        )

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


def _cells(runs: list[dict], cell: Callable[[dict], str]) -> str:
    return " | ".join(cell(run) for run in runs)


def front_door_markdown(result: dict, command: str) -> str:
    """One column per server run (code, round), one row per measurement."""
    runs = result["runs"]
    what = "runtime" if result["target"] == "runtime" else "gateway"
    lines = [
        f"## Front door under keyless abuse: the {what} ({result['date']})",
        "",
        f"Command: `{command}`  ",
        f"Machine: {result['machine']}; load average {result['load_before']} before, "
        f"{result['load_after']} after. {result['setup']}",
        "",
        "| measurement | " + _cells(runs, lambda r: f"{r['code']} ({r['round']})") + " | target |",
        "| --- | " + " | ".join("---" for _ in runs) + " | --- |",
    ]

    def row(label: str, cell: Callable[[dict], str], target: str = "") -> None:
        lines.append(f"| {label} | {_cells(runs, cell)} | {target} |")

    connections = runs[0]["memory"]["connections"]
    row(
        f"{what} RSS, {connections} keyless connections at once, each sending a declared "
        "10 MiB body",
        lambda r: (
            f"{r['memory']['rss_before_mib']} -> peak {r['memory']['rss_peak_mib']} MiB "
            f"(**+{r['memory']['growth_mib']}**; {r['memory']['rss_after_mib']} 1 s after)"
        ),
        f"< {FRONT_DOOR_RSS_TARGET_MIB} MiB growth",
    )
    row(
        "what those clients got",
        lambda r: (
            f"{r['memory']['outcomes']}; open median "
            f"{r['memory']['connection_open_s_median']} s, max {r['memory']['connection_open_s_max']} s"
        ),
        "401 at once, closed",
    )
    row(
        "/ready idle",
        lambda r: (
            f"p50 {r['ready_latency']['idle']['p50_ms']} ms, p99 "
            f"{r['ready_latency']['idle']['p99_ms']} ms"
        ),
    )
    row(
        f"/ready while {connections} keyless clients keep sending 10 MiB bodies",
        lambda r: (
            f"{r['ready_latency']['flooded']['samples']} probes: p50 "
            f"{r['ready_latency']['flooded']['p50_ms']} ms, **p99 "
            f"{r['ready_latency']['flooded']['p99_ms']} ms**, max "
            f"{r['ready_latency']['flooded']['max_ms']} ms"
        ),
        f"p99 < {FRONT_DOOR_P99_TARGET_MS} ms",
    )
    row(
        "the flood meanwhile",
        lambda r: (
            f"{r['ready_latency']['keyless_connections_per_s']} keyless connections/s; "
            f"{what} process {r['ready_latency']['server_cpu_share']} cores; "
            f"{r['ready_latency']['probes_timed_out']} probe(s) timed out (30 s)"
        ),
    )
    for name, label in (
        ("nothing", "a connection that sends nothing"),
        ("one_byte_a_second", "headers at one byte a second"),
        ("1_mib_header", "a 1 MiB header"),
    ):
        row(
            label,
            lambda r, name=name: (
                f"status {r['slow_headers'][name]['status']}, "
                + (
                    "closed by the server"
                    if r["slow_headers"][name]["closed_by_server"]
                    else "**still open**"
                )
                + f" after {r['slow_headers'][name]['held_s']} s"
            ),
            "431 at once" if name == "1_mib_header" else "408, closed at the read deadline",
        )
    row("/health after it all", lambda r: str(r["alive_after"]), "200")
    return "\n".join(lines) + "\n"


def front_door_main(args: argparse.Namespace) -> dict:
    load_before = loadavg()
    runs: list[dict] = []
    with (
        tempfile.TemporaryDirectory(prefix="bench-abuse-") as tmp,
        contextlib.ExitStack() as stack,
    ):
        log_dir = REPO / "bench" / "out" / "abuse-logs"
        log_dir.mkdir(parents=True, exist_ok=True)
        model = Path(tmp) / "demo-model"
        backend = None
        if args.target == "runtime":
            subprocess.run(
                [str(BIN / "llmendpoints-runtime"), "demo-model", str(model)],
                check=True,
                capture_output=True,
            )
            setup = (
                "One runtime on the demo model, `API_KEYS` set, "
                f"`REQUEST_READ_TIMEOUT_SECONDS={args.read_timeout}`."
            )
        else:
            backend = launch_standin(log_dir, "abuse")
            stack.callback(backend.stop)
            backend.wait_http("/ready")
            setup = (
                "One gateway (static endpoints file: one endpoint, one stand-in backend), "
                f"`API_KEYS` set, `REQUEST_READ_TIMEOUT_SECONDS={args.read_timeout}` (a setting "
                "the old gateway does not have), other settings at their defaults."
            )
        if args.before is not None:
            setup += f" Before: the code of {args.before}; after: this checkout; alternated."
        for round_ in range(1, args.rounds + 1):
            for label, code in code_trees(args.before):
                print(f"front door: {args.target}, {label}, round {round_}", file=sys.stderr)
                settings = {
                    "API_KEYS": KEY,
                    "REQUEST_READ_TIMEOUT_SECONDS": str(args.read_timeout),
                }
                if backend is None:
                    server_cm = running_runtime(
                        model, log_dir, PYTHONPATH=pythonpath(code), **settings
                    )
                else:
                    endpoint = {"name": "demo", "models": ["demo"], "backends": [backend.url]}
                    server_cm = running_gateway_of(code, log_dir, [endpoint], **settings)
                with server_cm as server:
                    if backend is not None:
                        wait_ready_replicas(server, 1)
                    memory = front_door_memory(server, args.connections)
                    latency = front_door_ready_latency(
                        server, args.connections, seconds=args.seconds
                    )
                    slow = front_door_slow_headers(server, cap=args.slow_cap)
                    alive = httpx.get(server.url + "/health", timeout=30).status_code
                runs.append(
                    {
                        "code": label,
                        "round": round_,
                        "memory": memory,
                        "ready_latency": latency,
                        "slow_headers": slow,
                        "alive_after": alive,
                    }
                )
    return {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": machine(),
        "load_before": load_before,
        "load_after": loadavg(),
        "target": args.target,
        "before": str(args.before) if args.before else None,
        "read_timeout": args.read_timeout,
        "setup": setup,
        "runs": runs,
    }


# -- held requests (gateway) -----------------------------------------------------------------


def chat_body(size: int, model: str) -> bytes:
    """A chat request of exactly ``size`` bytes: one user message of words, as a long prompt
    (a document to summarise) is."""
    head = json.dumps(
        {"model": model, "max_tokens": 16, "messages": [{"role": "user", "content": ""}]}
    ).encode()
    filler = size - len(head)
    if filler < 0:
        raise ValueError(f"a chat body cannot be as small as {size} bytes")
    text = ("lorem ipsum " * (filler // 12 + 1))[:filler]
    body = json.dumps(
        {"model": model, "max_tokens": 16, "messages": [{"role": "user", "content": text}]}
    ).encode()
    assert len(body) == size
    return body


def held_requests(gateway: ServedProcess) -> int:
    """``llmendpoints_gateway_held_requests`` summed over endpoints: on the metrics port, or on
    the client port for an older gateway that served /metrics there."""
    for url in (gateway.metrics_url, gateway.url + "/metrics"):
        try:
            text = httpx.get(url, timeout=10).text
        except httpx.TransportError:
            continue
        return int(
            sum(
                float(line.rsplit(" ", 1)[1])
                for line in text.splitlines()
                if line.startswith("llmendpoints_gateway_held_requests{")
            )
        )
    raise RuntimeError("the gateway's /metrics answers on neither port")


def wait_held(gateway: ServedProcess, count: int, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while (held := held_requests(gateway)) != count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{held} requests held, not {count}:\n{gateway.log()[-3000:]}")
        time.sleep(0.1)


def send_to_hold(port: int, body: bytes) -> socket.socket:
    """One keyed chat request, sent whole; the connection stays open (the client waits)."""
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(
        f"POST {CHAT} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    return sock


def hold_memory(gateway: ServedProcess, count: int, size: int) -> dict:
    """RSS growth of the gateway holding ``count`` requests of ``size`` bytes, per request."""
    pid = gateway.process.pid
    body = chat_body(size, "cold")
    # Warm-up: the hold path's first allocations (and the allocator's arenas) are not a cost
    # per request.
    warm = [send_to_hold(gateway.port, body) for _ in range(3)]
    wait_held(gateway, 3)
    for sock in warm:
        sock.close()
    wait_held(gateway, 0)
    time.sleep(1.0)
    before = rss_mib(pid)
    with RssSampler(pid) as sampler:
        started = time.monotonic()
        socks = [send_to_hold(gateway.port, body) for _ in range(count)]
        wait_held(gateway, count)
        time.sleep(1.0)  # settled: every body read, every request waiting
        held = rss_mib(pid)
        seconds = time.monotonic() - started
        for sock in socks:
            sock.close()
        wait_held(gateway, 0)
        time.sleep(1.0)
    after = rss_mib(pid)
    growth = held - before
    return {
        "held": count,
        "body_bytes": size,
        "rss_before_mib": round(before, 1),
        "rss_held_mib": round(held, 1),
        "rss_peak_mib": round(sampler.peak, 1),
        "rss_after_release_mib": round(after, 1),
        "growth_mib": round(growth, 1),
        "mib_per_held_request": round(growth / count, 3),
        "bodies_per_held_request": round(growth * MiB / count / size, 2),
        "peak_mib_per_held_request": round((sampler.peak - before) / count, 3),
        "seconds_to_hold_all": round(seconds, 2),
    }


def hold_main(args: argparse.Namespace) -> dict:
    load_before = loadavg()
    sizes = [int(s) for s in args.sizes.split(",")]
    log_dir = REPO / "bench" / "out" / "abuse-logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    # Room for every held body (this replica's byte budget, GATEWAY_HOLD_MAX_BYTES) and every
    # request of the one key (its share of the queue, GATEWAY_HOLD_KEY_SHARE): the bench
    # measures what holding costs, not where the bounds refuse.
    budget = str(2 * args.held * max(sizes) + 64 * MiB)
    endpoint = {"name": "cold", "models": ["cold"], "backends": [f"http://127.0.0.1:{free_port()}"]}
    runs: list[dict] = []
    for round_ in range(1, args.rounds + 1):
        for label, code in code_trees(args.before):
            print(f"hold: {label}, round {round_}", file=sys.stderr)
            with running_gateway_of(
                code,
                log_dir,
                [endpoint],
                API_KEYS=KEY,
                GATEWAY_HOLD_MAX_BYTES=budget,
                GATEWAY_HOLD_KEY_SHARE="1",
                GATEWAY_HOLD_QUEUE_LENGTH=str(max(1000, 2 * args.held)),
            ) as gateway:
                for size in sizes:
                    runs.append(
                        {"code": label, "round": round_, **hold_memory(gateway, args.held, size)}
                    )
    return {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": machine(),
        "load_before": load_before,
        "load_after": loadavg(),
        "before": str(args.before) if args.before else None,
        "hold_max_bytes": int(budget),
        "runs": runs,
    }


def hold_markdown(result: dict, command: str) -> str:
    lines = [
        f"## Held-request memory: the gateway ({result['date']})",
        "",
        f"Command: `{command}`  ",
        f"Machine: {result['machine']}; load average {result['load_before']} before, "
        f"{result['load_after']} after. One gateway, one static endpoint whose only backend "
        "does not listen (every request to it is held), `API_KEYS` set, one key; "
        f"`GATEWAY_HOLD_MAX_BYTES={result['hold_max_bytes']}` and `GATEWAY_HOLD_KEY_SHARE=1` so "
        "that every request fits (the old gateway has neither). RSS of the gateway process "
        "before the requests, once all are held (1 s settled), and 1 s after their clients left.",
        "",
        "| code (round) | body | held | RSS before -> held MiB (peak) | per held request MiB "
        "| = bodies | RSS after release MiB |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in result["runs"]:
        body = r["body_bytes"]
        size = f"{body // MiB} MiB" if body >= MiB else f"{body // 1024} KiB"
        lines.append(
            f"| {r['code']} ({r['round']}) | {size} | {r['held']} | {r['rss_before_mib']} -> "
            f"{r['rss_held_mib']} ({r['rss_peak_mib']}) | **{r['mib_per_held_request']}** | "
            f"{r['bodies_per_held_request']} | {r['rss_after_release_mib']} |"
        )
    return "\n".join(lines) + "\n"


SECTIONS: dict[str, tuple[Callable[[argparse.Namespace], dict], Callable[[dict, str], str]]] = {
    "front-door": (front_door_main, front_door_markdown),
    "hold": (hold_main, hold_markdown),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    # Without a section (as `make bench` runs it), every section runs with its defaults.
    parser.set_defaults(
        section=None,
        target="runtime",
        before=None,
        rounds=1,
        connections=150,
        seconds=20.0,
        read_timeout=30.0,
        slow_cap=120.0,
        held=50,
        sizes=f"2048,{MiB},{8 * MiB}",
    )
    sub = parser.add_subparsers(dest="section")
    front = sub.add_parser("front-door", help="keyless floods, slow headers")
    hold = sub.add_parser("hold", help="held-request memory (the gateway)")
    for section in (front, hold):
        section.add_argument(
            "--before", type=Path, help="also measure this older checkout, alternating with ours"
        )
        section.add_argument("--rounds", type=int, default=1)
    front.add_argument("--target", choices=("runtime", "gateway"), default="runtime")
    front.add_argument("--connections", type=int, default=150)
    front.add_argument("--seconds", type=float, default=20.0, help="probe time under the flood")
    front.add_argument("--read-timeout", type=float, default=30.0)
    front.add_argument(
        "--slow-cap", type=float, default=120.0, help="longest wait on one slow-header connection"
    )
    hold.add_argument("--held", type=int, default=50, help="requests held at once")
    hold.add_argument(
        "--sizes", default=f"2048,{MiB},{8 * MiB}", help="body bytes, comma-separated"
    )
    args = parser.parse_args()
    out = REPO / "bench" / "out"
    out.mkdir(parents=True, exist_ok=True)
    command = " ".join([".venv/bin/python", "bench/abuse.py", *sys.argv[1:]])
    for section in [args.section] if args.section else ["front-door"]:
        run, markdown = SECTIONS[section]
        result = run(args)
        name = section.replace("-", "_")
        if section == "front-door":
            name += f"_{args.target}"
        (out / f"abuse_{name}.json").write_text(json.dumps(result, indent=2) + "\n")
        print(markdown(result, command))
    return 0


if __name__ == "__main__":
    sys.exit(main())
