"""The gateway under many streams, with stand-in backends (bench/gateway_standin.py), and the two
candidate HTTP stacks (bench/gateway_stacks.py) under the same load for comparison.

    .venv/bin/python bench/gateway_streams.py                     # ~2 minutes
    .venv/bin/python bench/gateway_streams.py --streams 2000 --requests 3000 --targets gateway
    # the gateway with 2 worker processes, and main's gateway (its tree at a git ref):
    .venv/bin/python bench/gateway_streams.py --targets gateway --workers 2
    .venv/bin/python bench/gateway_streams.py --targets gateway --gateway-ref main
    # an older checkout's gateway next to this one, alternated, and where its CPU goes:
    .venv/bin/python bench/gateway_streams.py --targets gateway --before /path/to/old/checkout \
        --rounds 3
    .venv/bin/python bench/gateway_streams.py --targets gateway --before ... --profile DIR

For each target (the real gateway, the minimal bare-ASGI proxy, the minimal aiohttp-server
proxy), in its own process in front of two stand-in backends:

1. CPU per proxied request: ``--requests`` streamed chat completions (8 SSE events each), 100 at
   a time; the target's user+system CPU time over the run (every process of it: a gateway with
   GATEWAY_WORKERS > 1 is a supervisor and its workers) divided by the requests.
2. Open streams: ``--streams`` streaming requests opened at once and held open (the backends
   send an event every 0.5 s for ~15 s); once every one has its first event, the target's RSS
   is sampled; memory per open stream = (RSS with all open - RSS idle) / streams. Every stream
   must end with ``[DONE]`` and status 200: any other ending is an error.

``--before PATH`` adds the target ``gateway-before``: the gateway of an older checkout (its
gateway/ and common/ first on PYTHONPATH; ``--gateway-ref`` needs the ref in this repository's
history, a checkout does not), run next to ``gateway`` in each of ``--rounds`` rounds (the two
swapped every other round).

Target (bench/README.md, the table's target column): 2,000 concurrent open streams on 2 cores with no error; CPU per proxied
request and memory per open stream reported. Results: JSON in bench/out/gateway_streams.json and
a Markdown section on stdout (for bench/RESULTS.md).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import aiohttp
import httpx
import psutil
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gateway_vs_direct import source_tree

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "bench" / "out"
PY = sys.executable


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def spawn(argv: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        argv,
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
        cwd=REPO,
        env={**os.environ, **(env or {})},
    )


def wait_http(url: str, timeout: float = 30) -> None:
    """Until something answers HTTP at ``url`` (any status)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            httpx.get(url, timeout=1)
            return
        except httpx.TransportError:
            time.sleep(0.1)
    raise TimeoutError(url)


@dataclass
class Result:
    target: str
    round: int
    requests: int
    cpu_ms_per_request: float
    system_cpu_ms_per_request: float  # the kernel's share of it (sockets, epoll)
    requests_per_s: float
    streams: int
    streams_ok: int
    stream_errors: dict
    rss_idle_mib: float
    rss_open_mib: float
    kib_per_open_stream: float
    open_all_s: float


def body(chunks: int, interval: float) -> bytes:
    return json.dumps(
        {
            "model": "standin",
            "stream": True,
            "standin_chunks": chunks,
            "standin_interval": interval,
            "messages": [
                {"role": "system", "content": "You are terse."},
                {"role": "user", "content": "hello"},
            ],
        }
    ).encode()


async def one_stream(session, url, data, first: asyncio.Event | None, opened: list) -> str:
    try:
        async with session.post(url, data=data, headers={"content-type": "application/json"}) as r:
            if r.status != 200:
                return f"status {r.status}"
            tail = b""
            got_first = False
            async for chunk in r.content.iter_any():
                if not got_first:
                    got_first = True
                    opened.append(1)
                tail = (tail + chunk)[-64:]
            return "ok" if tail.rstrip().endswith(b"data: [DONE]") else "truncated"
    except Exception as exc:
        return type(exc).__name__


@dataclass(frozen=True)
class Memory:
    rss: int


@dataclass(frozen=True)
class CpuTimes:
    user: float
    system: float


class Tree:
    """A target's processes: CPU and memory of all of them (a gateway's supervisor and workers)."""

    def __init__(self, pid: int) -> None:
        self.main = psutil.Process(pid)

    def _all(self) -> list[psutil.Process]:
        return [self.main, *self.main.children(recursive=True)]

    def cpu_times(self):
        user = system = 0.0
        for process in self._all():
            try:
                times = process.cpu_times()
            except psutil.NoSuchProcess:
                continue
            user, system = user + times.user, system + times.system
        return CpuTimes(user, system)

    def memory_info(self):
        rss = 0
        for process in self._all():
            try:
                rss += process.memory_info().rss
            except psutil.NoSuchProcess:
                continue
        return Memory(rss)


async def cpu_phase(
    url: str, proc: Tree, requests: int, concurrency: int = 100, profile: bool = False
):
    data = body(8, 0.001)
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(total=120)
    ) as s:
        for _ in range(50):  # warm-up
            await one_stream(s, url, data, None, [])
        queue = iter(range(requests))
        outcomes: list[str] = []

        async def worker():
            for _ in queue:
                outcomes.append(await one_stream(s, url, data, None, []))

        if profile:  # bench/_profiled.py: start
            proc.main.send_signal(signal.SIGUSR1)
            await asyncio.sleep(0.2)
        before = proc.cpu_times()
        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - started
        after = proc.cpu_times()
        if profile:  # stop, write the stats
            proc.main.send_signal(signal.SIGUSR2)
            await asyncio.sleep(1.0)
    cpu = (after.user - before.user) + (after.system - before.system)
    bad = [o for o in outcomes if o != "ok"]
    assert not bad, f"errors in the CPU phase: {bad[:5]}"
    system = after.system - before.system
    return cpu / requests * 1000, system / requests * 1000, requests / wall


async def open_streams_phase(url: str, proc: Tree, streams: int):
    rss_idle = proc.memory_info().rss
    data = body(30, 0.5)
    opened: list = []
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    timeout = aiohttp.ClientTimeout(total=300, sock_connect=60)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as s:
        started = time.perf_counter()
        tasks = [
            asyncio.create_task(one_stream(s, url, data, None, opened)) for _ in range(streams)
        ]
        rss_open = rss_idle
        open_all = float("nan")
        while not all(t.done() for t in tasks):
            await asyncio.sleep(0.25)
            rss_open = max(rss_open, proc.memory_info().rss)
            if len(opened) >= streams and open_all != open_all:
                open_all = time.perf_counter() - started
        outcomes = [t.result() for t in tasks]
    errors: dict[str, int] = {}
    for o in outcomes:
        if o != "ok":
            errors[o] = errors.get(o, 0) + 1
    return rss_idle, rss_open, outcomes.count("ok"), errors, open_all


def gateway_code_path(code: Path) -> str:
    """PYTHONPATH that runs the gateway of the checkout ``code`` (older ones have no edge/)."""
    folders = ("gateway", "common", "edge")
    return os.pathsep.join(str(code / f) for f in folders if (code / f).is_dir())


def start_target(
    name: str, port: int, backends: list[str], tmp: Path, args, profile: Path | None = None
) -> subprocess.Popen:
    if name in ("gateway", "gateway-before"):
        if name == "gateway-before" and args.before is None:
            raise ValueError("the target gateway-before needs --before")
        code = args.before if name == "gateway-before" else source_tree(args.gateway_ref)
        endpoints = tmp / "endpoints.yaml"
        endpoints.write_text(
            yaml.safe_dump(
                {"endpoints": [{"name": "standin", "models": ["standin"], "backends": backends}]}
            )
        )
        env = {
            "GATEWAY_ENDPOINTS_FILE": str(endpoints),
            "PORT": str(port),
            "HOST": "127.0.0.1",
            "LLMEP_LOG_LEVEL": "warning",
            "LOG_LEVEL": "warning",  # the same, for an older gateway
            "GATEWAY_REQUIRE_KEYS": "false",  # the replicas are open: a bench of routing
            "GATEWAY_METRICS_PORT": "0",
            "GATEWAY_WORKERS": str(args.workers),
            "PYTHONPATH": gateway_code_path(code),
        }
        # --profile: the gateway under cProfile (bench/_profiled.py), profiled in the CPU
        # phase's measured part only (the supervisor's process: with --workers 1, the gateway).
        profiler = [str(REPO / "bench" / "_profiled.py"), str(profile)] if profile else []
        argv = [PY, *profiler, "-m", "llmendpoints_gateway", "serve"]
        return spawn(argv, tmp / f"{name}.log", env)
    argv = [
        PY,
        str(REPO / "bench" / "gateway_stacks.py"),
        name,
        "--port",
        str(port),
        "--backends",
        ",".join(backends),
    ]
    return spawn(argv, tmp / f"{name}.log")


async def run_target(name: str, round_: int, backends: list[str], args, tmp: Path) -> Result:
    port = free_port()
    profile = args.profile / f"{name}-{round_}.prof" if args.profile is not None else None
    process = start_target(name, port, backends, tmp, args, profile)
    is_gateway = name in ("gateway", "gateway-before")
    try:
        wait_http(
            f"http://127.0.0.1:{port}/v1/models" if is_gateway else f"http://127.0.0.1:{port}/"
        )
        if is_gateway:
            deadline = time.monotonic() + 10
            while httpx.get(f"http://127.0.0.1:{port}/v1/models").json()["data"][0][
                "ready_replicas"
            ] < len(backends):
                assert time.monotonic() < deadline
                time.sleep(0.1)
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        proc = Tree(process.pid)
        cpu_ms, system_ms, rps = await cpu_phase(
            url, proc, args.requests, profile=profile is not None
        )
        rss_idle, rss_open, ok, errors, open_all = await open_streams_phase(url, proc, args.streams)
        return Result(
            name,
            round_,
            args.requests,
            round(cpu_ms, 3),
            round(system_ms, 3),
            round(rps, 1),
            args.streams,
            ok,
            errors,
            round(rss_idle / 2**20, 1),
            round(rss_open / 2**20, 1),
            round((rss_open - rss_idle) / args.streams / 1024, 1),
            round(open_all, 2),
        )
    finally:
        process.terminate()
        process.wait(30)


def markdown(results: list[Result], args) -> str:
    lines = [
        f"### Gateway: {args.streams} open streams and CPU per proxied request ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})",
        "",
        f"`{' '.join(['.venv/bin/python', 'bench/gateway_streams.py', *sys.argv[1:]])}` on {os.cpu_count()} cores "
        f"({platform.machine()}, shared), two stand-in backends; load client in the same machine; "
        f"gateway: {args.workers} worker(s), {args.gateway_ref or 'this checkout'}.",
        "",
        "| target (round) | CPU ms / proxied request (system) | requests/s (100 concurrent) | streams OK | errors | RSS idle MiB | RSS all open MiB | KiB / open stream | all open after s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        lines.append(
            f"| {r.target} ({r.round}) | {r.cpu_ms_per_request} ({r.system_cpu_ms_per_request}) | {r.requests_per_s} | {r.streams_ok}/{r.streams} | "
            f"{r.stream_errors or 0} | {r.rss_idle_mib} | {r.rss_open_mib} | {r.kib_per_open_stream} | {r.open_all_s} |"
        )
    return "\n".join(lines) + "\n"


async def main_async(args) -> int:
    tmp = OUT / "gateway_streams"
    tmp.mkdir(parents=True, exist_ok=True)
    if args.profile is not None:
        args.profile.mkdir(parents=True, exist_ok=True)
    backends, standins = [], []
    for i in range(2):
        port = free_port()
        standins.append(
            spawn(
                [
                    PY,
                    str(REPO / "bench" / "gateway_standin.py"),
                    "--port",
                    str(port),
                    "--name",
                    f"s{i}",
                ],
                tmp / f"standin-{i}.log",
            )
        )
        backends.append(f"http://127.0.0.1:{port}")
    try:
        for b in backends:
            wait_http(b + "/ready")
        results = [
            await run_target(name, round_, backends, args, tmp)
            for round_ in range(1, args.rounds + 1)
            for name in round_targets(args.targets.split(","), round_, args.before is not None)
        ]
    finally:
        for p in standins:
            p.terminate()
            p.wait(30)
    (OUT / "gateway_streams.json").write_text(json.dumps([asdict(r) for r in results], indent=2))
    print(markdown(results, args))
    return 0 if all(r.streams_ok == r.streams for r in results) else 1


def round_targets(targets: list[str], round_: int, before: bool) -> list[str]:
    """The targets of one round (pure): with an older gateway, ``gateway-before`` right after
    ``gateway``, and before it every other round, so neither always runs first."""
    if not before or "gateway" not in targets:
        return targets
    pair = ["gateway", "gateway-before"] if round_ % 2 else ["gateway-before", "gateway"]
    at = targets.index("gateway")
    return [*targets[:at], *pair, *targets[at + 1 :]]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--streams", type=int, default=2000)
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--targets", default="gateway,asgi,aiohttp")
    parser.add_argument("--workers", type=int, default=1, help="the gateway's GATEWAY_WORKERS")
    parser.add_argument("--gateway-ref", help="run the gateway at this git ref (e.g. main)")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument(
        "--before", type=Path, help="also measure the gateway of this older checkout"
    )
    parser.add_argument(
        "--profile",
        type=Path,
        help="profile the gateways' CPU phase (cProfile, CPU clock: bench/_profiled.py); stats "
        "in this folder as <target>-<round>.prof (the CPU numbers then include the profiler's "
        "cost)",
    )
    return asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
